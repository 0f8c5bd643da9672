"""A request's life in the engine: what it asked for, what it holds, what it produced.

Holdings are explicit so the leak check (invariant 7) can account for every page and slot:
``pages`` (KV pages for positions [0, len(pages) * page_size), one refcount each), ``slot`` (its own
live linear-state slot, never shared with the tree: invariant 2) and ``locked`` (the radix node
its cache hit pinned). ``num_computed`` tokens of ``all_ids`` are fed to dispatched steps (in the
pools, or about to be: device work is ordered by data, ARCHITECTURE.md invariant 3).

Overlapped scheduling: the next step is planned while the previous one runs, so a request may have
``num_inflight`` sampled tokens the host has not seen yet (0 or 1). The step that feeds such a token
takes it from the previous step's device output (``Row.feed``). ``epoch`` counts releases (finish,
abort, preemption): a row planned before a release is stale when its step is committed, and
``Scheduler.commit`` drops it instead of applying it to a request that has moved on.
"""

from __future__ import annotations

import dataclasses
import enum
import itertools

from jaxserve.sampling_params import SamplingParams

_arrivals = itertools.count()


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclasses.dataclass(eq=False)
class Request:
    rid: str
    prompt_ids: list[int]
    sampling: SamplingParams
    cache_ids: list[int] | None = None  # content keys (invariant 5); token ids for text prompts
    stop: tuple[str, ...] = ()
    images: object | None = None  # jaxserve.multimodal.prompt.ImagePrompt of a prompt with images

    status: Status = Status.WAITING
    arrival: int = dataclasses.field(default_factory=lambda: next(_arrivals))
    output_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    cached_tokens: int = 0  # prompt tokens served from the prefix cache at (first) admission
    num_preemptions: int = 0

    # Holdings (see module docstring).
    pages: list[int] = dataclasses.field(default_factory=list)
    slot: int | None = None
    locked: object | None = None
    num_computed: int = 0
    restore_src: int = 0  # tree slot to copy into `slot` at the next step (a hit); 0 = none
    num_inflight: int = 0  # sampled by a dispatched step, not yet committed (see module docstring)
    inflight_row: int = -1  # the row of that step which samples it
    epoch: int = 0  # bumped by every release; rows planned under an older epoch are stale

    def __post_init__(self):
        if self.cache_ids is None:
            self.cache_ids = list(self.prompt_ids)

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_ids(self) -> int:
        """``len(all_ids)``, without building it (the scheduler asks every step)."""
        return len(self.prompt_ids) + len(self.output_ids)

    def ids_between(self, start: int, stop: int) -> list[int]:
        """``all_ids[start:stop]`` (0 <= start <= stop), without building ``all_ids``."""
        p = len(self.prompt_ids)
        if stop <= p:
            return self.prompt_ids[start:stop]
        if start >= p:
            return self.output_ids[start - p:stop - p]
        return self.prompt_ids[start:] + self.output_ids[:stop - p]

    @property
    def all_cache_ids(self) -> list[int]:
        """Cache keys of every token so far: prompt keys, then output token ids."""
        return self.cache_ids + self.output_ids

    def cache_ids_until(self, stop: int) -> list[int]:
        """``all_cache_ids[:stop]`` (0 <= stop), without building ``all_cache_ids``."""
        keys = self.cache_ids
        if stop <= len(keys):
            return keys[:stop]
        return keys + self.output_ids[:stop - len(keys)]

    @property
    def num_pending(self) -> int:
        """Tokens not yet fed to a step: the rest of ``all_ids`` plus a sampled token still in flight.
        Every step feeds some of them and samples when it feeds the last one: a decode is a 1-token
        chunk, and after a preemption the output so far is recomputed with the prompt the same way.
        0 once the request has sampled all ``max_tokens`` (the last may still be in flight)."""
        out = len(self.output_ids) + self.num_inflight
        if out >= self.sampling.max_tokens:
            return 0
        return len(self.prompt_ids) + out - self.num_computed
