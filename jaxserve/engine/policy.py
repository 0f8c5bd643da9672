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
    from jaxserve.cache.radix import Eviction, Probe
    from jaxserve.engine.scheduler import Scheduler, StepPlan


class SchedulerView:
    """What a policy may read of the scheduler: queues (as tuples), pool headroom, limits, the
    prefix cache through side-effect-free queries, and the scheduler's clock. Read only.

    Prefix queries are memoized per request (``HybridRadixCache.probe``): asked again, a request
    whose cached prefix nothing has touched costs O(1), and one whose prefix changed resumes its walk
    where the last one ended, instead of matching the whole prompt from the root. The answers are
    exactly those of a fresh ``peek`` / ``peek_path``; only a policy that ranks a long queue every
    step notices the difference, in time."""

    __slots__ = ("_s", "_probes")

    def __init__(self, scheduler: Scheduler):
        self._s = scheduler
        self._probes: dict[Request, tuple[int, Probe]] = {}  # request -> (its output length then, probe)

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
        return self._probe(req).length

    def prefix_path(self, req: Request) -> tuple[int, ...]:
        """Ids of the tree nodes ``req``'s ids run through, root first: requests that share a
        cached prefix share a leading run of ids (see ``HybridRadixCache.peek_path``)."""
        return self._probe(req).path()

    def _probe(self, req: Request) -> Probe:
        """``req``'s probe, from its last one while its ids are the same: a request's cache ids only
        ever grow by output tokens, so their count identifies them."""
        n_out = len(req.output_ids)
        memo = self._probes.get(req)
        since = memo[1] if memo is not None and memo[0] == n_out else None
        probe = self._s.cache.probe(req.all_cache_ids if n_out else req.cache_ids, since)
        if probe is not since:
            self._probes[req] = (n_out, probe)
            if memo is None:
                self._forget_gone()
        return probe

    def _forget_gone(self) -> None:
        """Drop the probes of requests neither waiting nor running, once they are half the memo, so
        it stays O(live requests) without a scan per query."""
        live = len(self._s.waiting) + len(self._s.running)
        if len(self._probes) > 2 * live + 64:
            keep = {*self._s.waiting, *self._s.running}
            self._probes = {r: m for r, m in self._probes.items() if r in keep}


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
    still is, which raises the hit rate under memory pressure; ties in arrival order.

    ``fcfs_above``: while more requests than this wait, order them FCFS instead. SGLang does so above
    128 waiting requests to bound its matching time; here the default (None) ranks every queue,
    since ``SchedulerView.prefix_len`` is memoized and costs about one dictionary lookup per waiting
    request and step. Set it (``LongestPrefixMatch(fcfs_above=128)``, or a subclass selected with
    ``--policy package.module:ClassName``) to study SGLang's behaviour under long queues."""

    name = "lpm"

    def __init__(self, fcfs_above: int | None = None):
        if fcfs_above is not None and fcfs_above < 0:
            raise ValueError(f"fcfs_above must be >= 0 or None, got {fcfs_above}")
        self.fcfs_above = fcfs_above

    def order(self, waiting, view):
        fcfs = super().order(waiting, view)
        if self.fcfs_above is not None and len(waiting) > self.fcfs_above:
            return fcfs
        return sorted(fcfs, key=lambda r: -view.prefix_len(r))  # stable: ties stay in arrival order


class DFSWeight(Policy):
    """SGLang's ``dfs-weight``: walk the prefix tree depth first, heaviest subtree (most waiting
    requests under it) first, emitting a node's requests after its subtree. Requests that share a
    cached prefix are admitted together, so the prefix is used while it is cached. Ties: the
    subtree whose first request arrived first."""

    name = "dfs-weight"

    def order(self, waiting, view):
        root = _Subtree(0)
        for req in sorted(waiting, key=lambda r: r.arrival):  # so a subtree's first request comes first
            node = root
            node.weight += 1
            for uid in view.prefix_path(req):
                kid = node.kids.get(uid)
                if kid is None:
                    kid = node.kids[uid] = _Subtree(req.arrival)
                kid.weight += 1
                node = kid
            node.own.append(req)
        out: list[Request] = []
        stack: list[tuple[_Subtree, bool]] = [(root, False)]
        while stack:  # iterative post-order: children (heaviest first), then the node's own requests
            node, expanded = stack.pop()
            if expanded:
                out.extend(node.own)
                continue
            stack.append((node, True))
            kids = sorted(node.kids.values(), key=lambda k: (-k.weight, k.first))
            stack.extend((k, False) for k in reversed(kids))
        return out


class _Subtree:
    """A node of the trie of waiting requests' prefix paths: ``weight`` requests at or below it,
    the first of them arrived at ``first``, ``own`` those whose path ends here."""

    __slots__ = ("kids", "own", "weight", "first")

    def __init__(self, first: int):
        self.kids: dict[int, _Subtree] = {}
        self.own: list[Request] = []
        self.weight = 0
        self.first = first


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
            uncached = len(r.cache_ids) + len(r.output_ids) - view.prefix_len(r)
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
