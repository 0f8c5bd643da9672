"""Scheduling policies: the decisions the scheduler leaves to a plug-in, one small hook each.

A policy decides; the scheduler (scheduler.py) executes and keeps every invariant. Each hook reads
the state it is given through ``SchedulerView`` and must not mutate it (requests, queues, the
cache): the scheduler owns all bookkeeping, so a policy can never leak a page or share a slot.
The hooks and what the default (``Policy`` itself, which is FCFS) answers:

  order(waiting, view)            admission order of the waiting requests       arrival order
  token_budget(view)              tokens in the next step (decodes + prefill),  the compiled maximum
                                  i.e. the decode/prefill mix of a step
  chunk_size(req, budget, view)   tokens of ``req`` in the next step (<= budget; budget
                                  0 holds it back this step)
  victim(req, candidates, view,   whom to preempt so ``req`` can go on:         the newest arrival while
         admitting)               a running request out of pages                running; nobody for an
                                  (``admitting`` False), or a waiting request   admission
                                  that cannot be admitted (True, asked only
                                  when ``admission_preempts``)
  observe(plan)                   sees every planned step (for accounting)      nothing
  eviction                        radix-cache eviction priority: which KV       None: the cache's LRU
                                  leaves and snapshot slots go first
                                  (``jaxserve.cache.radix.Eviction``)

Built-ins (``POLICIES``, ``--policy`` on ``serve`` and ``jaxserve sim``): ``fcfs``, ``lpm``
(longest prefix match), ``dfs-weight`` (SGLang's), ``priority`` (``SamplingParams.priority``, lower
first, preempting), ``spjf`` (shortest predicted job first) and ``fair`` (virtual token counters per
``SamplingParams.tenant``). A research policy subclasses ``Policy``, overrides the hooks it cares
about and is selected as ``--policy package.module:ClassName``.
"""

from __future__ import annotations

import importlib
from collections import defaultdict
from typing import TYPE_CHECKING, Callable, Sequence

from jaxserve.engine.request import Request

if TYPE_CHECKING:
    from jaxserve.cache.radix import Eviction
    from jaxserve.engine.scheduler import Scheduler, StepPlan


class SchedulerView:
    """What a policy may read of the scheduler: queues (as tuples), pool headroom, limits, the
    prefix cache through side-effect-free queries, and the scheduler's clock. Read only."""

    __slots__ = ("_s",)

    def __init__(self, scheduler: Scheduler):
        self._s = scheduler

    @property
    def running(self) -> tuple[Request, ...]:
        return tuple(self._s.running)

    @property
    def waiting(self) -> tuple[Request, ...]:
        return tuple(self._s.waiting)

    @property
    def free_pages(self) -> int:
        return self._s.pages.num_free

    @property
    def free_slots(self) -> int | None:
        return None if self._s.slots is None else self._s.slots.num_free

    @property
    def max_prefill_tokens(self) -> int:
        return self._s.max_prefill_tokens

    @property
    def max_running(self) -> int:
        return self._s.max_running

    @property
    def page_size(self) -> int:
        return self._s.page_size

    def now(self) -> float:
        return self._s.clock()

    def prefix_len(self, req: Request) -> int:
        """Tokens the prefix cache would serve ``req`` right now (no LRU or counter side effects)."""
        return self._s.cache.peek(req.all_cache_ids)

    def prefix_path(self, req: Request) -> tuple[int, ...]:
        """Ids of the tree nodes ``req``'s ids run through, root first: requests that share a
        cached prefix share a leading run of ids (see ``HybridRadixCache.peek_path``)."""
        return self._s.cache.peek_path(req.all_cache_ids)


class Policy:
    """The default policy, FCFS, and the base of every other: override only the hooks you need.
    ``admission_preempts``: ask ``victim(..., admitting=True)`` for the first waiting request in
    ``order`` when it does not fit (a full running set, or too few pages); off by default because
    it costs an extra ``order`` call per step."""

    name = "fcfs"
    admission_preempts = False
    eviction: Eviction | None = None

    def order(self, waiting: Sequence[Request], view: SchedulerView) -> list[Request]:
        """Waiting requests in admission order: FCFS (a preempted request keeps its place)."""
        return sorted(waiting, key=lambda r: r.arrival)

    def token_budget(self, view: SchedulerView) -> int:
        """Tokens the next step may carry, decodes included: 1 .. ``view.max_prefill_tokens``."""
        return view.max_prefill_tokens

    def chunk_size(self, req: Request, budget: int, view: SchedulerView) -> int:
        """Tokens of ``req`` in the next step, 0 .. ``budget`` (the scheduler takes at most what
        is pending); 0 holds it back this step."""
        return budget

    def victim(self, req: Request, candidates: Sequence[Request], view: SchedulerView,
               admitting: bool) -> Request | None:
        """One of ``candidates`` (running, none planned in this step yet) to preempt for ``req``,
        or None to let ``req`` wait. Default: the newest arrival, never for an admission."""
        if admitting or not candidates:
            return None
        return max(candidates, key=lambda r: r.arrival)

    def observe(self, plan: StepPlan) -> None:
        """Called with every planned step, after ``schedule``."""


FCFS = Policy


class LongestPrefixMatch(Policy):
    """Longest cached prefix first (SGLang's ``lpm``): admits requests whose prefix is cached while it
    still is, which raises the hit rate under memory pressure; ties in arrival order."""

    name = "lpm"

    def order(self, waiting, view):
        return sorted(waiting, key=lambda r: (-view.prefix_len(r), r.arrival))


class DFSWeight(Policy):
    """SGLang's ``dfs-weight``: walk the prefix tree depth first, heaviest subtree (most waiting
    requests under it) first, emitting a node's requests after its subtree. Requests that share a
    cached prefix are admitted together, so the prefix is used while it is cached. Ties: the
    subtree whose first request arrived first."""

    name = "dfs-weight"

    def order(self, waiting, view):
        children: dict[tuple[int, ...], dict[int, tuple[int, ...]]] = defaultdict(dict)
        at: dict[tuple[int, ...], list[Request]] = defaultdict(list)
        weight: dict[tuple[int, ...], int] = defaultdict(int)
        first: dict[tuple[int, ...], int] = {}
        for req in sorted(waiting, key=lambda r: r.arrival):
            path = view.prefix_path(req)
            at[path].append(req)
            for depth in range(len(path) + 1):
                node = path[:depth]
                weight[node] += 1
                first.setdefault(node, req.arrival)
                if depth < len(path):
                    children[node][path[depth]] = path[:depth + 1]
        out: list[Request] = []
        stack: list[tuple[tuple[int, ...], bool]] = [((), False)]
        while stack:  # iterative post-order: children (heaviest first), then the node's own requests
            node, expanded = stack.pop()
            if expanded:
                out.extend(at[node])
                continue
            stack.append((node, True))
            kids = sorted(children[node].values(), key=lambda c: (-weight[c], first[c]))
            stack.extend((c, False) for c in reversed(kids))
        return out


class PriorityClasses(Policy):
    """``SamplingParams.priority`` classes, lower value first (vLLM's convention), FCFS within a
    class. A waiting request that does not fit preempts the newest running request of the worst
    class worse than its own; under page pressure the newest of the worst class goes first."""

    name = "priority"
    admission_preempts = True

    def order(self, waiting, view):
        return sorted(waiting, key=lambda r: (r.sampling.priority, r.arrival))

    def victim(self, req, candidates, view, admitting):
        if not candidates:
            return None
        worst = max(candidates, key=lambda r: (r.sampling.priority, r.arrival))
        if admitting and worst.sampling.priority <= req.sampling.priority:
            return None
        return worst


def max_tokens_predictor(req: Request) -> float:
    """The output length a request may reach: exact for benchmark traffic (``ignore_eos``), an upper
    bound otherwise."""
    return req.sampling.max_tokens


class ShortestPredictedJobFirst(Policy):
    """Least predicted remaining work first: predicted output tokens still to come (one step each)
    plus uncached prompt tokens in units of the step budget. ``predictor(req)`` -> predicted output
    length (default ``max_tokens``; a research predictor goes here). Ties in arrival order. Long jobs
    can starve under sustained load: that is the policy, not a bug."""

    name = "spjf"

    def __init__(self, predictor: Callable[[Request], float] = max_tokens_predictor):
        self.predictor = predictor

    def order(self, waiting, view):
        budget = view.max_prefill_tokens

        def work(r: Request) -> float:
            uncached = len(r.all_cache_ids) - view.prefix_len(r)
            return max(0.0, self.predictor(r) - len(r.output_ids)) + uncached / budget

        return sorted(waiting, key=lambda r: (work(r), r.arrival))


class FairShare(Policy):
    """Fair share across tenants (``SamplingParams.tenant``: the API key or ``user``) with virtual
    token counters (VTC, Sheng et al., OSDI '24): each tenant's counter grows by the service its
    requests get (``input_weight`` per fed token, ``output_weight`` per sampled token) and the
    waiting requests of the least-served tenant go first. A tenant that becomes active is lifted to
    the smallest counter among tenants already active, so idling banks no credit. A noisy tenant
    therefore gets at most its share of admissions while others wait, however many it queues."""

    name = "fair"

    def __init__(self, input_weight: float = 1.0, output_weight: float = 2.0):
        self.input_weight, self.output_weight = input_weight, output_weight
        self.counters: dict[str, float] = defaultdict(float)
        self._active: set[str] = set()

    def order(self, waiting, view):
        active = {r.sampling.tenant for r in waiting} | {r.sampling.tenant for r in view.running}
        if self._active:
            floor = min((self.counters[t] for t in self._active & active), default=None)
            if floor is None:
                floor = min(self.counters[t] for t in self._active)
            for t in active - self._active:
                self.counters[t] = max(self.counters[t], floor)
        self._active = active
        return sorted(waiting, key=lambda r: (self.counters[r.sampling.tenant], r.arrival))

    def observe(self, plan):
        for row in plan.rows:
            prompt_fed = max(0, min(row.start + len(row.tokens), len(row.req.prompt_ids)) - row.start)
            self.counters[row.req.sampling.tenant] += self.input_weight * prompt_fed + self.output_weight * row.samples


POLICIES: dict[str, type[Policy]] = {p.name: p for p in (
    Policy, LongestPrefixMatch, DFSWeight, PriorityClasses, ShortestPredictedJobFirst, FairShare)}


def make_policy(name: str) -> Policy:
    """A built-in by name, or a plug-in as ``package.module:ClassName`` (constructed without
    arguments). Raises ValueError naming what is available."""
    if name in POLICIES:
        return POLICIES[name]()
    if ":" in name:
        module, _, attr = name.partition(":")
        try:
            cls = getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as e:
            raise ValueError(f"cannot load scheduling policy {name!r}: {e}") from None
        if not (isinstance(cls, type) and issubclass(cls, Policy)):
            raise ValueError(f"{name!r} is not a scheduling policy (subclass jaxserve.engine.policy.Policy)")
        return cls()
    raise ValueError(f"unknown scheduling policy {name!r}; have {sorted(POLICIES)} or package.module:ClassName")
