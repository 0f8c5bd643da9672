"""The engine: requests in, tokens out, one step at a time; and the offline ``LLM`` API on top.

``Engine.step()`` runs one iteration: the scheduler plans a step, the executor dispatches it to
the device, the scheduler commits it, and the engine turns new tokens into text (incremental
detokenization, stop strings). The executor is the only part that touches the device; the
``Executor`` protocol lets tests and the scheduling-research harness swap in a fake one.

Overlapped scheduling (``overlap=True``, the serving default): step N+1 is planned and dispatched
before step N's tokens are read back, so the host's work (scheduling, batch packing, dispatch,
detokenization) runs while the device computes. A token sampled by step N and fed by step N+1 never
visits the host on the way: step N+1 reads it from step N's device output (``Row.feed``). The host
learns each token one step later, for stop checks and streaming; a request that stops has at most
one extra row computed and dropped (scheduler.py says why early frees are safe).

A step that fails on the device (an out-of-memory, a kernel error) fails the requests it carried
(``finish_reason == "error"``) and nothing else: if the failure consumed the pools, they are
re-created, the prefix cache is flushed and every other running request is recomputed from its
prompt and output so far.

Debug mode (``debug_snapshot_checksums``): every snapshot slot is checksummed when the tree takes
it and again before a hit restores from it; ``snapshot_checksum_mismatches`` counts differences.
A non-zero count means a tree slot was written after donation — the corruption this design exists
to make impossible.
"""

from __future__ import annotations

import dataclasses
import itertools
import sys
import traceback
from typing import Any, Protocol, Sequence

from jaxserve.engine.request import Request, Status
from jaxserve.engine.scheduler import Scheduler, StepPlan
from jaxserve.sampling_params import SamplingParams, check_prompt_ids
from jaxserve.sampler import check_representable
from jaxserve.tokenizer import IncrementalDecoder, Tokenizer


class Executor(Protocol):
    def dispatch(self, plan: StepPlan) -> Any:
        """Start one step without waiting for it; returns a handle for ``fetch``. A row with
        ``feed >= 0`` takes its last token from the previous dispatched step's row ``feed``."""

    def fetch(self, handle: Any) -> tuple[list[int], list[float]]:
        """Wait for a dispatched step; returns the sampled token and its logprob per row of its plan."""

    def recover(self) -> bool:
        """After a failed step: True if the pools were lost (and re-created empty), else False."""

    def barrier(self) -> None:
        """Block until every dispatched step has finished on the device."""

    def slot_checksum(self, slot: int) -> int:
        """A checksum of one linear-state slot (all layers, conv and recurrent state)."""


@dataclasses.dataclass(slots=True)
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


@dataclasses.dataclass(frozen=True)
class EngineStats:
    """A snapshot of the engine's load and monotonic counters, for metrics: taken between steps (on
    the engine's thread), then safe to read anywhere. Pools count usable pages/slots (the reserved
    null one excluded); a model without linear-attention layers has no slots (0 of 0)."""

    running: int
    waiting: int
    pages_used: int
    pages_total: int
    slots_used: int
    slots_total: int
    tree_pages: int  # KV pages the prefix tree references
    tree_snapshots: int  # linear-state slots the prefix tree holds
    preemptions: int
    failed_steps: int
    checksum_mismatches: int  # debug_snapshot_checksums; must stay 0
    cache: dict[str, int]  # the prefix cache's counters (CacheStats: queries, hits, hit tokens, ...)
    barriers: dict[str, tuple[int, float]]  # where the host waited for the device: {site: (count, seconds)}


class Engine:
    def __init__(self, scheduler: Scheduler, executor: Executor, vocab_size: int, tokenizer: Tokenizer | None = None,
                 debug_snapshot_checksums: bool = False, overlap: bool = False, output_history: bool = True):
        """``output_history``: every output carries the request's whole output so far (``output_ids``,
        ``logprobs``: copies, O(length) per token, what the server and ``generate`` read). False:
        only a finished request's output does; the others carry ``new_ids`` (and ``new_text``) with
        empty ``output_ids`` / ``logprobs``, for a caller that reads only final outputs (the simulator)."""
        self.scheduler = scheduler
        self.overlap = overlap
        self.output_history = output_history
        self._in_flight: list[tuple[StepPlan, Any]] = []  # dispatched, not yet committed (oldest first)
        self.failed_steps = 0
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
                    cache_ids: Sequence[int] | None = None, images: Any = None) -> str:
        """``images``: a prompt with images comes as ids with its placeholders expanded, the
        content-keyed ``cache_ids`` and the ``ImagePrompt`` (all three from
        ``jaxserve.multimodal.prompt.prepare``)."""
        sampling = sampling or SamplingParams()
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("a text prompt needs a tokenizer")
            prompt_ids = self.tokenizer.encode(prompt)
        else:
            prompt_ids = list(map(int, prompt))
        vocab = self.vocab_size
        check_prompt_ids(prompt_ids, vocab)
        check_representable(sampling.temperature, sampling.top_k)
        if any(not 0 <= t < vocab for t in sampling.stop_token_ids):
            raise ValueError(f"stop_token_ids must be in [0, {vocab})")
        rid = request_id or f"req-{next(self._ids)}"
        if rid in self.requests:
            raise ValueError(f"request id {rid!r} is already in use")
        req = Request(rid, prompt_ids, sampling, cache_ids=list(cache_ids) if cache_ids else None, stop=tuple(stop),
                      images=images)
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
        return self.scheduler.has_work() or bool(self._in_flight)

    def stats(self) -> EngineStats:
        s = self.scheduler
        slots = s.slots
        return EngineStats(
            running=len(s.running), waiting=len(s.waiting),
            pages_used=s.pages.capacity - s.pages.num_free, pages_total=s.pages.capacity,
            slots_used=0 if slots is None else slots.capacity - slots.num_free,
            slots_total=0 if slots is None else slots.capacity,
            tree_pages=s.cache.num_tree_pages, tree_snapshots=s.cache.num_snapshots,
            preemptions=s.num_preemptions, failed_steps=self.failed_steps,
            checksum_mismatches=self.snapshot_checksum_mismatches, cache=s.cache.stats.as_dict(),
            barriers={site: (b.count, b.seconds) for site, b in (("admission", s.admission_barriers),
                                                                   ("donation", s.donation_barriers))})

    # ------------------------------------------------------------------ stepping

    def step(self) -> list[RequestOutput]:
        """Plan and dispatch one step, then commit the oldest step in flight (with ``overlap``, the
        previous one; without, this one). Returns an output for every request that got a token,
        finished or failed in the committed step."""
        plan = self.scheduler.schedule()
        if plan is None and not self._in_flight:
            if self.scheduler.waiting and not self.scheduler.running:
                # add() admits only requests that fit an idle engine; failing here is a bug, not load.
                raise RuntimeError(f"scheduler could not admit {self.scheduler.waiting[0].rid} into an idle engine")
            return []
        outputs: list[RequestOutput] = []
        dispatched = False
        if plan is not None:
            try:
                self._in_flight.append((plan, self.executor.dispatch(plan)))
                dispatched = True
            except Exception as e:  # noqa: BLE001 - a failed step fails its requests, not the engine
                outputs += self._step_failed(plan, e)
        keep = 1 if self.overlap and dispatched else 0
        while len(self._in_flight) > keep:
            done, handle = self._in_flight.pop(0)
            try:
                tokens, logprobs = self.executor.fetch(handle)
            except Exception as e:  # noqa: BLE001
                outputs += self._step_failed(done, e)
                continue
            outputs += self._commit(done, tokens, logprobs)
        return outputs

    def _commit(self, plan: StepPlan, tokens: list[int], logprobs: list[float]) -> list[RequestOutput]:
        epochs = [row.req.epoch for row in plan.rows]
        self.scheduler.commit(plan, tokens, logprobs)
        outputs = []
        for row, epoch in zip(plan.rows, epochs):
            if not row.samples or row.epoch != epoch:  # no token, or released after planning (dropped)
                continue
            req = row.req
            new_text = self._detokenize(req) if self._decoders else ""
            if self.output_history or req.status is Status.FINISHED:
                outputs.append(self._output(req, new_text, req.output_ids[-1:]))
            else:
                outputs.append(RequestOutput(req.rid, req.prompt_ids, [], req.text, [], req.finish_reason,
                                             req.cached_tokens, new_text, req.output_ids[-1:]))
            if req.status is Status.FINISHED:
                self._forget(req.rid)
        return outputs

    def _step_failed(self, plan: StepPlan, error: BaseException) -> list[RequestOutput]:
        """Fail the live requests of ``plan``; if the device lost the pools, start them afresh."""
        self.failed_steps += 1
        print(f"jaxserve: a step of {len(plan.rows)} rows ({plan.num_tokens} tokens) failed; failing its "
              f"requests: {error!r}", file=sys.stderr)
        traceback.print_exception(error, file=sys.stderr)
        outputs = []
        for row in plan.rows:
            req = row.req
            if row.epoch == req.epoch and req.status is Status.RUNNING:
                self.scheduler.finish(req, "error")
                outputs.append(self._output(req))
                self._forget(req.rid)
        self.scheduler.abandon(plan)
        if self.executor.recover():
            for lost, _ in self._in_flight:
                self.scheduler.abandon(lost)
            self._in_flight.clear()
            self.scheduler.lose_device_state()
        return outputs

    def _detokenize(self, req: Request) -> str:
        """Append the newest token's text; a stop string ends the request and cuts the text before it."""
        dec = self._decoders.get(req.rid)
        if dec is None:
            return ""
        text = req.text + dec.feed(req.output_ids[-1])
        if req.status is Status.FINISHED:
            text += dec.flush()
        if req.stop and len(text) > len(req.text):  # a new match must end in the new text: search only
            start = max(0, len(req.text) - max(map(len, req.stop)) + 1)  # the window that can hold one
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
        return RequestOutput(req.rid, req.prompt_ids, req.output_ids[:], req.text, req.logprobs[:],
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
                 stop: Sequence[str] = (), cache_ids: Sequence[Sequence[int] | None] | None = None,
                 images: Sequence[Any] | None = None) -> list[RequestOutput]:
        """Offline batch generation (vLLM's ``LLM.generate``), the one path every offline caller
        takes (``LLM.generate``, ``jaxserve generate``): all prompts are queued at once and run with
        continuous batching; outputs come back in prompt order. ``cache_ids[i]`` / ``images[i]``:
        prompt i's content keys and ``ImagePrompt`` (None for a text prompt), as ``add_request``
        takes them."""
        n = len(prompts)
        samplings = sampling if isinstance(sampling, (list, tuple)) else [sampling] * n
        per_prompt = {"sampling params": samplings, "cache id lists": cache_ids or [None] * n,
                      "image prompts": images or [None] * n}
        for what, values in per_prompt.items():
            if len(values) != n:
                raise ValueError(f"{n} prompts but {len(values)} {what}")
        rids = [self.add_request(p, s, stop, cache_ids=k, images=im)
                for p, s, k, im in zip(prompts, samplings, per_prompt["cache id lists"], per_prompt["image prompts"])]
        held = {rid: self.requests[rid] for rid in rids}
        self.run_until_done()
        return [self._output(held[rid]) for rid in rids]
