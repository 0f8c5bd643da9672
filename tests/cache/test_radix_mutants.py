"""Injected bugs, one at a time: each must be caught by the invariant battery, the reference
model or the page / slot accounting (reference_model.Harness.check), both by a fixed op
sequence and by the hypothesis state machine. Control: the real cache passes both.

Each mutant is a subclass overriding one small method, so the bug is the diff you read here.
"""

import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis.stateful import run_state_machine_as_test

from jaxserve.cache import HybridRadixCache
from tests.cache.reference_model import Harness, make_machine


class MatchesWholeKey(HybridRadixCache):
    """Off by one at the end: a hit may cover the last token, whose logits then never exist."""

    def _match_limit(self, n):
        return n // self.page_size * self.page_size


class SnapshotOnePageEarly(HybridRadixCache):
    """Off by one at a boundary ("snapshot at 63"): the state after token b is filed one page
    before b, where it does not belong."""

    def _check_snapshots(self, snapshots, cut):
        return {b - self.page_size: s for b, s in super()._check_snapshots(snapshots, cut).items()}


class ForgetsOneBoundary(HybridRadixCache):
    """Donation loses its shallowest boundary: the clone is neither adopted nor freed."""

    def _check_snapshots(self, snapshots, cut):
        snaps = super()._check_snapshots(snapshots, cut)
        snaps.pop(min(snaps), None) if snaps else None
        return snaps


class KVOnlyTruncation(HybridRadixCache):
    """Wrong truncation: a hit ends at the deepest KV node, snapshot or not (invariant 4)."""

    def _usable(self, path, partial):
        node = path[-1] if path else self.root
        return path, node, node.end, [p for n in path for p in n.pages]


class LeakedLock(HybridRadixCache):
    """unlock forgets the path's KV locks: the path stays pinned forever."""

    def unlock(self, node):
        if node.snap_lock <= 0:
            raise ValueError("unlock of an unlocked node")
        node.snap_lock -= 1
        self._normalize(node)


class EvictsLockedLeaf(HybridRadixCache):
    """KV eviction ignores locks: a running request's hit disappears under it."""

    def _kv_evictable(self, node):
        return node.parent is not None and not node.children


class EvictsLockedSnapshot(HybridRadixCache):
    """Snapshot eviction ignores locks: the state a request is restoring from is freed."""

    def _snap_evictable(self, node):
        return node.parent is not None and node.snapshot is not None


class DedupLeaksSlot(HybridRadixCache):
    """Dedup keeps the old snapshot but never frees the donated clone."""

    def _put_snapshot(self, node, slot, attached):
        if node.snapshot is None:
            super()._put_snapshot(node, slot, attached)
        node.snap_access = self._clock


class DedupReplacesLive(HybridRadixCache):
    """Dedup swaps in the new clone and frees the live one (which a locked request may be reading)."""

    def _put_snapshot(self, node, slot, attached):
        if node.snapshot is not None:
            self._drop_snapshot(node)
        super()._put_snapshot(node, slot, attached)


class EvictionSkipsDecref(HybridRadixCache):
    """Eviction forgets the tree's page references: pages leak."""

    def _release_pages(self, pages):
        self._tree_pages.difference_update(pages)
        return 0


class AdoptsWithoutIncref(HybridRadixCache):
    """Insert adopts pages without taking a reference: freed under the tree when the request ends."""

    def _adopt_pages(self, pages):
        self._tree_pages.update(pages)


class TombstoneLeafLeft(HybridRadixCache):
    """Snapshot eviction turns a leaf into a tombstone instead of dropping it: a KV-only leaf."""

    def _evict_snapshot(self, node):
        self._drop_snapshot(node)
        self._normalize(node)


class InsertsUncoveredTail(HybridRadixCache):
    """Hybrid insert keeps the KV past the deepest donated snapshot: a snapshot-less leaf."""

    def _insert_target(self, snaps, cut):
        return cut if snaps else 0


class StaleLRUOnMatch(HybridRadixCache):
    """A hit does not refresh LRU times: hot prefixes get evicted first."""

    def _touch_hit(self, path, node):
        pass


class SplitDropsKVLock(HybridRadixCache):
    """Splitting a locked node forgets that the new upper part is on the locked path."""

    def _split(self, node, k):
        upper = super()._split(node, k)
        upper.kv_lock = 0
        return upper


class SplitAliasesSnapshot(HybridRadixCache):
    """Splitting copies the node's fields, snapshot included: two nodes share one slot."""

    def _split(self, node, k):
        upper = super()._split(node, k)
        upper.snapshot = node.snapshot
        return upper


class NoPathBound(HybridRadixCache):
    """max_snapshots_per_path is accepted and ignored."""

    def _bound_snapshots(self, top):
        pass


HYBRID = {}
BOUNDED = {"max_per_path": 2}
ALIASING = {"transfer_donation": True}      # the seed's bug, scheduler side: the real cache, but the
                                            # request donates its own live slot and keeps using it

# (mutant, harness config, what catches it in the fixed scenario: "model" = the tree/model
# comparison, "battery" = check_invariants, "accounting" = page / slot ownership)
MUTANTS = [
    (MatchesWholeKey, HYBRID, r"match\(.*tree .* != model"),                   # model
    (SnapshotOnePageEarly, HYBRID, "snapshot off a x4 boundary"),              # battery
    (ForgetsOneBoundary, HYBRID, "snapshots differ"),                          # model
    (KVOnlyTruncation, HYBRID, r"match\(.*tree .* != model"),                  # model
    (LeakedLock, HYBRID, "kv_lock .* != snap_lock"),                           # battery
    (EvictsLockedLeaf, HYBRID, "kv_lock .* != snap_lock"),                     # battery
    (EvictsLockedSnapshot, HYBRID, "kv_lock .* != snap_lock"),                 # battery
    (DedupLeaksSlot, HYBRID, "slot .* but 0 owners"),                          # accounting
    (DedupReplacesLive, HYBRID, "snapshots differ"),                           # model
    (EvictionSkipsDecref, HYBRID, "page .* refcount 2, expected 1"),           # accounting
    (AdoptsWithoutIncref, HYBRID, "page .* refcount 1, expected 2"),           # accounting
    (TombstoneLeafLeft, HYBRID, "hybrid leaf without a live snapshot"),        # battery
    (InsertsUncoveredTail, HYBRID, "hybrid leaf without a live snapshot"),     # battery
    (StaleLRUOnMatch, HYBRID, "nodes differ"),                                 # model (LRU times)
    (SplitDropsKVLock, HYBRID, "kv_lock .* != snap_lock"),                     # battery
    (SplitAliasesSnapshot, HYBRID, "held by two nodes"),                       # battery
    (NoPathBound, BOUNDED, "snapshots differ"),                                # model
    (HybridRadixCache, ALIASING, "slot .* has 2 owners"),                      # accounting
]
IDS = [cls.__name__ if cfg is not ALIASING else "OwnershipTransferDonation" for cls, cfg, _ in MUTANTS]


def scenario(h: Harness) -> None:
    """A fixed sequence through the shapes that matter, page_size 2, snapshots every 4 tokens."""
    a = (1, 0, 1, 1, 0, 0, 1, 0, 1, 1, 1, 0, 0, 1)
    r1 = h.admit(a)
    h.donate(r1, 14, [4, 12])                 # two boundaries, one node each
    h.finish(r1)
    r2 = h.admit(a)                           # repeated prompt: hits 12, locked
    h.donate(r2, 14, [8, 12])                 # 8 splits the locked node, 12 is a dedup
    b = a[:6] + (1, 1, 1, 1, 1, 1)
    r3 = h.admit(b)                           # hits 4; diverges at 6, inside a node
    h.donate(r3, 12, [8, 12])                 # a branch: tombstone branch point at 6
    h.query(a[:7])                            # passes the tombstone: truncated to 4
    h.query(a[:10])                           # hits 8
    h.evict_snapshots(2)                      # LRU unlocked: 4 and then 8' become tombstones
    h.evict_kv(4)                             # the unlocked branch leaf goes, 6 merges away
    h.finish(r2)
    h.finish(r3)
    c = (0, 1, 1, 0, 1, 0, 0, 0, 1, 1, 0, 1)  # 12 tokens, a boundary at its very end
    for _ in range(2):
        rid = h.admit(c)
        h.donate(rid, 12, [4, 8, 12])
        h.finish(rid)
    assert h.last_match.length == 8           # floor((12 - 1) / 4) * 4
    h.query(a)
    h.evict_snapshots(10)                     # leaves go whole
    h.evict_kv(100)
    h.drain()


@pytest.mark.parametrize("cfg", [HYBRID, BOUNDED], ids=["hybrid", "bounded"])
def test_real_cache_passes_the_scenario(cfg):
    scenario(Harness(**cfg))


@pytest.mark.parametrize(("cls", "cfg", "caught_by"), MUTANTS, ids=IDS)
def test_scenario_catches_mutant(cls, cfg, caught_by):
    with pytest.raises(AssertionError, match=caught_by):
        scenario(Harness(cache_cls=cls, **cfg))


_hunt = settings(max_examples=60, stateful_step_count=40, deadline=None, derandomize=True,
                 database=None, phases=[Phase.explicit, Phase.generate],
                 suppress_health_check=list(HealthCheck), print_blob=False)


def test_state_machine_passes_on_the_real_cache():
    run_state_machine_as_test(make_machine(num_pages=40, num_slots=14), settings=_hunt)


@pytest.mark.parametrize(("cls", "cfg", "caught_by"), MUTANTS, ids=IDS)
def test_state_machine_catches_mutant(cls, cfg, caught_by):
    machine = make_machine(num_pages=40, num_slots=14, cache_cls=cls, **cfg)
    with pytest.raises(AssertionError):
        run_state_machine_as_test(machine, settings=_hunt)
