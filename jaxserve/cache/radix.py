"""Radix prefix cache whose nodes hold KV pages and, for hybrid models, linear-state snapshots.

A hybrid (GDN / KDA + attention) model can resume a prompt at token ``b`` only with BOTH the KV of
tokens ``[0, b)`` (attention layers) and the recurrent state after token ``b`` (linear layers). KV
is a prefix structure: the KV of a prefix is a prefix of the KV. State is not: it exists only at
the boundaries where a kernel wrote a snapshot. So the tree has two currencies:

  * KV pages: every node covers a run of whole pages, ``len(key) == page_size * len(pages)``.
  * snapshot slots: a node may carry one slot holding the state at its END boundary, which is
    always a multiple of ``snapshot_interval`` (invariant 1 of ARCHITECTURE.md: the kernels emit state
    on x64 boundaries, and ``snapshot_interval % page_size == 0`` makes those page boundaries).

Ownership (ARCHITECTURE.md invariants 2 and 7). The tree holds one reference on each of its pages
(``PageAllocator`` refcounts; requests hold their own) and owns its slots outright. A donated
slot is a private clone written once on the device before ``insert``; the tree never shares a
slot id with a request, and never writes one (it only frees it), so a tree slot is read-only for
its whole tree lifetime. Every page / slot is therefore free, held by live requests, or held by
the tree, which ``owned_pages`` / ``owned_slots`` let the engine check at any time.

Shape. The tree is kept in a canonical form: a non-root node ends where something happens,
i.e. it is a leaf, a branch point (>= 2 children), carries a snapshot, or is a lock target. A
node with one child and none of those is merged into the child. The shape is then a function of
the cached content alone, not of the order of operations, which is what lets the tests compare
it one to one with a page-level reference model. Splitting keeps the LOWER part as the original
``Node`` object and merging keeps the child, so a node's end boundary never changes while it
exists: a locked ``Match.node`` keeps meaning the same prefix.

Hybrid leaves. Every leaf carries a live snapshot in hybrid mode: KV beyond the deepest snapshot
of a path can never be used by a hit (a hit is truncated to the deepest node with a live
snapshot, invariant 4), so ``insert`` never adds such a tail. An inner node without a snapshot
("tombstone") keeps its KV for its children's sake. Canonical form keeps tombstone leaves from
ever appearing: a tombstone is always a branch point (a pass-through one is merged away), and a
branch point that loses a child is left with at least one, merging into it if only one remains.
So "tombstone leaves exposed by an eviction go too" holds with nothing left to prune.

Locks. ``snap_lock`` counts the ``lock`` calls on the node itself (it pins the node's snapshot,
and is what a running request holds); ``kv_lock`` counts the locks at or below the node (it pins
the KV of the whole root..target path). Exactly: ``kv_lock == snap_lock + sum(child.kv_lock)``.

LRU. A logical clock ticks once per ``match`` / ``insert``. ``last_access`` (KV) is set on every
node of the root..node path an operation used, so a parent is never older than its children and
KV eviction (leaves only) is a plain LRU over leaves. ``snap_access`` is set only on the snapshot
a hit restored or a donation (re)delivered: a snapshot that was merely passed over is not "used",
which is what lets a long conversation's old per-turn snapshots age out before its newest one.
Ties break deepest-first for KV, shallowest-first for snapshots (the shallow one turns into a
tombstone and keeps its KV; the deep one is usually a leaf and would take its KV along). The
snapshot LRU is a lazy heap (``_lru``, see ``_lru_first_evictable``), so an eviction costs
O(log snapshots), not a scan of every snapshot.

``eviction`` (an ``Eviction``; scheduling policies install one) replaces both LRU orders with keys
of its own, computed from a read-only ``NodeInfo``; it decides only the order among evictable
nodes, never what is evictable, so every invariant below holds under any eviction priority.

``max_snapshots_per_path`` bounds the snapshots on every root..leaf path below an insert: while
a path holds more, its first unlocked snapshot in eviction order (LRU, ties: shallowest) other
than the leaf's own is turned into a tombstone. Leaves are visited in key order; locked snapshots are never
evicted, so the bound is best effort while locks pin extras.

Everything here is host bookkeeping: no JAX, no array contents, only ids.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any, NamedTuple, Protocol

from jaxserve.config import SNAPSHOT_INTERVAL

from .allocator import PageAllocator, SlotAllocator


class Node:
    """A run of whole pages of one cached prefix, ending at token ``end`` (from the root)."""

    __slots__ = ("key", "pages", "parent", "children", "end", "snapshot", "kv_lock", "snap_lock",
                 "last_access", "snap_access", "uid")

    def __init__(self, key: tuple[int, ...], pages: list[int], parent: Node | None, end: int, uid: int):
        self.key = key                      # token ids covered by this node, len == page_size * len(pages)
        self.pages = pages                  # page ids for those tokens, owned (one reference) by the tree
        self.parent = parent                # None for the root and for nodes no longer in the tree
        self.children: dict[tuple[int, ...], Node] = {}   # keyed by the child's first page of ids
        self.end = end                      # prefix length at this node's end boundary
        self.snapshot: int | None = None    # tree-owned slot with the linear state at ``end``
        self.kv_lock = 0                    # locks at or below this node: pins this node's KV
        self.snap_lock = 0                  # locks on this node: pins its snapshot
        self.last_access = 0                # KV LRU time (whole path touched)
        self.snap_access = 0                # snapshot LRU time (snapshot restored or donated)
        self.uid = uid                      # heap tie-breaker only

    @property
    def start(self) -> int:
        return self.end - len(self.key)

    def __repr__(self) -> str:
        return (f"Node[{self.start}:{self.end}] pages={self.pages} snap={self.snapshot} "
                f"locks={self.kv_lock}/{self.snap_lock} t={self.last_access}/{self.snap_access}")


@dataclass
class Match:
    """A usable cached prefix. ``pages`` cover ``[0, length)``; ``snapshot_slot`` holds the linear
    state at ``length`` (None for plain attention or length 0). Lock ``node`` right away (before
    any other mutating call) if the request will use the hit; unlock it when the request ends."""

    length: int
    node: Node
    pages: list[int]
    snapshot_slot: int | None


class Probe(NamedTuple):
    """Where ``probe`` found one sequence of ids in the tree: ``length`` is ``peek(ids)``; ``walked``
    the deepest node the ids run through whole (the root if none); ``partial`` the child of
    ``walked`` they then run part of the way into, if any; ``frontier`` the page of ids after
    ``walked`` (the key the walk looked up there; None when ``walked`` ends where a hit must stop);
    ``usable`` the node ``length`` ends at (hybrid: the deepest node at or above ``walked`` with a
    live snapshot, or the root; plain: ``partial`` or ``walked``). Read only: the nodes are the
    tree's own."""

    length: int
    walked: Node
    partial: Node | None
    frontier: tuple[int, ...] | None
    usable: Node

    def path(self) -> tuple[int, ...]:
        """``peek_path`` of the ids as the tree is now (parent links are always current)."""
        node, uids = self.partial or self.walked, []
        while node.parent is not None:
            uids.append(node.uid)
            node = node.parent
        return tuple(reversed(uids))


class NodeInfo(NamedTuple):
    """What an eviction priority may read of a candidate node (a copy; the tree stays private).
    Times are the cache's logical clock (one tick per ``match`` / ``insert``), ``clock`` is now."""

    start: int
    end: int
    last_access: int
    snap_access: int
    clock: int
    num_children: int


class Eviction(Protocol):
    """Eviction priority: among evictable nodes the smallest key goes first (keys must compare with
    each other; ties break by node age). ``kv_key`` ranks unlocked leaves for ``evict_kv``;
    ``snapshot_key`` ranks unlocked snapshots for ``evict_snapshots`` and the per-path bound, i.e.
    which snapshot slots are kept when slots run short."""

    def kv_key(self, node: NodeInfo) -> Any: ...

    def snapshot_key(self, node: NodeInfo) -> Any: ...


@dataclass
class CacheStats:
    """Monotonic counters for metrics. Sizes (nodes, pages, snapshots) are cache properties."""

    queries: int = 0
    hits: int = 0
    query_tokens: int = 0
    hit_tokens: int = 0
    inserts: int = 0
    snapshots_adopted: int = 0       # donated slots the tree kept
    snapshots_deduped: int = 0       # donated slots freed because the boundary was already live
    snapshots_evicted: int = 0       # by evict_snapshots (tombstoned or dropped with their leaf)
    snapshots_bounded: int = 0       # by max_snapshots_per_path
    kv_pages_dropped: int = 0        # tree references dropped by any removal
    kv_pages_freed: int = 0          # ... of which the page reached refcount 0

    def as_dict(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


class HybridRadixCache:
    """See the module docstring for the invariants; ``check_invariants`` verifies all of them."""

    def __init__(self, pages: PageAllocator, slots: SlotAllocator | None, page_size: int,
                 snapshot_interval: int = SNAPSHOT_INTERVAL, hybrid: bool = True, max_snapshots_per_path: int | None = None):
        if page_size < 1 or snapshot_interval < 1 or snapshot_interval % page_size:
            raise ValueError(f"snapshot_interval ({snapshot_interval}) must be a positive multiple "
                             f"of page_size ({page_size})")
        if hybrid and slots is None:
            raise ValueError("a hybrid cache needs a SlotAllocator")
        if max_snapshots_per_path is not None and max_snapshots_per_path < 1:
            raise ValueError("max_snapshots_per_path must be >= 1 (a hybrid leaf keeps its snapshot)")
        self.pages, self.slots = pages, slots
        self.page_size, self.snapshot_interval = page_size, snapshot_interval
        self.hybrid, self.max_snapshots_per_path = hybrid, max_snapshots_per_path
        self.root = Node((), [], None, 0, 0)
        self.num_nodes = 0                       # non-root nodes
        self.stats = CacheStats()
        self._uids = itertools.count(1)
        self._clock = 0
        self._tree_pages: set[int] = set()
        self._tree_slots: set[int] = set()
        self._snapshot_nodes: dict[int, Node] = {}  # slot -> its node (eviction candidates)
        self._lru: list[tuple[int, int, int, int, Node]] = []  # see _lru_first_evictable
        self._lru_seq = itertools.count()        # heap tie-breaker: entries never compare nodes
        self.eviction: Eviction | None = None    # None: the LRU orders of the module docstring

    # ------------------------------------------------------------------ sizes and metrics

    @property
    def num_snapshots(self) -> int:
        return len(self._tree_slots)

    @property
    def num_tree_pages(self) -> int:
        return len(self._tree_pages)

    def owned_pages(self) -> set[int]:
        return set(self._tree_pages)

    def owned_slots(self) -> set[int]:
        return set(self._tree_slots)

    def evictable_pages(self) -> int:
        """Pages ``evict_kv`` could free now: tree pages off every locked path that no request
        holds. O(nodes); for admission decisions, not for every step."""
        return sum(1 for n in self._nodes() if n.kv_lock == 0
                   for p in n.pages if self.pages.refcount(p) == 1)

    def metrics(self) -> dict[str, float]:
        """Counters plus pool pressure: the share of the slot pool the tree's snapshots occupy is
        what starves hits when it is small (ARCHITECTURE.md, "The prefix cache")."""
        m: dict[str, float] = dict(self.stats.as_dict())
        m.update(num_nodes=self.num_nodes, num_snapshots=self.num_snapshots,
                 num_tree_pages=self.num_tree_pages,
                 hit_rate=self.stats.hit_tokens / max(1, self.stats.query_tokens),
                 page_pool_share=self.num_tree_pages / max(1, self.pages.capacity))
        if self.slots is not None:
            m["snapshot_pool_share"] = self.num_snapshots / max(1, self.slots.capacity)
            m["slots_free"] = self.slots.num_free
        return m

    # ------------------------------------------------------------------ match

    def match(self, cache_ids: Sequence[int]) -> Match:
        """The longest cached prefix a new request with these ids can use (see ``Match``).

        At most ``len - 1`` tokens, rounded down to whole pages: the last token is always
        recomputed because its logits are needed. Hybrid: truncated to the deepest node on the
        path with a live snapshot, so a repeated prompt of length L hits floor((L-1)/64)*64.
        """
        ids = tuple(cache_ids)
        path, partial = self._walk(ids, self._match_limit(len(ids)))
        path, node, length, pages = self._usable(path, partial)
        self._clock += 1
        self._touch_hit(path, node)
        self.stats.queries += 1
        self.stats.query_tokens += len(ids)
        self.stats.hits += length > 0
        self.stats.hit_tokens += length
        return Match(length, node, pages, node.snapshot)   # None: plain attention, or the root

    def peek(self, cache_ids: Sequence[int]) -> int:
        """The length ``match`` would return, changing nothing (no LRU times, no counters): for
        ranking waiting requests, or asking whether boundary b already has a live snapshot
        (``peek(ids[:b + 1]) == b``) without making that snapshot look recently used."""
        ids = tuple(cache_ids)
        return self._usable(*self._walk(ids, self._match_limit(len(ids))))[2]

    def has_snapshot_at(self, cache_ids: Sequence[int], boundary: int, hint: Node | None = None) -> bool:
        """``peek(cache_ids[:boundary + 1]) == boundary`` for a ``boundary`` on a page boundary: does
        the tree hold a live snapshot exactly at ``boundary`` of this prefix? ``hint``: a node in the
        tree whose root path spells ``cache_ids[:hint.end]`` (a request's locked ``Match.node``:
        locked, it stays in the tree, and splits and merges keep its end and its path's content).
        The walk then starts there instead of at the root, which saves the shared prefix's nodes;
        the answer is the same, because the root walk of these ids runs through ``hint``."""
        if boundary <= 0 or len(cache_ids) <= boundary:  # peek would stop short of ``boundary``
            return False
        node = self.root if hint is None or (hint is not self.root and hint.parent is None) else hint
        if boundary <= node.end:  # on the path above the hint
            while node.end > boundary:
                node = node.parent
            return node.end == boundary and node.snapshot is not None and node is not self.root
        path, _ = self._walk(tuple(cache_ids[:boundary]), boundary, node)
        return bool(path) and path[-1].end == boundary and path[-1].snapshot is not None

    def peek_path(self, cache_ids: Sequence[int]) -> tuple[int, ...]:
        """Ids of the nodes the ids run through (whole pages, the last token excluded as in
        ``match``; a partly matched node last), root excluded; changes nothing. Requests sharing a
        cached prefix share a leading run of ids; ids are stable until the tree changes shape."""
        ids = tuple(cache_ids)
        path, partial = self._walk(ids, self._match_limit(len(ids)))
        return tuple(n.uid for n in path) + ((partial[0].uid,) if partial else ())

    def probe(self, cache_ids: Sequence[int], since: Probe | None = None) -> Probe:
        """``peek`` and ``peek_path`` in one, cheap to repeat: for a caller that asks about the same
        ids step after step (a scheduling policy ranking its waiting queue). Changes nothing.

        ``since``: an earlier probe of the very same ids. It is returned as it is when a fresh walk
        would end where it ended, which one dictionary lookup decides (``_probe_holds``); otherwise the
        walk resumes at ``since.walked`` (or ``since.usable``) while that is still in the tree,
        instead of at the root. Either way the answer is that of a fresh probe: a node in the tree
        keeps the content of its root path for as long as it is there (see "Shape"), so ids that
        ran through it still do, and a node that leaves the tree never comes back (``parent`` None).
        """
        if since is not None and self._probe_holds(since):
            return since
        start = self.root
        if since is not None:  # resume from the deepest node still in the tree whose prefix these ids spell
            resumable = (since.walked, since.usable) if self.hybrid else (since.walked,)  # plain: usable may be partial
            start = next((n for n in resumable if n.parent is not None), self.root)
        limit = self._match_limit(len(cache_ids))
        path, partial = self._walk(cache_ids, limit, start)
        walked = path[-1] if path else start
        frontier = tuple(cache_ids[walked.end:walked.end + self.page_size]) if walked.end < limit else None
        if self.hybrid:
            usable = walked
            while usable.snapshot is None and usable.parent is not None:
                usable = usable.parent
            length = usable.end
        else:
            usable = partial[0] if partial else walked
            length = walked.end + (partial[1] if partial else 0)
        return Probe(length, walked, partial[0] if partial else None, frontier, usable)

    def _probe_holds(self, p: Probe) -> bool:
        """A fresh walk of ``p``'s ids would give ``p``. It runs through ``p.walked`` while that is in
        the tree, then looks up ``p.frontier`` among its children: finding ``p.partial`` again (or
        nothing again) it ends as before, since a child keeps its key while it is its parent's child
        (a split puts the upper part under the key, a merge puts the child there: either way another
        node). Plain: the length follows. Hybrid: it is that of the deepest live snapshot at or
        above ``p.walked``, looked up again (snapshots come and go without changing the walk)."""
        walked = p.walked
        if walked.parent is None and walked is not self.root:
            return False
        if p.frontier is not None and walked.children.get(p.frontier) is not p.partial:
            return False
        if self.hybrid:
            while walked.snapshot is None and walked.parent is not None:
                walked = walked.parent
            return walked is p.usable
        return True

    def _match_limit(self, n: int) -> int:
        """Tokens a hit may cover: never the last one, and only whole pages."""
        return max(0, (n - 1) // self.page_size * self.page_size)

    def _walk(self, ids: Sequence[int], limit: int,
              start: Node | None = None) -> tuple[list[Node], tuple[Node, int] | None]:
        """Nodes fully matched by ``ids[:limit]`` (root excluded), and the node matched only
        partly with the number of its tokens that match (whole pages), if any. ``start``: a node
        whose root path spells ``ids[:start.end]``; the walk goes on from there and returns only
        the nodes below it. ``ids`` may be a list: only the slices it compares become tuples."""
        ps, path = self.page_size, []
        node = self.root if start is None else start
        pos = node.end
        while pos < limit:
            child = node.children.get(tuple(ids[pos:pos + ps]))
            if child is None:
                return path, None
            n = self._common(child.key, ids, pos, limit)
            if n < len(child.key):
                return path, (child, n)
            path.append(child)
            node, pos = child, pos + n
        return path, None

    def _common(self, key: tuple[int, ...], ids: Sequence[int], pos: int, limit: int) -> int:
        """Tokens (whole pages) in which ``key`` agrees with ``ids[pos:limit]``."""
        ps, n = self.page_size, min(len(key), limit - pos)
        seg = tuple(ids[pos:pos + n])  # a tuple's slice is one already: no second copy
        if key[:n] == seg:
            return n
        i = 0
        while i < n and key[i:i + ps] == seg[i:i + ps]:
            i += ps
        return i

    def _usable(self, path: list[Node], partial: tuple[Node, int] | None):
        """Cut the walked path to what a request can resume from. Hybrid: the deepest node with
        a live snapshot (KV alone is not enough). Plain: everything, including a partly matched
        node (its first pages are usable KV; locking it pins it whole)."""
        if self.hybrid:
            while path and path[-1].snapshot is None:
                path = path[:-1]
            partial = None
        node = path[-1] if path else self.root
        pages = [p for n in path for p in n.pages]
        length = node.end
        if partial is not None:
            node, ntok = partial
            pages += node.pages[:ntok // self.page_size]
            length += ntok
        return path, node, length, pages

    def _touch_hit(self, path: list[Node], node: Node) -> None:
        self._touch(path)
        if node.snapshot is not None:
            node.snap_access = self._clock

    def _touch(self, path: list[Node]) -> None:
        for n in path:
            n.last_access = self._clock

    # ------------------------------------------------------------------ locks

    def lock(self, node: Node) -> None:
        """Pin ``node``'s snapshot and the KV of root..node until ``unlock``."""
        path = self._path_to_root(node)
        node.snap_lock += 1
        for n in path:
            n.kv_lock += 1

    def unlock(self, node: Node) -> None:
        if node.snap_lock <= 0:
            raise ValueError(f"unlock of an unlocked node {node!r}")
        path = self._path_to_root(node)
        node.snap_lock -= 1
        for n in path:
            n.kv_lock -= 1
        self._normalize(node)

    def _path_to_root(self, node: Node) -> list[Node]:
        """node, its parent, ..., root. Raises for a node that has left the tree (a stale
        ``Match.node``: lock a match before any other mutating call)."""
        path = []
        while node is not self.root:
            if node.parent is None:
                raise ValueError("node is no longer in the tree (lock a Match right after match())")
            path.append(node)
            node = node.parent
        path.append(self.root)
        return path

    # ------------------------------------------------------------------ insert

    def insert(self, cache_ids: Sequence[int], pages: Sequence[int], snapshots: Mapping[int, int],
               hint: Node | None = None) -> None:
        """Donate a request's prefix: ``cache_ids`` cut down to whole pages, its ``pages`` (at
        least one per whole page; extras are ignored) and ``snapshots`` {boundary: slot} of
        private, already written clones that the tree now owns.

        New content adopts the request's pages (one incref each); where the tree already has the
        prefix it keeps its own pages. A boundary that already has a live snapshot keeps it and
        the donated slot is freed (dedup). A boundary inside an existing node splits it. Hybrid:
        nothing beyond the deepest donated boundary is inserted (it could never be a hit and would
        be a snapshot-less leaf), so a hybrid insert without snapshots adds nothing. Arguments are
        validated before anything changes. ``hint``: as in ``has_snapshot_at``; the walks start
        there when every donated boundary lies below it (nothing above it can then split).
        """
        ids = tuple(cache_ids)
        n_pages = len(ids) // self.page_size
        cut = n_pages * self.page_size
        pages = list(pages)
        snaps = self._check_snapshots(snapshots, cut)
        target = self._insert_target(snaps, cut)
        start = self._insert_start(hint, snaps)
        self._check_pages(ids, pages, n_pages, target, start)

        self._clock += 1
        self.stats.inserts += 1
        path, attached, append_parent = self._insert_path(ids, pages, snaps, target, start)
        self._touch(path)
        if append_parent is not None:
            self._normalize(append_parent)   # plain mode: a leaf extended in place
        if attached and self.max_snapshots_per_path is not None:
            self._bound_snapshots(min(attached, key=lambda n: n.end))

    def _insert_target(self, snaps: dict[int, int], cut: int) -> int:
        """How much of the key to insert. Hybrid: up to the deepest donated snapshot, since KV
        past it could never be a hit and would leave a snapshot-less leaf. Plain: all of it."""
        return max(snaps, default=0) if self.hybrid else cut

    def _check_snapshots(self, snapshots: Mapping[int, int], cut: int) -> dict[int, int]:
        snaps = dict(snapshots)
        if snaps and not self.hybrid:
            raise ValueError("plain-attention cache takes no snapshots")
        if len(set(snaps.values())) != len(snaps):
            raise ValueError(f"one slot donated at two boundaries: {snaps}")
        for b, slot in snaps.items():
            if b <= 0 or b % self.snapshot_interval or b > cut:
                raise ValueError(f"snapshot boundary {b} is not a positive multiple of "
                                 f"{self.snapshot_interval} within the {cut} whole-page tokens")
            if self.slots.is_free(slot):
                raise ValueError(f"donated slot {slot} is free (it must be a written clone)")
            if slot in self._tree_slots:
                raise ValueError(f"donated slot {slot} is already a tree slot (aliasing)")
        return snaps

    def _insert_start(self, hint: Node | None, snaps: dict[int, int]) -> Node:
        """Where an insert's walk begins: ``hint`` while it is in the tree and every donated
        boundary lies below it, else the root. On the root..hint path such an insert only passes
        through whole nodes (no boundary inside them, none at their ends), so starting at ``hint``
        with that path changes nothing but the work."""
        if hint is None or hint.parent is None or not snaps or min(snaps) <= hint.end:
            return self.root
        return hint

    def _check_pages(self, ids: tuple[int, ...], pages: list[int], n_pages: int, target: int, start: Node) -> None:
        if len(pages) < n_pages:
            raise ValueError(f"{n_pages} whole pages of ids but only {len(pages)} page ids")
        path, partial = self._walk(ids, target, start)
        shared = (path[-1].end if path else start.end) + (partial[1] if partial else 0)
        adopted = pages[shared // self.page_size:target // self.page_size]
        if len(set(adopted)) != len(adopted):
            raise ValueError(f"a page id repeats among the donated pages {adopted}")
        for p in adopted:
            if self.pages.refcount(p) < 1:     # raises for the null page
                raise ValueError(f"donated page {p} is free")
            if p in self._tree_pages:
                raise ValueError(f"donated page {p} is already a tree page at another position")

    def _insert_path(self, ids, pages, snaps, target, start):
        """Walk/extend the tree along ``ids[:target]`` from ``start`` (see ``_insert_start``); returns
        (path from the root, nodes that adopted a snapshot, the node new content was appended under
        or None)."""
        node, pos, attached = start, start.end, []
        path = self._path_to_root(start)[-2::-1]  # root..start, root excluded
        while pos < target:
            child = node.children.get(ids[pos:pos + self.page_size])
            if child is None:
                for new in self._append(node, ids, pages, pos, target, snaps):
                    path.append(new)
                    if new.end in snaps:
                        self._put_snapshot(new, snaps[new.end], attached)
                return path, attached, node
            n = self._common(child.key, ids, pos, target)
            inside = [b for b in snaps if pos < b < child.end and b <= pos + n]
            stop = min(inside, default=pos + n)
            if stop < child.end:
                if stop == target and stop not in snaps:
                    break                       # plain: the key ends inside this node
                child = self._split(child, (stop - child.start) // self.page_size)
            path.append(child)
            node, pos = child, child.end
            if pos in snaps:
                self._put_snapshot(child, snaps[pos], attached)
        return path, attached, None

    def _append(self, parent, ids, pages, start, stop, snaps) -> list[Node]:
        """New nodes for ``[start, stop)`` under ``parent``, one per donated boundary inside."""
        ps, new = self.page_size, []
        for end in sorted({b for b in snaps if start < b < stop} | {stop}):
            node = Node(ids[start:end], pages[start // ps:end // ps], parent, end, next(self._uids))
            self._adopt_pages(node.pages)
            parent.children[node.key[:ps]] = node
            self.num_nodes += 1
            new.append(node)
            parent, start = node, end
        return new

    def _put_snapshot(self, node: Node, slot: int, attached: list[Node]) -> None:
        """Adopt a donated slot at ``node``'s end, or free it if one is already live there."""
        node.snap_access = self._clock
        if node.snapshot is None:
            node.snapshot = slot
            self._tree_slots.add(slot)
            self._snapshot_nodes[slot] = node
            attached.append(node)
            self.stats.snapshots_adopted += 1
            self._lru_push(node)
        else:
            self.slots.free(slot)
            self.stats.snapshots_deduped += 1

    def _split(self, node: Node, k: int) -> Node:
        """Cut ``node`` after its first ``k`` pages; the new upper part is returned and the
        original object keeps the lower part (so its end, snapshot and locks stay put). Every
        lock below the upper part runs through the lower one: same kv_lock, no snap_lock."""
        ps, cut = self.page_size, k * self.page_size
        upper = Node(node.key[:cut], node.pages[:k], node.parent, node.start + cut, next(self._uids))
        upper.kv_lock, upper.last_access = node.kv_lock, node.last_access
        node.parent.children[node.key[:ps]] = upper
        node.key, node.pages, node.parent = node.key[cut:], node.pages[k:], upper
        upper.children[node.key[:ps]] = node
        self.num_nodes += 1
        return upper

    def _bound_snapshots(self, top: Node) -> None:
        """Enforce ``max_snapshots_per_path`` on every root..leaf path below ``top``."""
        leaves = [n for n in self._nodes(top) if not n.children]
        for leaf in sorted(leaves, key=self._full_key):
            path = self._path_to_root(leaf)
            held = [n for n in path if n.snapshot is not None]
            excess = len(held) - self.max_snapshots_per_path
            victims = sorted((n for n in held if n is not leaf and n.snap_lock == 0), key=self._snap_order)
            for victim in victims[:max(0, excess)]:
                self._drop_snapshot(victim)
                self.stats.snapshots_bounded += 1
                self._normalize(victim)

    def _full_key(self, node: Node) -> tuple[int, ...]:
        return tuple(t for n in reversed(self._path_to_root(node)) for t in n.key)

    # ------------------------------------------------------------------ eviction

    def evict_kv(self, num_pages: int) -> int:
        """Free at least ``num_pages`` pages if possible, LRU over unlocked leaves. A leaf's
        snapshot goes with it; a parent left as a leaf becomes a candidate (plain mode only: a
        hybrid parent left as a leaf holds a snapshot, see the module docstring). Returns the
        pages actually freed. Pages a request still holds leave the tree without being freed
        (``stats.kv_pages_dropped`` counts them too) and do not count toward ``num_pages``."""
        freed = 0
        heap = [self._kv_order(n) for n in self._nodes() if self._kv_evictable(n)]
        heapq.heapify(heap)
        while freed < num_pages and heap:
            node = heapq.heappop(heap)[-1]
            if not self._kv_evictable(node):
                continue
            parent = node.parent
            freed += self._remove_leaf(node)
            self._normalize(parent)
            if self._kv_evictable(parent):          # plain mode: a parent left as a leaf
                heapq.heappush(heap, self._kv_order(parent))
        return freed

    def evict_snapshots(self, num: int) -> int:
        """Free up to ``num`` tree slots, LRU over unlocked snapshots. An inner node becomes a
        tombstone (keeps KV and children); a leaf goes whole with its KV (no tombstone leaf can be
        exposed above it: canonical form). Returns the slots freed."""
        count = 0
        if self.eviction is None:
            while count < num and (node := self._lru_first_evictable()) is not None:
                count += 1
                self.stats.snapshots_evicted += 1
                self._evict_snapshot(node)
            return count
        heap = [self._snap_order(n) for n in self._snapshot_nodes.values() if self._snap_evictable(n)]
        heapq.heapify(heap)
        while count < num and heap:
            node = heapq.heappop(heap)[-1]
            if not self._snap_evictable(node):
                continue
            count += 1
            self.stats.snapshots_evicted += 1
            self._evict_snapshot(node)
        return count

    def _lru_push(self, node: Node) -> None:
        """Enter a node that just got a snapshot into the LRU heap; rebuild the heap from the live
        snapshots when dead entries (snapshots gone since) outnumber them, so it stays O(snapshots)."""
        heapq.heappush(self._lru, (node.snap_access, node.end, node.uid, next(self._lru_seq), node))
        if len(self._lru) > 2 * len(self._snapshot_nodes) + 64:
            self._lru = [(n.snap_access, n.end, n.uid, next(self._lru_seq), n) for n in self._snapshot_nodes.values()]
            heapq.heapify(self._lru)

    def _lru_first_evictable(self) -> Node | None:
        """The evictable snapshot with the smallest LRU key: ``min`` of ``_snap_order`` over the
        ``_snap_evictable`` nodes. Lazy heap: every node with a snapshot has an entry whose key is a
        lower bound of its current key (``end`` and ``uid`` never change and ``snap_access`` only
        grows, so touches need not touch the heap). An entry that surfaces with an old time is
        pushed back with the current one; one whose node lost its snapshot is dropped; a locked
        node's is set aside and pushed back after. The first current, evictable entry on top has
        the smallest key of all, since every other node's key is at least its entry's."""
        heap, locked, found = self._lru, [], None
        while heap:
            access, _, _, _, node = heap[0]
            if node.snapshot is None or node.parent is None:
                heapq.heappop(heap)
            elif node.snap_access != access:
                heapq.heapreplace(heap, (node.snap_access, node.end, node.uid, next(self._lru_seq), node))
            elif not self._snap_evictable(node):  # locked
                locked.append(heapq.heappop(heap))
            else:
                found = node
                break
        for entry in locked:
            heapq.heappush(heap, entry)
        return found

    def _evict_snapshot(self, node: Node) -> None:
        """Inner node: becomes a tombstone. Leaf: goes whole, a hybrid leaf must keep a snapshot."""
        if node.children:
            self._drop_snapshot(node)
            self._normalize(node)
        else:
            parent = node.parent
            self._remove_leaf(node)
            self._normalize(parent)

    def flush(self) -> None:
        """Drop everything no lock pins: unlocked nodes, and unlocked snapshots on locked paths."""
        order = list(self._nodes())
        for node in reversed(order):            # children before parents
            if node is self.root:
                continue
            if node.kv_lock == 0:
                self._remove_leaf(node)
            elif node.snapshot is not None and node.snap_lock == 0:
                self._drop_snapshot(node)
        for node in reversed(order):
            if node.parent is not None:
                self._normalize(node)

    def _kv_evictable(self, node: Node) -> bool:
        return node.parent is not None and not node.children and node.kv_lock == 0

    def _snap_evictable(self, node: Node) -> bool:
        return node.parent is not None and node.snapshot is not None and node.snap_lock == 0

    def _kv_order(self, node: Node):
        if self.eviction is None:
            return (node.last_access, -node.end, node.uid, node)
        return (self.eviction.kv_key(self._info(node)), node.uid, node)

    def _snap_order(self, node: Node):
        if self.eviction is None:
            return (node.snap_access, node.end, node.uid, node)
        return (self.eviction.snapshot_key(self._info(node)), node.uid, node)

    def _info(self, node: Node) -> NodeInfo:
        return NodeInfo(node.start, node.end, node.last_access, node.snap_access, self._clock, len(node.children))

    # ------------------------------------------------------------------ removal and shape

    def _remove_leaf(self, node: Node) -> int:
        """Take an unlocked leaf out of the tree with its pages and snapshot; returns pages freed."""
        del node.parent.children[node.key[:self.page_size]]
        node.parent = None
        if node.snapshot is not None:
            self._drop_snapshot(node)
        self.num_nodes -= 1
        return self._release_pages(node.pages)

    def _adopt_pages(self, pages: list[int]) -> None:
        self.pages.incref(pages)
        self._tree_pages.update(pages)

    def _release_pages(self, pages: list[int]) -> int:
        freed = self.pages.decref(pages)
        self._tree_pages.difference_update(pages)
        self.stats.kv_pages_dropped += len(pages)
        self.stats.kv_pages_freed += freed
        return freed

    def _drop_snapshot(self, node: Node) -> None:
        self.slots.free(node.snapshot)
        self._tree_slots.discard(node.snapshot)
        self._snapshot_nodes.pop(node.snapshot, None)
        node.snapshot = None

    def _normalize(self, node: Node) -> None:
        """Merge ``node`` into its only child if nothing happens at its end (no snapshot, no
        lock, no branch). The child object survives, keeping its end, locks and LRU times; the
        parent's LRU time is >= the child's, so no recency is invented."""
        if (node is self.root or node.parent is None or len(node.children) != 1
                or node.snapshot is not None or node.snap_lock):
            return
        (child,) = node.children.values()
        child.key, child.pages = node.key + child.key, node.pages + child.pages
        child.parent = node.parent
        node.parent.children[node.key[:self.page_size]] = child
        node.parent, node.children = None, {}
        self.num_nodes -= 1

    def _nodes(self, top: Node | None = None) -> Iterator[Node]:
        """Preorder over the subtree at ``top`` (default: the whole tree, root included)."""
        stack = [top or self.root]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    # ------------------------------------------------------------------ invariants

    def check_invariants(self) -> None:
        """Raise AssertionError naming the first broken invariant. O(nodes + pages). What holds:

        structure  every non-root node: non-empty key, ``len(key) == page_size * len(pages)``,
                   keyed in its parent by its first page of ids, ``end == parent.end + len(key)``.
        shape      canonical: a non-root node with exactly one child has a snapshot or a lock.
        pages      no null page; each tree page appears once in the tree and has refcount >= 1
                   (the tree's own reference); the page index equals the walk.
        snapshots  hybrid only; only at ends that are multiples of ``snapshot_interval``; each
                   slot on one node and not free in the SlotAllocator; slot index == the walk;
                   each has an LRU heap entry whose time is <= its ``snap_access``.
        hybrid     every leaf has a live snapshot; a locked node never lacks one.
        locks      ``snap_lock >= 0`` and ``kv_lock == snap_lock + sum(child.kv_lock)`` on every
                   node, so kv_lock >= snap_lock and >= each child's: a lock pins its whole path.
        LRU        no time is in the future; a parent's ``last_access`` >= each child's (paths
                   are touched whole), so KV eviction of leaves is LRU-consistent.
        counters   ``num_nodes`` equals the walk; hits <= queries, hit_tokens <= query_tokens.

        Not checkable on the host: that a tree slot is written once (the device does the clone
        before ``insert``; the tree itself never writes a slot, it only frees them).
        """
        ps, root = self.page_size, self.root
        assert root.parent is None and root.key == () and not root.pages and root.end == 0, "bad root"
        assert root.snapshot is None, "the root carries a snapshot"
        seen_pages: set[int] = set()
        seen_slots: set[int] = set()
        count = 0
        for node in self._nodes():
            where = repr(node)
            assert node.snap_lock >= 0, f"negative snap_lock: {where}"
            child_locks = sum(c.kv_lock for c in node.children.values())
            assert node.kv_lock == node.snap_lock + child_locks, (
                f"kv_lock {node.kv_lock} != snap_lock {node.snap_lock} + children's {child_locks}: {where}")
            assert node.last_access <= self._clock and node.snap_access <= self._clock, f"future LRU time: {where}"
            for first, child in node.children.items():
                assert child.parent is node, f"child's parent link is wrong: {child!r}"
                assert len(first) == ps and child.key[:ps] == first, f"child keyed by {first}: {child!r}"
                assert child.end == node.end + len(child.key), f"child end inconsistent: {child!r}"
                assert node is root or node.last_access >= child.last_access, (
                    f"parent older than child: {where} / {child!r}")
            if node is root:
                continue
            count += 1
            assert node.key and len(node.key) == ps * len(node.pages), f"key is not whole pages: {where}"
            assert len(node.children) != 1 or node.snapshot is not None or node.snap_lock > 0, (
                f"pass-through node not merged (non-canonical shape): {where}")
            for p in node.pages:
                assert p != 0, f"null page in the tree: {where}"
                assert p not in seen_pages, f"page {p} appears twice in the tree"
                seen_pages.add(p)
                assert self.pages.refcount(p) >= 1, f"tree page {p} is free: {where}"
            if node.snapshot is not None:
                slot = node.snapshot
                assert self.hybrid, f"snapshot in a plain-attention cache: {where}"
                assert node.end % self.snapshot_interval == 0, f"snapshot off a x{self.snapshot_interval} boundary: {where}"
                assert slot not in seen_slots, f"slot {slot} held by two nodes"
                seen_slots.add(slot)
                assert not self.slots.is_free(slot), f"tree slot {slot} is free in the allocator: {where}"
            elif self.hybrid:
                assert node.children, f"hybrid leaf without a live snapshot: {where}"
                assert node.snap_lock == 0, f"locked node lost its snapshot: {where}"
        assert count == self.num_nodes, f"num_nodes {self.num_nodes} but {count} nodes in the tree"
        assert seen_pages == self._tree_pages, f"page index off by {seen_pages ^ self._tree_pages}"
        assert seen_slots == self._tree_slots, f"slot index off by {seen_slots ^ self._tree_slots}"
        assert all(self._snapshot_nodes.get(s) is n for n in self._nodes() if (s := n.snapshot) is not None) \
            and len(self._snapshot_nodes) == len(seen_slots), "snapshot-node index differs from the walk"
        bounded = {id(n) for a, _, _, _, n in self._lru if n.snapshot is not None and a <= n.snap_access}
        assert all(id(n) in bounded for n in self._snapshot_nodes.values()), "a snapshot is missing from the LRU heap"
        s = self.stats
        assert s.hits <= s.queries and s.hit_tokens <= s.query_tokens, "hit counters exceed queries"
