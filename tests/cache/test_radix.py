"""HybridRadixCache: the shapes peers got wrong, the contract edge by edge, and a hypothesis
state machine against the page-level reference model (tests/cache/reference_model.py).

Every step that goes through ``Harness`` also runs the invariant battery, compares the tree with
the model prefix by prefix and checks page / slot accounting (see reference_model.py)."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxserve.cache import HybridRadixCache, PageAllocator, SlotAllocator
from tests.cache.reference_model import Harness, make_machine, node_prefix

PS, SI = 16, 64      # the engine's shape: 16-token pages, snapshots every 64 tokens


def real(**kw) -> Harness:
    kw = {"num_pages": 200, "num_slots": 24, "page_size": PS, "interval": SI, **kw}
    return Harness(**kw)


def every_boundary(n: int, interval: int = SI) -> list[int]:
    return list(range(interval, n + 1, interval))


def serve(h: Harness, ids, boundaries=None, donate_len=None) -> int:
    """One request start to finish (admit, donate at finish, release); returns its hit length."""
    rid = h.admit(ids)
    assert rid is not None, "admission failed"
    hit = h.last_match.length
    n = len(ids) if donate_len is None else donate_len
    h.donate(rid, n, every_boundary(n // h.ps * h.ps, h.interval) if boundaries is None else boundaries)
    h.finish(rid)
    return hit


def toks(n: int, seed: int = 0) -> list[int]:
    return [(seed * 7919 + i * 31) % 50000 for i in range(n)]


# ----------------------------------------------------------------------------- peer-bug shapes

@given(L=st.integers(1, 700), ps=st.sampled_from([16, 32, 64]))
@settings(max_examples=40, deadline=None)
def test_exactly_repeated_prompt_hits_last_aligned_boundary(L, ps):
    """SGLang #21158: 0% on exactly repeated prompts. The last token is recomputed, so a
    repeat of L tokens hits floor((L-1)/64)*64."""
    h = real(page_size=ps)
    assert serve(h, toks(L)) == 0
    assert serve(h, toks(L)) == (L - 1) // SI * SI
    h.drain()


@given(L=st.integers(1, 300))
@settings(max_examples=25, deadline=None)
def test_exactly_repeated_prompt_plain_attention(L):
    h = real(hybrid=False)
    serve(h, toks(L), boundaries=[])
    assert serve(h, toks(L), boundaries=[]) == (L - 1) // PS * PS
    h.drain()


def test_prompt_shorter_than_one_block():
    """vLLM #40696. Shorter than a page: nothing to cache, no error, nothing left behind. Between
    a page and a snapshot interval: plain attention hits whole pages; hybrid cannot hit (no
    boundary) and must not keep a snapshot-less KV leaf either."""
    for hybrid in (True, False):
        h = real(hybrid=hybrid)
        bounds = None if hybrid else []
        for L in (1, 2, PS - 1):
            serve(h, toks(L), bounds)
            assert serve(h, toks(L), bounds) == 0 and h.tree.num_nodes == 0
        serve(h, toks(PS), bounds)                  # one whole page: cached (plain), but a
        assert serve(h, toks(PS), bounds) == 0      # repeat must recompute its last token
        serve(h, toks(40), bounds)
        assert serve(h, toks(40), bounds) == (0 if hybrid else 32)
        assert h.tree.num_nodes == (0 if hybrid else 1)
        serve(h, toks(65), bounds)
        assert serve(h, toks(65), bounds) == 64
        h.drain()


def test_concurrency_one_with_a_tight_pool():
    """vLLM #42317: hits at concurrency 1. One request at a time, pools sized for about one
    request, so every admission evicts: the hit must survive (it is matched and locked first)."""
    L = 300
    pages = -(-L // PS)
    h = real(num_pages=pages + 3, num_slots=6)
    hits = [serve(h, toks(L)) for _ in range(5)]
    assert hits == [0] + [(L - 1) // SI * SI] * 4
    h.drain()


def test_multi_turn_follow_up_hits_end_of_previous_answer():
    """vLLM #43587: turn 2's prompt extends turn 1's prompt + answer; it hits the last x64
    boundary of what turn 1 donated (prompt + answer), and turn 3 the one of turn 2."""
    h = real()
    convo = toks(150, seed=1)                    # turn-1 prompt
    rid = h.admit(convo + toks(30, seed=2))      # + its 30-token answer, decoded in place
    assert h.last_match.length == 0
    h.donate(rid, 150, [64, 128])                # chunk commits during prefill
    h.donate(rid, 180, [64, 128])                # finish: prompt + answer, cut to 176 tokens
    h.finish(rid)
    turn1 = convo + toks(30, seed=2)
    turn2 = turn1 + toks(60, seed=3)
    assert serve(h, turn2) == 128                # floor(180 / 64) * 64
    turn3 = turn2 + toks(25, seed=4)
    assert serve(h, turn3) == 192                # turn 2 donated 240 tokens: 64, 128, 192
    assert h.query(turn1 + toks(5, seed=9))[0].length == 128   # a sibling follow-up of turn 1
    h.drain()


def test_dedup_keeps_the_old_snapshot_and_frees_the_donated_slot():
    h = real()
    ids = toks(100)
    a, b = h.admit(ids), h.admit(ids)            # concurrent, both cold
    h.donate(a, 100, [64])
    kept = h.tree.owned_slots()
    h.donate(b, 100, [64])                       # same boundary: the clone goes straight back
    assert h.tree.owned_slots() == kept and h.tree.stats.snapshots_deduped == 1
    assert h.slots.num_free == h.slots.capacity - 3     # two live slots + one tree snapshot
    assert h.query(ids)[0].snapshot_slot in kept
    h.finish(a)
    h.finish(b)
    h.drain()


def test_tombstoned_inner_node_is_skipped_by_match():
    """A hit that would end at a tombstone (KV, no state) is truncated to a shallower snapshot."""
    h = real()
    key = toks(200)
    serve(h, key)                                # snapshots at 64, 128, 192, all one donation
    assert h.query(toks(100))[0].length == 64    # restores 64: now the most recent snapshot
    assert h.evict_snapshots(1) == 1             # LRU: 128 and 192 tie, the shallower goes
    assert sorted(n.end for n in h.tree._nodes() if n.snapshot) == [64, 192]
    assert h.query(key[:150])[0].length == 64    # not 128: KV alone cannot resume
    assert h.query(key)[0].length == 192         # a deeper snapshot below the tombstone still works
    h.drain()


# ----------------------------------------------------------------------------- the contract

def test_empty_cache():
    h = real()
    m, _ = h.query(toks(500))
    assert (m.length, m.pages, m.snapshot_slot, m.node) == (0, [], None, h.tree.root)
    assert h.query([])[0].length == 0
    h.drain()


def test_insert_adopts_new_pages_and_keeps_its_own_for_shared_prefix():
    pages, slots = PageAllocator(32), SlotAllocator(8)
    tree = HybridRadixCache(pages, slots, PS, SI)
    ids = toks(128)
    pa = pages.alloc(4)
    tree.insert(ids[:64], pa, {64: slots.alloc()})
    pb = pages.alloc(8)                          # a cold duplicate of the prefix, then more
    s64, s128 = slots.alloc(), slots.alloc()
    tree.insert(ids, pb, {64: s64, 128: s128})
    assert slots.is_free(s64) and not slots.is_free(s128)
    assert [pages.refcount(p) for p in pa] == [2] * 4
    assert [pages.refcount(p) for p in pb] == [1] * 4 + [2] * 4
    assert tree.owned_pages() == set(pa) | set(pb[4:])
    m = tree.match(ids + [7])
    assert (m.length, m.pages, m.snapshot_slot) == (128, pa + pb[4:], s128)
    tree.check_invariants()


def test_hybrid_insert_drops_the_uncovered_tail():
    pages, slots = PageAllocator(32), SlotAllocator(8)
    tree = HybridRadixCache(pages, slots, PS, SI)
    ids, pg = toks(200), pages.alloc(13)
    tree.insert(ids, pg, {})                     # no snapshot: nothing usable, nothing kept
    assert tree.num_nodes == 0 and pages.num_free == 31 - 13
    tree.insert(ids, pg, {64: slots.alloc()})
    assert tree.num_tree_pages == 4 and tree.num_nodes == 1
    tree.check_invariants()


def test_boundary_inside_a_node_splits_it():
    h = real()
    key = toks(200)
    serve(h, key, boundaries=[192])
    assert h.tree.num_nodes == 1 and h.query(key[:150])[0].length == 0
    serve(h, key, boundaries=[64])
    assert h.tree.num_nodes == 2 and h.query(key[:150])[0].length == 64
    h.drain()


def test_plain_attention_partial_node_hit_and_lock():
    h = real(hybrid=False)
    serve(h, toks(128), boundaries=[])
    other = toks(40) + toks(60, seed=5)
    rid = h.admit(other)
    m = h.last_match
    assert m.length == 32 and m.node.end == 128  # a partial hit locks the node it lies in
    assert h.evict_kv(100) == 0                  # pinned
    h.finish(rid)
    assert h.evict_kv(100) == 8
    h.drain()


def test_locks_pin_kv_and_snapshot():
    h = real()
    key = toks(200)
    serve(h, key)
    rid = h.admit(key)                           # hit 192, locks that node
    assert h.last_match.length == 192
    assert h.evict_kv(1000) == 0
    assert h.evict_snapshots(10) == 2            # 64 and 128 become tombstones; 192 is pinned
    assert h.tree.num_snapshots == 1 and h.tree.num_nodes == 1
    with pytest.raises(ValueError):
        h.tree.unlock(h.tree.root)
    h.finish(rid)
    assert h.evict_snapshots(10) == 1 and h.tree.num_nodes == 0
    h.drain()


def test_evict_kv_counts_only_pages_it_freed():
    """Pages a running request still holds leave the tree but are not free."""
    h = real()
    key = toks(128)
    rid = h.admit(key + toks(40, seed=3))
    h.donate(rid, 128, [64, 128])                # chunk commit: the request keeps running
    dropped = h.tree.stats.kv_pages_dropped
    assert h.evict_kv(100) == 0 and h.tree.num_nodes == 0
    assert h.tree.stats.kv_pages_dropped - dropped == 8
    h.finish(rid)
    h.drain()


def test_max_snapshots_per_path_evicts_lru_then_shallowest():
    h = real(max_per_path=2)
    key = toks(256)
    serve(h, key)                                # 64, 128, 192, 256 at once: all equally recent
    assert sorted(n.end for n in h.tree._nodes() if n.snapshot) == [192, 256]
    assert h.tree.stats.snapshots_bounded == 2
    assert h.query(key[:190])[0].length == 0     # 128 and 64 are tombstones now
    branch = key[:192] + toks(70, seed=8)        # a sibling below 192 donates 64..256 again:
    serve(h, branch)                             # 64, 128 re-adopted, then bounded away again
    assert sorted(n.end for n in h.tree._nodes() if n.snapshot) == [192, 256, 256]
    assert h.query(branch)[0].length == 256 and h.query(key)[0].length == 192
    h.drain()


def test_lock_of_stale_node_raises():
    h = real()
    serve(h, toks(100))
    m, _ = h.query(toks(100))
    h.evict_kv(100)
    with pytest.raises(ValueError, match="no longer in the tree"):
        h.tree.lock(m.node)
    h.drain()


def test_argument_validation_changes_nothing():
    pages, slots = PageAllocator(32), SlotAllocator(8)
    tree = HybridRadixCache(pages, slots, PS, SI)
    ids, pg, s = toks(130), pages.alloc(9), slots.alloc()
    bad = [
        (ids, pg, {63: s}),                      # off a x64 boundary
        (ids, pg, {0: s}),
        (ids, pg, {192: s}),                     # beyond the 128 whole-page tokens
        (ids, pg[:7], {64: s}),                  # too few pages
        (ids, [0] + pg[1:], {64: s}),            # the null page
        (ids, pg, {64: slots.alloc() and 7}),    # a free slot (never written)
        (ids, pg, {64: s, 128: s}),              # one slot at two boundaries
        (ids, pg[:1] * 9, {64: s}),              # one page at two positions
    ]
    for args in bad:
        with pytest.raises(ValueError):
            tree.insert(*args)
    assert tree.num_nodes == 0 and [pages.refcount(p) for p in pg] == [1] * 9
    tree.insert(ids, pg, {64: s})
    with pytest.raises(ValueError, match="aliasing"):
        tree.insert(ids, pg, {128: s})           # the tree's own slot donated again
    plain = HybridRadixCache(pages, None, PS, SI, hybrid=False)
    with pytest.raises(ValueError):
        plain.insert(ids, pg, {64: s})
    with pytest.raises(ValueError):
        HybridRadixCache(pages, slots, 16, 40)
    with pytest.raises(ValueError):
        HybridRadixCache(pages, None, 16, 64, hybrid=True)
    tree.check_invariants()


def test_check_invariants_names_the_broken_invariant():
    def inner(h):
        return next(n for n in h.tree._nodes() if n.snapshot is not None and n.children)

    corruptions = [
        (lambda h: setattr(inner(h), "kv_lock", 1), "kv_lock .* children.s 1"),
        (lambda h: setattr(inner(h), "end", 48), "child end inconsistent"),
        (lambda h: h.slots.free(inner(h).snapshot), "free in the allocator"),
        (lambda h: h.pages.decref(inner(h).pages), "tree page .* is free"),
        (lambda h: setattr(inner(h), "snapshot", None), "pass-through node not merged"),
        (lambda h: h.tree._tree_slots.add(99), "slot index"),
        (lambda h: setattr(h.tree, "num_nodes", 5), "num_nodes"),
    ]
    for corrupt, msg in corruptions:
        h = real()
        serve(h, toks(200))
        h.tree.check_invariants()
        corrupt(h)
        with pytest.raises(AssertionError, match=msg):
            h.tree.check_invariants()


def test_metrics_report_pool_pressure():
    h = real(num_slots=9)
    serve(h, toks(300))
    m = h.tree.metrics()
    assert m["num_snapshots"] == 4 and m["snapshot_pool_share"] == 0.5
    assert m["queries"] == 1 and m["inserts"] == 1 and m["num_tree_pages"] == 16
    assert h.tree.evictable_pages() == 16
    h.drain()


# ----------------------------------------------------------------------------- state machines

_machine_settings = settings(max_examples=80, stateful_step_count=40, deadline=None)

TestHybridMachine = make_machine(num_pages=40, num_slots=14).TestCase
TestHybridMachine.settings = _machine_settings
TestPlainMachine = make_machine(num_pages=40, hybrid=False).TestCase
TestPlainMachine.settings = _machine_settings
TestBoundedMachine = make_machine(num_pages=40, num_slots=14, max_per_path=2).TestCase
TestBoundedMachine.settings = _machine_settings
TestScarceMachine = make_machine(num_pages=20, num_slots=5, interval=2).TestCase   # every page a boundary
TestScarceMachine.settings = _machine_settings


def test_node_prefix_helper():
    h = real()
    serve(h, toks(130))
    leaf = max(h.tree._nodes(), key=lambda n: n.end)
    assert node_prefix(leaf) == tuple(toks(128)) and node_prefix(h.tree.root) == ()


@given(seed=st.integers(0, 2**31))
@settings(max_examples=40, deadline=None)
def test_walks_from_a_locked_hint_answer_as_from_the_root(seed):
    """The scheduler asks about and donates a request's boundaries from the request's locked node
    instead of the root. Two trees get the same operations, one with hints and one without: they
    must stay identical (pages, slots, LRU times, locks), and ``has_snapshot_at`` must equal
    ``peek(ids[:b + 1]) == b``, also after later inserts split the path above the hint and
    evictions tombstone or drop nodes."""
    import random

    from tests.cache.reference_model import tree_view

    rng = random.Random(seed)
    trees = []
    for _ in range(2):
        pages, slots = PageAllocator(300), SlotAllocator(30)
        trees.append((pages, slots, HybridRadixCache(pages, slots, PS, snapshot_interval=SI)))
    blocks = [toks(SI // 2, s) for s in range(3)]  # half-interval blocks: prefixes share, splits fall inside

    def prompt() -> list[int]:
        head = [t for _ in range(rng.randint(1, 12)) for t in rng.choice(blocks)]
        return head + toks(rng.randint(0, 40), rng.random())

    def donate(ids: list[int], hints=(None, None)) -> None:
        """Insert ``ids`` into both trees, donating each boundary above the hint with probability 0.6."""
        n = len(ids) // PS
        low = 0 if hints[0] is None else hints[0].end
        keep = [b for b in every_boundary(n * PS) if b > low and rng.random() < 0.6]
        for (pages, slots, tree), hint in zip(trees, hints):
            got = pages.alloc(n) if n else []
            if got is None:
                tree.evict_kv(n - pages.num_free)
                got = pages.alloc(n)
            if not got:
                continue
            snaps = {}
            for b in keep:
                slot = slots.alloc()
                if slot is None and tree.evict_snapshots(1):
                    slot = slots.alloc()
                if slot is not None:
                    snaps[b] = slot
            tree.insert(ids, got, snaps, hint=hint)  # the tree keeps or frees every donated slot
            pages.decref(got)

    for _ in range(6):
        donate(prompt())
    for _ in range(4):
        ids = prompt()
        hints = [tree.match(ids).node for _, _, tree in trees]
        for (_, _, tree), hint in zip(trees, hints):
            tree.lock(hint)
        for _ in range(rng.randint(0, 4)):
            donate(prompt())
            if rng.random() < 0.5:
                k = rng.randint(1, 3)
                for _, _, tree in trees:
                    tree.evict_snapshots(k)
        donate(ids + toks(rng.randint(0, 3 * SI), rng.random()), (hints[0], None))  # the request's own donation
        tree, hint = trees[0][2], hints[0]
        for b in every_boundary(len(ids) + SI):
            want = tree.peek(ids[:b + 1]) == b
            assert tree.has_snapshot_at(ids[:b + 1], b, hint) == want, (b, hint)
            assert tree.has_snapshot_at(ids[:b + 1], b) == want, b
        for (_, _, tree), hint in zip(trees, hints):
            tree.unlock(hint)
            tree.check_invariants()
        assert tree_view(trees[0][2]) == tree_view(trees[1][2]), "a hinted insert changed the tree"
