"""The engine: requests in, tokens out, one step at a time; and the offline ``LLM`` API on top.

``Engine.step()`` runs one iteration: the scheduler plans a step, the executor runs it on the
device, the scheduler commits it, and the engine turns new tokens into text (incremental
detokenization, stop strings). The executor is the only part that touches the device; the
``Executor`` protocol lets tests and the scheduling-research harness swap in a fake one.

Debug mode (``debug_snapshot_checksums``): every snapshot slot is checksummed when the tree takes
it and again before a hit restores from it; ``snapshot_checksum_mismatches`` counts differences.
A non-zero count means a tree slot was written after donation — the corruption this design exists
to make impossible.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Protocol, Sequence

from jaxserve.engine.request import Request, Status
from jaxserve.engine.scheduler import Scheduler, StepPlan
from jaxserve.generate import SamplingParams
from jaxserve.tokenizer import IncrementalDecoder, Tokenizer


class Executor(Protocol):
    def execute(self, plan: StepPlan) -> tuple[list[int], list[float]]:
        """Run one step; returns the sampled token and its logprob per row of the plan."""

    def barrier(self) -> None:
        """Block until every dispatched step has finished on the device."""

    def slot_checksum(self, slot: int) -> int:
        """A checksum of one linear-state slot (all layers, conv and recurrent state)."""


@dataclasses.dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    output_ids: list[int]
    text: str
    logprobs: list[float]
    finish_reason: str | None
    cached_tokens: int
    new_text: str = ""  # text added by the last step (for streaming)
    new_ids: Sequence[int] = ()

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class Engine:
    def __init__(self, scheduler: Scheduler, executor: Executor, vocab_size: int, tokenizer: Tokenizer | None = None,
                 debug_snapshot_checksums: bool = False):
        self.scheduler = scheduler
        self.vocab_size = vocab_size
        self.executor = executor
        self.tokenizer = tokenizer
        self.requests: dict[str, Request] = {}
        self._decoders: dict[str, IncrementalDecoder] = {}
        self._ids = itertools.count()
        self.snapshot_checksum_mismatches = 0
        self._checksums: dict[int, int] = {}
        scheduler.barrier = executor.barrier
        if debug_snapshot_checksums:
            scheduler.on_donate = self._record_checksum
            scheduler.on_restore = self._verify_checksum

    # ------------------------------------------------------------------ requests

    def add_request(self, prompt: str | Sequence[int], sampling: SamplingParams | None = None,
                    stop: Sequence[str] = (), request_id: str | None = None,
                    cache_ids: Sequence[int] | None = None) -> str:
        sampling = sampling or SamplingParams()
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("a text prompt needs a tokenizer")
            prompt_ids = self.tokenizer.encode(prompt)
        else:
            prompt_ids = [int(t) for t in prompt]
        if not prompt_ids:
            raise ValueError("prompt is empty")
        vocab = self.vocab_size
        if min(prompt_ids) < 0 or max(prompt_ids) >= vocab:
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        rid = request_id or f"req-{next(self._ids)}"
        if rid in self.requests:
            raise ValueError(f"request id {rid!r} is already in use")
        req = Request(rid, prompt_ids, sampling, cache_ids=list(cache_ids) if cache_ids else None, stop=tuple(stop))
        self.scheduler.add(req)
        self.requests[rid] = req
        if self.tokenizer is not None:
            self._decoders[rid] = IncrementalDecoder(self.tokenizer)
        return rid

    def abort(self, rid: str) -> bool:
        req = self.scheduler.abort(rid)
        self._forget(rid)
        return req is not None

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    # ------------------------------------------------------------------ stepping

    def step(self) -> list[RequestOutput]:
        """Run one step. Returns an output for every request that got a token or finished."""
        plan = self.scheduler.schedule()
        if plan is None:
            if self.scheduler.waiting and not self.scheduler.running:
                # add() admits only requests that fit an idle engine; failing here is a bug, not load.
                raise RuntimeError(f"scheduler could not admit {self.scheduler.waiting[0].rid} into an idle engine")
            return []
        tokens, logprobs = self.executor.execute(plan)
        self.scheduler.commit(plan, tokens, logprobs)
        outputs = []
        for row in plan.rows:
            if not row.samples:
                continue
            req = row.req
            new_text = self._detokenize(req)
            outputs.append(self._output(req, new_text, req.output_ids[-1:]))
            if req.status is Status.FINISHED:
                self._forget(req.rid)
        return outputs

    def _detokenize(self, req: Request) -> str:
        """Append the newest token's text; a stop string ends the request and cuts the text before it."""
        dec = self._decoders.get(req.rid)
        if dec is None:
            return ""
        text = req.text + dec.feed(req.output_ids[-1])
        if req.status is Status.FINISHED:
            text += dec.flush()
        if req.stop:
            start = max(0, len(req.text) - max(map(len, req.stop)) + 1)
            hits = [i for i in (text.find(s, start) for s in req.stop) if i >= 0]
            if hits:
                text = text[: min(hits)]
                if req.status is Status.FINISHED:
                    req.finish_reason = "stop"
                else:
                    self.scheduler.finish(req, "stop")
        new = text[len(req.text):]
        req.text = text
        return new

    def _output(self, req: Request, new_text: str = "", new_ids: Sequence[int] = ()) -> RequestOutput:
        return RequestOutput(req.rid, req.prompt_ids, list(req.output_ids), req.text, list(req.logprobs),
                             req.finish_reason, req.cached_tokens, new_text, list(new_ids))

    def _forget(self, rid: str) -> None:
        self.requests.pop(rid, None)
        self._decoders.pop(rid, None)

    def run_until_done(self) -> None:
        while self.has_work():
            self.step()

    # ------------------------------------------------------------------ checks

    def check_invariants(self) -> None:
        self.scheduler.check_invariants()

    def _record_checksum(self, slot: int) -> None:
        self._checksums[slot] = self.executor.slot_checksum(slot)

    def _verify_checksum(self, slot: int) -> None:
        expected = self._checksums.get(slot)
        if expected is not None and self.executor.slot_checksum(slot) != expected:
            self.snapshot_checksum_mismatches += 1

    def generate(self, prompts: Sequence[str | Sequence[int]],
                 sampling: SamplingParams | Sequence[SamplingParams] | None = None,
                 stop: Sequence[str] = ()) -> list[RequestOutput]:
        """Offline batch generation (vLLM's ``LLM.generate``): all prompts are queued at once and
        run with continuous batching; outputs come back in prompt order."""
        samplings = sampling if isinstance(sampling, (list, tuple)) else [sampling] * len(prompts)
        if len(samplings) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(samplings)} sampling params")
        rids = [self.add_request(p, s, stop) for p, s in zip(prompts, samplings)]
        held = {rid: self.requests[rid] for rid in rids}
        self.run_until_done()
        return [self._output(held[rid]) for rid in rids]
