"""A request's life in the engine: what it asked for, what it holds, what it produced.

Holdings are explicit so the leak check (invariant 7) can account for every page and slot:
``pages`` (KV pages for positions [0, len(pages) * page_size), one refcount each), ``slot`` (its own
live linear-state slot, never shared with the tree: invariant 2) and ``locked`` (the radix node
its cache hit pinned). ``num_computed`` tokens of ``all_ids`` are in the pools.
"""

from __future__ import annotations

import dataclasses
import enum
import itertools

from jaxserve.generate import SamplingParams

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

    def __post_init__(self):
        if self.cache_ids is None:
            self.cache_ids = list(self.prompt_ids)

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def all_cache_ids(self) -> list[int]:
        """Cache keys of every token so far: prompt keys, then output token ids."""
        return self.cache_ids + self.output_ids

    @property
    def num_pending(self) -> int:
        """Tokens of ``all_ids`` not yet in the pools. Every step feeds some of them and samples when it
        feeds the last one: a decode is a 1-token chunk, and after a preemption the output so far is
        recomputed together with the prompt the same way."""
        return len(self.all_ids) - self.num_computed
