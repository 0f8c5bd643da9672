"""The scheduler: which tokens of which requests the next step computes, and the bookkeeping after.

Host-only: it chooses page ids and slot ids and never looks at array contents (ARCHITECTURE.md). One
engine iteration is ``plan = schedule()`` -> the runner executes the step -> ``commit(plan, ...)``.

Overlapped scheduling (``Engine(overlap=True)``): step N+1 is planned and dispatched before step N
is committed, so ``schedule()`` advances each request's ``num_computed`` when it plans a row (not at
commit), a row may feed a token sampled by the step still in flight (``Row.feed``: that step's row
index; the device reads it from that step's output), and ``commit`` drops rows whose request was
released after they were planned (``Row.epoch``), freeing their snapshot slots. Freeing early is
safe because every pool write and read happens in a step and steps run in dispatch order: a page or
slot freed while step N is in flight can only be reused by a step after N.

Every step mixes decodes (1-token rows) and prefill chunks (continuous batching, chunked prefill)
under a token budget (at most ``max_prefill_tokens``). Running requests go first (decodes, then
unfinished prefills, in arrival order), then the policy admits waiting requests while budget, rows,
pages and slots allow; at most ``max_chunked_rows`` rows of a step hold more than one token (the
GDN / KDA chunk grid is sized for that many: ``ModelConfig.chunked_rows``). When a running request cannot get a page, the tree's unlocked KV is evicted
first, then a running request is preempted (released, requeued, recomputed later). The policy
(policy.py) makes the choices: admission order, the step's token budget, each row's chunk, the
preemption victim (by default the newest) and, through the cache, the eviction order; the
scheduler checks each answer and keeps the bookkeeping.

Cache protocol (hybrid models), the invariants of ARCHITECTURE.md made concrete:
- admission: ``match`` gives the deepest cached prefix that has a live snapshot (invariant 4);
  the request locks it, adopts its pages (incref) and gets its OWN fresh slot; the tree's
  snapshot is copied into that slot inside the next step (``Row.restore_src``). A barrier is
  taken before a hit is admitted (invariant 3).
- snapshots: whenever a step takes a request across a ×64 boundary the tree has no snapshot
  for yet, the step also writes the state there into a freshly allocated slot (the private,
  write-once clone of copy-on-donate, invariant 2). ``commit`` inserts it, after a barrier,
  together with the pages covering the prefix. Decode steps that cross a boundary do the same,
  so a finished request has donated the last aligned boundary of prompt plus output.
- release (finish, abort, preemption): whole computed pages are offered to the tree, the node
  lock is dropped, the request's pages are decref'd and its slot freed (invariant 7).
"""

from __future__ import annotations

import dataclasses
import operator
import time
from typing import Callable

from jaxserve.cache.allocator import PageAllocator, SlotAllocator
from jaxserve.cache.radix import HybridRadixCache
from jaxserve.config import CHUNKED_ROWS, SNAPSHOT_INTERVAL
from jaxserve.engine.policy import FCFS, Policy, SchedulerView
from jaxserve.engine.request import Request, Status


_by_arrival = operator.attrgetter("arrival")


@dataclasses.dataclass(slots=True)
class Row:
    """One request's share of a step: feed ``tokens`` at positions ``start``..; restore first if
    ``restore_src``; write snapshots (tokens consumed in this row, destination slot). Slotted: the
    scheduler makes one per running request per step."""

    req: Request
    start: int
    tokens: list[int]
    restore_src: int = 0
    snapshots: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    samples: bool = False  # the row feeds the request's last pending token: its sampled token is kept
    feed: int = -1  # >= 0: the last token is the one the previous step sampled in its row ``feed``
    sample_idx: int = 0  # which output token the row samples (the sampling key's counter)
    epoch: int = 0  # ``req.epoch`` when planned; a different epoch at commit means the row is stale


@dataclasses.dataclass
class StepPlan:
    rows: list[Row]

    @property
    def num_tokens(self) -> int:
        return sum(len(r.tokens) for r in self.rows)


@dataclasses.dataclass
class BarrierStats:
    count: int = 0
    seconds: float = 0.0

    def timed(self, barrier: Callable[[], None]) -> None:
        t0 = time.perf_counter()
        barrier()
        self.seconds += time.perf_counter() - t0
        self.count += 1


class Scheduler:
    def __init__(self, *, pages: PageAllocator, slots: SlotAllocator | None, cache: HybridRadixCache,
                 page_size: int, max_prefill_tokens: int, max_running: int, max_pages_per_seq: int,
                 eos_token_ids: tuple[int, ...] = (), policy: Policy | None = None,
                 barrier: Callable[[], None] = lambda: None, snapshot_interval: int = SNAPSHOT_INTERVAL,
                 clock: Callable[[], float] = time.monotonic, max_chunked_rows: int = CHUNKED_ROWS):
        self.pages, self.slots, self.cache = pages, slots, cache
        self.hybrid = slots is not None
        self.page_size = page_size
        self.max_prefill_tokens = max_prefill_tokens
        self.max_running = max_running
        self.max_chunked_rows = max_chunked_rows  # rows of more than one token per step (0: any)
        self.max_pages_per_seq = max_pages_per_seq
        self.eos_token_ids = frozenset(eos_token_ids)
        self.policy = policy or FCFS()
        self.clock = clock  # what policies read as "now" (the simulator passes its virtual clock)
        self.view = SchedulerView(self)
        if self.policy.eviction is not None:
            cache.eviction = self.policy.eviction
        self.barrier = barrier
        self.interval = snapshot_interval
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.admission_barriers = BarrierStats()
        self.donation_barriers = BarrierStats()
        self.num_preemptions = 0
        self.pending_snapshots: set[int] = set()  # slots of planned snapshots not yet committed
        # Debug hooks: called with a tree slot right after it is donated / before it is restored.
        self.on_donate: Callable[[int], None] | None = None
        self.on_restore: Callable[[int], None] | None = None

    # ------------------------------------------------------------------ requests in and out

    def add(self, req: Request) -> None:
        need = -(-(len(req.prompt_ids) + req.sampling.max_tokens) // self.page_size)
        if need > self.max_pages_per_seq:
            raise ValueError(
                f"prompt ({len(req.prompt_ids)} tokens) + max_tokens ({req.sampling.max_tokens}) exceeds the "
                f"maximum context of {self.max_pages_per_seq * self.page_size} tokens"
            )
        if need > self.pages.capacity:
            raise ValueError(f"request needs {need} KV pages; the pool has {self.pages.capacity}")
        req.status = Status.WAITING
        self.waiting.append(req)

    def abort(self, rid: str) -> Request | None:
        """Drop a queued or running request and free everything it held. Returns it, or None."""
        for queue in (self.waiting, self.running):
            for req in queue:
                if req.rid == rid:
                    queue.remove(req)
                    self._release(req)
                    req.status, req.finish_reason = Status.FINISHED, "abort"
                    return req
        return None

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ------------------------------------------------------------------ scheduling

    def schedule(self) -> StepPlan | None:
        policy, view = self.policy, self.view
        if policy.admission_preempts and self.waiting:
            self._make_room()
        budget = policy.token_budget(view)
        if not isinstance(budget, int) or not 1 <= budget <= self.max_prefill_tokens:
            raise ValueError(f"policy {policy.name!r}: token_budget {budget!r} is not in 1..{self.max_prefill_tokens}")
        rows: list[Row] = []
        # Decodes first, then unfinished prefills, each in arrival order. ``pending`` holds until
        # the request's own row: only a preemption changes it earlier, and that is skipped below.
        decodes, prefills = [], []
        for req in sorted(self.running, key=_by_arrival):
            pending = req.num_pending
            (prefills if pending > 1 else decodes).append((req, pending))
        ps = self.page_size
        chunked, cap = 0, self.max_chunked_rows or float("inf")  # rows of more than one token (the chunk grid)
        for req, pending in decodes + prefills:
            if budget == 0:
                break
            if req.status is not Status.RUNNING:  # preempted while making room for an earlier row
                continue
            n = min(pending, self._chunk(req, budget))
            if n == 0:  # its last token is sampled by the step in flight, or the policy holds it back
                continue
            if n > 1 and chunked >= cap:  # its next chunk waits for a later step
                continue
            if -(-(req.num_computed + n) // ps) > len(req.pages) and not self._reserve_pages(req, n, protect=rows):
                continue
            rows.append(self._row(req, n, len(rows)))
            budget -= n
            chunked += n > 1
        for req in policy.order(list(self.waiting), view):
            if budget == 0 or len(self.running) >= self.max_running or chunked >= cap:
                break
            if req.status is not Status.WAITING:
                raise ValueError(f"policy {policy.name!r}: order returned {req.rid}, which is not waiting")
            chunk = self._chunk(req, budget)
            if chunk == 0:
                continue
            n = self._admit(req, chunk)
            if n == 0:
                break
            rows.append(self._row(req, n, len(rows)))
            budget -= n
            chunked += n > 1
        if not rows:
            return None
        plan = StepPlan(rows)
        policy.observe(plan)
        return plan

    def _chunk(self, req: Request, budget: int) -> int:
        n = self.policy.chunk_size(req, budget, self.view)
        if not isinstance(n, int) or not 0 <= n <= budget:
            raise ValueError(f"policy {self.policy.name!r}: chunk_size {n!r} for {req.rid} is not in 0..{budget}")
        return n

    def _victim(self, req: Request, candidates: list[Request], admitting: bool) -> Request | None:
        victim = self.policy.victim(req, tuple(candidates), self.view, admitting) if candidates else None
        if victim is not None and not any(victim is c for c in candidates):
            raise ValueError(f"policy {self.policy.name!r}: victim {getattr(victim, 'rid', victim)!r} "
                             f"is not one of the candidates")
        return victim

    def _make_room(self) -> None:
        """Preemption for admission (``Policy.admission_preempts``): while the waiting request the
        policy ranks first does not fit, preempt whom the policy names for it. Runs before any row
        is planned, so a victim never has a row in this step."""
        ranked = self.policy.order(list(self.waiting), self.view)
        if not ranked:
            return
        head = ranked[0]
        while not self._fits(head):
            victim = self._victim(head, list(self.running), admitting=True)
            if victim is None:
                return
            self.preempt(victim)

    def _fits(self, req: Request) -> bool:
        """A running place and enough free or evictable pages for ``req``'s first full chunk."""
        if len(self.running) >= self.max_running:
            return False
        ids = req.all_cache_ids
        cached = self.cache.peek(ids)
        need = -(-min(len(ids), cached + self.max_prefill_tokens) // self.page_size) - cached // self.page_size
        return need <= self.pages.num_free or need <= self.pages.num_free + self.cache.evictable_pages()

    def _row(self, req: Request, n: int, index: int) -> Row:
        """Plan ``n`` tokens of ``req`` as row ``index`` of the step, and account for them as fed."""
        start = req.num_computed
        stop = start + n
        tokens = req.ids_between(start, stop)
        feed = -1
        if len(tokens) < n:  # the last token is still being sampled by the step in flight
            assert len(tokens) == n - 1 and req.num_inflight == 1 and req.inflight_row >= 0, req
            tokens, feed = tokens + [0], req.inflight_row
        sampled = len(req.output_ids) + req.num_inflight  # output tokens sampled so far, committed or not
        samples = stop == len(req.prompt_ids) + sampled
        row = Row(req, start, tokens, req.restore_src, [], samples, feed, sampled,
                  req.epoch)  # positional: the per-row cost of keywords shows in a 10k-request simulation
        req.num_computed, req.restore_src = stop, 0  # the restore happens in this row's step
        if samples:
            req.num_inflight += 1
            req.inflight_row = index
        first = (start // self.interval + 1) * self.interval
        if self.hybrid and first <= stop:  # the row crosses a boundary (a decode: once in 64 steps)
            for boundary in range(first, stop + 1, self.interval):
                if self._tree_has_snapshot(req, boundary):
                    continue
                slot = self._alloc_slot()
                if slot is None:
                    break  # the cache is only less useful; correctness does not depend on it
                row.snapshots.append((boundary - start, slot))
                self.pending_snapshots.add(slot)
        return row

    def _tree_has_snapshot(self, req: Request, boundary: int) -> bool:
        # The ids may lack a token in flight: the answer is then only "no" (never a false yes).
        return self.cache.has_snapshot_at(req.cache_ids_until(boundary + 1), boundary, req.locked)

    def _admit(self, req: Request, budget: int) -> int:
        """Admit ``req`` with its first chunk of at most ``budget`` tokens; 0 if it cannot start now."""
        match = self.cache.match(req.all_cache_ids)
        self.cache.lock(match.node)
        slot = self._alloc_slot() if self.hybrid else None
        if self.hybrid and slot is None:
            self.cache.unlock(match.node)
            return 0
        req.pages = list(match.pages)
        self.pages.incref(req.pages)
        req.locked, req.slot, req.num_computed = match.node, slot, match.length
        n = min(req.num_pending, budget)
        if not self._reserve_pages(req, n, protect=None, preempt=False):
            self.pages.decref(req.pages)
            self.cache.unlock(match.node)
            if slot is not None:
                self.slots.free(slot)
            req.pages, req.locked, req.slot, req.num_computed = [], None, None, 0
            return 0
        if match.length > 0 and match.snapshot_slot is not None:
            self.admission_barriers.timed(self.barrier)
            req.restore_src = match.snapshot_slot
            if self.on_restore:
                self.on_restore(match.snapshot_slot)
        if req.num_preemptions == 0:
            req.cached_tokens = match.length
        self.waiting.remove(req)
        self.running.append(req)
        req.status = Status.RUNNING
        return n

    def _alloc_slot(self) -> int | None:
        slot = self.slots.alloc()
        if slot is None and self.cache.evict_snapshots(1):
            slot = self.slots.alloc()
        return slot

    def _reserve_pages(self, req: Request, n: int, protect: list[Row] | None, preempt: bool = True) -> bool:
        """Make ``req.pages`` cover positions [0, num_computed + n): evict tree KV, then preempt
        the newest running request that is not ``req`` or in ``protect`` (rows already planned)."""
        need = -(-(req.num_computed + n) // self.page_size) - len(req.pages)
        while need > 0:
            got = self.pages.alloc(need)
            if got is not None:
                req.pages.extend(got)
                return True
            if self.cache.evict_kv(need - self.pages.num_free) > 0:
                continue
            if not preempt:
                return False
            planned = {id(r.req) for r in protect or ()}
            victim = self._victim(req, [r for r in self.running if r is not req and id(r) not in planned],
                                  admitting=False)
            if victim is None:
                return False
            self.preempt(victim)
        return True

    def preempt(self, req: Request) -> None:
        """Retract a running request: release everything, requeue it to recompute prompt + output."""
        self.running.remove(req)
        self._release(req)
        req.num_preemptions += 1
        self.num_preemptions += 1
        req.status = Status.WAITING
        self.waiting.append(req)

    # ------------------------------------------------------------------ after the step

    def commit(self, plan: StepPlan, tokens: list[int], logprobs: list[float]) -> list[Request]:
        """Account for an executed step; returns the requests that finished in it. Rows of requests
        released since the plan (``Row.epoch``) are dropped and their snapshot slots freed."""
        if any(row.snapshots for row in plan.rows):
            self.donation_barriers.timed(self.barrier)
        finished = []
        for row, tok, lp in zip(plan.rows, tokens, logprobs):
            req = row.req
            if row.snapshots:
                self.pending_snapshots.difference_update(slot for _, slot in row.snapshots)
            if row.epoch != req.epoch:
                for _, slot in row.snapshots:
                    self.slots.free(slot)
                continue
            for consumed, slot in row.snapshots:
                self._donate(req, row.start + consumed, slot)
            if row.samples:
                req.num_inflight -= 1
                req.output_ids.append(int(tok))
                req.logprobs.append(float(lp))
                reason = self._finish_reason(req)
                if reason:
                    self.finish(req, reason)
                    finished.append(req)
        return finished

    def _donate(self, req: Request, boundary: int, slot: int) -> None:
        n_pages = boundary // self.page_size
        self.cache.insert(req.cache_ids_until(boundary), req.pages[:n_pages], {boundary: slot}, hint=req.locked)
        if self.on_donate and slot in self.cache.owned_slots():
            self.on_donate(slot)

    def _finish_reason(self, req: Request) -> str | None:
        tok = req.output_ids[-1]
        if tok in req.sampling.stop_token_ids or (not req.sampling.ignore_eos and tok in self.eos_token_ids):
            return "stop"
        if len(req.output_ids) >= req.sampling.max_tokens:
            return "length"
        return None

    def finish(self, req: Request, reason: str) -> None:
        self.running.remove(req)
        self._release(req)
        req.status, req.finish_reason = Status.FINISHED, reason

    def _release(self, req: Request, offer: bool = True) -> None:
        """Give back everything ``req`` holds; ``offer``: its whole computed pages go to the tree."""
        # Tokens fed to a step but still being sampled have no cache id yet: offer only known ones.
        whole = min(req.num_computed, len(req.cache_ids) + len(req.output_ids)) // self.page_size
        if offer and whole and req.locked is not None:
            # Plain attention keeps every whole page; hybrid trees keep what a snapshot covers.
            self.cache.insert(req.cache_ids_until(whole * self.page_size), req.pages[:whole], {})
        if req.locked is not None:
            self.cache.unlock(req.locked)
        self.pages.decref(req.pages)
        if req.slot is not None:
            self.slots.free(req.slot)
        req.pages, req.slot, req.locked, req.num_computed, req.restore_src = [], None, None, 0, 0
        req.num_inflight, req.inflight_row, req.epoch = 0, -1, req.epoch + 1

    # ------------------------------------------------------------------ failed steps

    def abandon(self, plan: StepPlan) -> None:
        """Forget a planned step that will never be committed (it failed, or ran on lost pools):
        free the snapshot slots it was to fill. Its requests are dealt with by the caller."""
        for row in plan.rows:
            for _, slot in row.snapshots:
                if slot in self.pending_snapshots:
                    self.pending_snapshots.discard(slot)
                    self.slots.free(slot)

    def lose_device_state(self) -> None:
        """The pools' contents are gone (a failed step consumed them and they were re-created):
        requeue every running request to recompute from its prompt and output so far, offering
        nothing to the tree, then flush the tree, whose pages and snapshots described lost bytes."""
        for req in list(self.running):
            self.running.remove(req)
            self._release(req, offer=False)
            req.num_preemptions += 1
            req.status = Status.WAITING
            self.waiting.append(req)
        self.waiting.sort(key=lambda r: r.arrival)
        self.cache.flush()

    # ------------------------------------------------------------------ checks

    def check_invariants(self) -> None:
        """Every page and slot is free, held by a live request, or held by the tree, with refcounts
        that add up (invariant 7). Call between steps."""
        self.cache.check_invariants()
        tree_pages = self.cache.owned_pages()
        holders: dict[int, int] = {p: 1 for p in tree_pages}
        for req in self.running:
            assert req.status is Status.RUNNING, f"{req.rid} in running with status {req.status}"
            assert len(set(req.pages)) == len(req.pages), f"{req.rid} holds a page twice"
            for p in req.pages:
                holders[p] = holders.get(p, 0) + 1
        for req in self.waiting:
            assert not req.pages and req.slot is None and req.locked is None, f"waiting {req.rid} holds resources"
        for p in range(1, self.pages.capacity + 1):
            expected = holders.get(p, 0)
            assert self.pages.refcount(p) == expected, f"page {p}: refcount {self.pages.refcount(p)}, holders {expected}"
        if self.hybrid:
            tree_slots = self.cache.owned_slots()
            req_slots = [r.slot for r in self.running]
            assert None not in req_slots, "a running hybrid request without a slot"
            assert len(set(req_slots)) == len(req_slots), "two requests share a slot"
            assert not tree_slots & set(req_slots), f"slots shared by a request and the tree: {tree_slots & set(req_slots)}"
            pending = self.pending_snapshots
            assert not pending & (tree_slots | set(req_slots)), f"planned snapshot slots also held: {pending}"
            held = tree_slots | set(req_slots) | pending
            for s in range(1, self.slots.capacity + 1):
                assert self.slots.is_free(s) == (s not in held), f"slot {s}: free={self.slots.is_free(s)}, held={s in held}"
