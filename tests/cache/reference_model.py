"""An independent, page-level model of HybridRadixCache, and a harness running both in lockstep.

The model has no nodes. Its state is a dict from every cached page-aligned prefix (a tuple of
ids) to ``Entry(page, slot, t, st)``: the page holding that prefix's last page of KV, the
snapshot at its end, and the two LRU times. Lock targets are a Counter of prefixes. Node
boundaries are derived, never stored: a cached prefix ends a node iff it is a leaf, a branch
point, carries a snapshot, or is a lock target (the tree's canonical form). Every operation is
written from the cache's contract (ARCHITECTURE.md "The prefix cache"), not from the tree's code.

The harness plays the scheduler: requests match, lock, hold their own pages and one live slot,
donate private clones, release. After every step it runs the tree's invariant battery, compares
the tree with the model prefix by prefix, and checks the accounting of ARCHITECTURE.md invariant 7:
every page's refcount is exactly (tree holds it) + (number of live requests holding it), and every
slot is free, held by exactly one live request, or held by the tree — never two of those.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from jaxserve.cache import HybridRadixCache, Node, PageAllocator, SlotAllocator

Prefix = tuple[int, ...]


@dataclass
class Entry:
    page: int
    slot: int | None = None
    t: int = 0       # last time the KV of this prefix was used (match / insert path)
    st: int = 0      # last time the snapshot here was restored or donated


@dataclass
class RefMatch:
    length: int
    pages: list[int]
    slot: int | None
    target: Prefix   # the prefix whose node ``lock`` pins


class RefCache:
    def __init__(self, page_size: int, interval: int, hybrid: bool, max_per_path: int | None,
                 request_refs: Callable[[int], int]):
        self.ps, self.interval, self.hybrid, self.max_per_path = page_size, interval, hybrid, max_per_path
        self.request_refs = request_refs    # live requests' references to a page (decides "freed")
        self.e: dict[Prefix, Entry] = {}
        self.nkids: Counter[Prefix] = Counter()
        self.locks: Counter[Prefix] = Counter()
        self.clock = 0

    # ---- derived structure
    def parent(self, p: Prefix) -> Prefix:
        return p[:-self.ps]

    def is_end(self, p: Prefix) -> bool:
        return p == () or self.nkids[p] != 1 or self.e[p].slot is not None or self.locks[p] > 0

    def pins(self, p: Prefix) -> int:
        return sum(c for q, c in self.locks.items() if q[:len(p)] == p)

    def segment(self, p: Prefix) -> list[Prefix]:
        """The prefixes of the node ending at ``p``, deepest first."""
        seg, q = [p], self.parent(p)
        while q != () and not self.is_end(q):
            seg.append(q)
            q = self.parent(q)
        return seg

    def node_containing(self, p: Prefix) -> Prefix:
        while not self.is_end(p):
            (p,) = [q for q in self.e if len(q) == len(p) + self.ps and q[:len(p)] == p]
        return p

    # ---- operations
    def match(self, ids: Sequence[int]) -> RefMatch:
        ids, ps = tuple(ids), self.ps
        limit = max(0, (len(ids) - 1) // ps * ps)
        k = best = 0
        while k + ps <= limit and ids[:k + ps] in self.e:
            k += ps
            if self.e[ids[:k]].slot is not None:
                best = k
        length = best if self.hybrid else k
        self.clock += 1
        for j in range(ps, length + 1, ps):
            self.e[ids[:j]].t = self.clock
        slot = None
        if self.hybrid and length:
            self.e[ids[:length]].st = self.clock
            slot = self.e[ids[:length]].slot
        target = self.node_containing(ids[:length]) if length else ()
        return RefMatch(length, [self.e[ids[:j]].page for j in range(ps, length + 1, ps)], slot, target)

    def lock(self, target: Prefix) -> None:
        self.locks[target] += 1

    def unlock(self, target: Prefix) -> None:
        assert self.locks[target] > 0, "model: unlock of an unlocked target"
        self.locks[target] -= 1

    def insert(self, ids: Sequence[int], pages: Sequence[int], snaps: dict[int, int]) -> None:
        ids, ps = tuple(ids), self.ps
        cut = len(ids) // ps * ps
        target = max(snaps, default=0) if self.hybrid else cut
        self.clock += 1
        attached = []
        for j in range(ps, target + 1, ps):
            p = ids[:j]
            if p not in self.e:
                self.e[p] = Entry(pages[j // ps - 1])
                self.nkids[self.parent(p)] += 1
            self.e[p].t = self.clock
            if j in snaps:
                if self.e[p].slot is None:      # else: dedup, the donated clone goes back
                    self.e[p].slot = snaps[j]
                    attached.append(p)
                self.e[p].st = self.clock
        if attached and self.max_per_path is not None:
            self._bound(min(attached, key=len))

    def _bound(self, top: Prefix) -> None:
        leaves = sorted(p for p in self.e if self.nkids[p] == 0 and p[:len(top)] == top)
        for leaf in leaves:
            held = [leaf[:j] for j in range(self.ps, len(leaf) + 1, self.ps) if self.e[leaf[:j]].slot is not None]
            victims = sorted((p for p in held if p != leaf and self.locks[p] == 0),
                             key=lambda p: (self.e[p].st, len(p)))
            for v in victims[:max(0, len(held) - self.max_per_path)]:
                self.e[v].slot = None

    def evict_kv(self, num: int) -> int:
        freed = 0
        while freed < num:
            leaves = [p for p in self.e if self.nkids[p] == 0 and self.locks[p] == 0]
            if not leaves:
                break
            freed += self._remove(min(leaves, key=lambda p: (self.e[p].t, -len(p))))
        return freed

    def evict_snapshots(self, num: int) -> int:
        count = 0
        while count < num:
            held = [p for p, x in self.e.items() if x.slot is not None and self.locks[p] == 0]
            if not held:
                break
            p = min(held, key=lambda p: (self.e[p].st, len(p)))
            count += 1
            if self.nkids[p] == 0:
                self._remove(p)
            else:
                self.e[p].slot = None
        return count

    def flush(self) -> None:
        for p in [p for p in self.e if self.pins(p) == 0]:
            self._drop(p)
        for p, x in self.e.items():
            if self.locks[p] == 0:
                x.slot = None

    def _remove(self, leaf: Prefix) -> int:
        """Remove the node ending at ``leaf``; returns pages freed. In hybrid mode every leaf
        exposed by this must hold a snapshot (the contract: no tombstone leaves), which
        ``check`` verifies through the tree's battery and the node-by-node comparison."""
        return sum(self._drop(p) for p in self.segment(leaf))

    def _drop(self, p: Prefix) -> int:
        entry = self.e.pop(p)
        self.nkids[self.parent(p)] -= 1
        return int(self.request_refs(entry.page) == 0)

    # ---- what the tree is compared against
    def view(self):
        if self.hybrid:
            bare = [p for p, x in self.e.items() if self.nkids[p] == 0 and x.slot is None]
            assert not bare, f"model: hybrid leaves without a snapshot {bare}"
        ends = {p: (x.t, x.st if x.slot is not None else None, self.locks[p], self.pins(p))
                for p, x in self.e.items() if self.is_end(p)}
        return ({p: x.page for p, x in self.e.items()},
                {p: x.slot for p, x in self.e.items() if x.slot is not None}, ends)


def tree_view(tree: HybridRadixCache):
    """The tree in the model's terms: prefix -> page, prefix -> slot, node end -> (times, locks)."""
    pages, slots, ends = {}, {}, {}
    stack: list[tuple[Node, Prefix]] = [(tree.root, ())]
    ps = tree.page_size
    while stack:
        node, prefix = stack.pop()
        for child in node.children.values():
            full = prefix + child.key
            for i, page in enumerate(child.pages):
                pages[full[:len(prefix) + (i + 1) * ps]] = page
            if child.snapshot is not None:
                slots[full] = child.snapshot
            ends[full] = (child.last_access, child.snap_access if child.snapshot is not None else None,
                          child.snap_lock, child.kv_lock)
            stack.append((child, full))
    return pages, slots, ends


def node_prefix(node: Node) -> Prefix:
    keys = []
    while node.parent is not None:
        keys.append(node.key)
        node = node.parent
    return tuple(t for k in reversed(keys) for t in k)


# ---------------------------------------------------------------------------- harness

@dataclass
class Req:
    ids: Prefix
    pages: list[int]
    slot: int | None
    node: Node | None        # the tree node this request locked (None: not locked)
    target: Prefix | None    # the same lock, in the model


class Harness:
    """Tree + model + allocators + simulated live requests, checked after every step.

    ``transfer_donation`` simulates the seed's bug on the scheduler side: donate the request's
    own live slot (ownership transfer) instead of a private clone, and keep using it."""

    def __init__(self, num_pages=48, num_slots=12, page_size=2, interval=4, hybrid=True,
                 max_per_path=None, cache_cls=HybridRadixCache, transfer_donation=False):
        self.ps, self.interval, self.hybrid = page_size, interval, hybrid
        self.pages = PageAllocator(num_pages)
        self.slots = SlotAllocator(num_slots) if hybrid else None
        self.tree = cache_cls(self.pages, self.slots, page_size, interval, hybrid, max_per_path)
        self.model = RefCache(page_size, interval, hybrid, max_per_path, self._request_refs)
        self.reqs: dict[int, Req] = {}
        self.transfer_donation = transfer_donation
        self.last_match = None           # the tree's Match of the latest admit
        self.clones: list[int] = []      # clones written for a donation not yet handed to insert
        self._ids = itertools.count()
        self.check()

    def _request_refs(self, page: int) -> int:
        return sum(r.pages.count(page) for r in self.reqs.values())

    # ---- steps (each ends with check())
    def query(self, ids):
        """A match both ways, compared (after a peek, which must agree and change nothing);
        returns (tree Match, model RefMatch)."""
        before = (tree_view(self.tree), self.tree.stats.as_dict())
        peeked = self.tree.peek(ids)
        assert (tree_view(self.tree), self.tree.stats.as_dict()) == before, "peek changed the tree"
        m, r = self.tree.match(ids), self.model.match(ids)
        assert peeked == m.length, f"peek {peeked} != match {m.length}"
        got = (m.length, m.pages, m.snapshot_slot, node_prefix(m.node))
        want = (r.length, r.pages, r.slot, r.target)
        assert got == want, f"match({list(ids)}): tree {got} != model {want}"
        self.check()
        return m, r

    def admit(self, ids, lock=True) -> int | None:
        """Admit a request as the scheduler would: match, lock, hold the hit pages, allocate the
        rest (evicting KV if short) and a live slot (evicting snapshots if short)."""
        ids = tuple(ids)
        m, r = self.query(ids)
        self.last_match = m
        if lock:
            self.tree.lock(m.node)
            self.model.lock(r.target)
        req = Req(ids, [], None, m.node if lock else None, r.target if lock else None)
        self.pages.incref(m.pages)
        req.pages = list(m.pages)
        rid = next(self._ids)
        self.reqs[rid] = req
        need = -(-len(ids) // self.ps) - len(m.pages)
        if need > self.pages.num_free:
            self.evict_kv(need - self.pages.num_free)
        new = self.pages.alloc(need)
        if new is not None:
            req.pages += new
            if self.hybrid:
                req.slot = self._alloc_slot()
        if new is None or (self.hybrid and req.slot is None):
            self.finish(rid)
            return None
        self.check()
        return rid

    def donate(self, rid: int, length: int, boundaries) -> None:
        """Insert ``ids[:length]`` with a private clone per boundary (or, with
        ``transfer_donation``, the request's own slot at the first one)."""
        req = self.reqs[rid]
        snaps = {}
        for b in sorted(boundaries):
            if self.transfer_donation:
                snaps[b] = req.slot
                break
            clone = self._alloc_slot()
            if clone is not None:
                snaps[b] = clone
                self.clones.append(clone)
        self.tree.insert(req.ids[:length], req.pages, snaps)
        self.model.insert(req.ids[:length], req.pages, snaps)
        self.clones.clear()
        self.check()

    def finish(self, rid: int) -> None:
        req = self.reqs.pop(rid)
        if req.node is not None:
            self.tree.unlock(req.node)
            self.model.unlock(req.target)
        self.pages.decref(req.pages)
        if req.slot is not None:
            self.slots.free(req.slot)
        self.check()

    def evict_kv(self, n: int) -> int:
        got, want = self.tree.evict_kv(n), self.model.evict_kv(n)
        assert got == want, f"evict_kv({n}) freed {got} pages, model {want}"
        self.check()
        return got

    def evict_snapshots(self, n: int) -> int:
        got, want = self.tree.evict_snapshots(n), self.model.evict_snapshots(n)
        assert got == want, f"evict_snapshots({n}) freed {got}, model {want}"
        self.check()
        return got

    def flush(self) -> None:
        self.tree.flush()
        self.model.flush()
        self.check()

    def drain(self) -> None:
        """End every request, flush: both pools must be entirely free and the tree empty."""
        for rid in sorted(self.reqs):
            self.finish(rid)
        self.flush()
        assert self.pages.num_free == self.pages.capacity, f"{self.pages.capacity - self.pages.num_free} pages leaked"
        if self.slots is not None:
            assert self.slots.num_free == self.slots.capacity, f"{self.slots.capacity - self.slots.num_free} slots leaked"
        assert self.tree.num_nodes == 0 and self.tree.root.kv_lock == 0, "tree not empty after drain"

    def _alloc_slot(self) -> int | None:
        slot = self.slots.alloc()
        if slot is None and self.evict_snapshots(1):
            slot = self.slots.alloc()
        return slot

    # ---- the checks
    def check(self) -> None:
        self.tree.check_invariants()
        self.pages.check_invariants()
        if self.slots is not None:
            self.slots.check_invariants()
        t_pages, t_slots, t_ends = tree_view(self.tree)
        m_pages, m_slots, m_ends = self.model.view()
        assert t_pages == m_pages, f"cached pages differ: tree {t_pages} model {m_pages}"
        assert t_slots == m_slots, f"snapshots differ: tree {t_slots} model {m_slots}"
        assert t_ends == m_ends, f"nodes differ (end: t, st, snap_lock, kv_lock): tree {t_ends} model {m_ends}"
        root = self.tree.root
        assert (root.snap_lock, root.kv_lock) == (self.model.locks[()], sum(self.model.locks.values())), "root locks"
        self._check_accounting(set(m_pages.values()), set(m_slots.values()))

    def _check_accounting(self, tree_pages: set[int], tree_slots: set[int]) -> None:
        assert self.tree.owned_pages() == tree_pages, "owned_pages() disagrees with the model"
        held = Counter(p for r in self.reqs.values() for p in r.pages)
        for p in range(1, self.pages.num_pages):
            want = (p in tree_pages) + held[p]
            assert self.pages.refcount(p) == want, (
                f"page {p}: refcount {self.pages.refcount(p)}, expected {want} "
                f"(tree {p in tree_pages}, requests {held[p]})")
        if self.slots is None:
            return
        assert self.tree.owned_slots() == tree_slots, "owned_slots() disagrees with the model"
        req_slots = Counter(r.slot for r in self.reqs.values() if r.slot is not None)
        req_slots.update(self.clones)
        for s in range(1, self.slots.num_slots):
            holders = (s in tree_slots) + req_slots[s]
            assert holders <= 1, f"slot {s} has {holders} owners (tree {s in tree_slots}, requests {req_slots[s]})"
            assert self.slots.is_free(s) == (holders == 0), (
                f"slot {s}: free={self.slots.is_free(s)} but {holders} owners (leak or use-after-free)")


# ---------------------------------------------------------------------------- state machine

def make_machine(**harness_kwargs):
    """A hypothesis RuleBasedStateMachine driving a ``Harness`` built with these arguments:
    admit / donate / finish (with or without a final donation) / query / evict_kv /
    evict_snapshots / flush (every Harness step checks everything after itself). Ids come from {0, 1} with page_size 2 so prefixes collide a lot, and
    new prompts often extend earlier ones (multi-turn). Teardown drains: pools fully free."""
    from hypothesis import strategies as st
    from hypothesis.stateful import RuleBasedStateMachine, precondition, rule

    class CacheMachine(RuleBasedStateMachine):
        def __init__(self):
            super().__init__()
            self.h = Harness(**harness_kwargs)
            self.seen: list[Prefix] = []

        def _ids(self, data) -> Prefix:
            """Fresh, an exact repeat of an earlier prompt, or an earlier prompt (or a prefix of
            it) plus a new tail: the shapes a prefix cache lives on."""
            mode = data.draw(st.integers(0, 3) if self.seen else st.just(0), label="fresh/repeat/branch/extend")
            base = data.draw(st.sampled_from(self.seen), label="base") if mode else ()
            if mode == 1:
                return base
            if mode == 2:
                base = base[:data.draw(st.integers(0, len(base)), label="keep")]
            n = data.draw(st.integers(1, 12), label="tail length")
            bits = data.draw(st.integers(0, 2 ** n - 1), label="tail bits")
            return (base + tuple((bits >> i) & 1 for i in range(n)))[:24]

        def _boundaries(self, data, length: int) -> list[int]:
            if not self.h.hybrid:
                return []
            cut = length // self.h.ps * self.h.ps
            every = list(range(self.h.interval, cut + 1, self.h.interval))
            if not every or data.draw(st.booleans(), label="all boundaries"):
                return every
            return data.draw(st.lists(st.sampled_from(every), unique=True), label="boundaries")

        @rule(data=st.data())
        def admit(self, data):
            ids = self._ids(data)
            if self.h.admit(ids, lock=data.draw(st.sampled_from([True, True, True, False]), label="lock")) is not None:
                self.seen.append(ids)

        @rule(data=st.data())
        def serve(self, data):
            """A whole request at once (admit, donate at finish, release): the common flow."""
            ids = self._ids(data)
            rid = self.h.admit(ids)
            if rid is not None:
                self.seen.append(ids)
                self.h.donate(rid, len(ids), self._boundaries(data, len(ids)))
                self.h.finish(rid)

        @precondition(lambda self: self.h.reqs)
        @rule(data=st.data())
        def donate(self, data):
            rid = data.draw(st.sampled_from(sorted(self.h.reqs)), label="rid")
            length = data.draw(st.integers(0, len(self.h.reqs[rid].ids)), label="length")
            self.h.donate(rid, length, self._boundaries(data, length))

        @precondition(lambda self: self.h.reqs)
        @rule(data=st.data())
        def finish(self, data):
            rid = data.draw(st.sampled_from(sorted(self.h.reqs)), label="rid")
            if data.draw(st.integers(0, 3), label="donate at finish") > 0:
                n = len(self.h.reqs[rid].ids)
                self.h.donate(rid, n, self._boundaries(data, n))
            self.h.finish(rid)

        @rule(data=st.data())
        def query(self, data):
            self.h.query(self._ids(data))

        @rule(n=st.one_of(st.integers(0, 8), st.just(1000)))
        def evict_kv(self, n):
            self.h.evict_kv(n)

        @rule(n=st.one_of(st.integers(0, 3), st.just(1000)))
        def evict_snapshots(self, n):
            if self.h.hybrid:
                self.h.evict_snapshots(n)

        @rule(data=st.data())
        def flush(self, data):
            if data.draw(st.integers(0, 3), label="flush?") == 0:
                self.h.flush()

        def teardown(self):
            try:
                self.h.check()
            except AssertionError:
                return          # already failing: keep the original error, do not mask it
            self.h.drain()

    return CacheMachine
