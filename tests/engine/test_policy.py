"""Scheduling policies: each built-in's defining behaviour, the hooks' contracts, and that a
policy, whatever it decides, cannot break the engine (hit == cold, nothing leaks).

Engines here run on the fake device (tests/engine/fake_device.py): every token is a function of
what the request reads, so a policy that made the scheduler restore or page wrongly would change
tokens, and ``reference_continuation`` catches it."""

from __future__ import annotations

import random
import sys
import types
from collections import defaultdict

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import precondition, rule

from jaxserve.cache.allocator import PageAllocator, SlotAllocator
from jaxserve.cache.radix import HybridRadixCache
from jaxserve.engine.engine import Engine
from jaxserve.engine.policy import (POLICIES, DFSWeight, FairShare, LongestPrefixMatch, Policy, PriorityClasses,
                                    SchedulerView, ShortestPredictedJobFirst, make_policy)
from jaxserve.engine.request import Request
from jaxserve.engine.scheduler import Scheduler
from jaxserve.sampling_params import SamplingParams
from tests.cache.reference_model import make_machine
from tests.engine.checks import assert_pools_free_after_flush, drive
from tests.engine.fake_device import FakeExecutor, reference_continuation

VOCAB = 1000


def engine_with(policy: Policy, *, num_pages=128, num_slots=24, max_prefill=96, max_running=8) -> Engine:
    pages, slots = PageAllocator(num_pages), SlotAllocator(num_slots)
    cache = HybridRadixCache(pages, slots, 16)
    sched = Scheduler(pages=pages, slots=slots, cache=cache, page_size=16, max_prefill_tokens=max_prefill,
                      max_running=max_running, max_pages_per_seq=num_pages - 1, policy=policy)
    return Engine(sched, FakeExecutor(num_pages, num_slots, 16, VOCAB), vocab_size=VOCAB, debug_snapshot_checksums=True)


def ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(VOCAB) for _ in range(n)]


def sp(n: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=n, ignore_eos=True, **kw)


def first_token_steps(engine: Engine, max_steps: int = 5000) -> dict[str, int]:
    """Step until idle (invariants after every step); the step at which each request got its first token."""
    first: dict[str, int] = {}
    for step in range(max_steps):
        if not engine.has_work():
            return first
        for out in engine.step():
            first.setdefault(out.request_id, step)
        engine.check_invariants()
    raise AssertionError("engine did not drain")


# ---------------------------------------------------------------- selection


def test_registry_and_plugins():
    assert sorted(POLICIES) == ["dfs-weight", "fair", "fcfs", "lpm", "priority", "spjf"]
    assert all(type(make_policy(name)).name == name for name in POLICIES)
    mod = types.ModuleType("policy_plugin_for_test")

    class Newest(Policy):
        name = "newest"

        def order(self, waiting, view):
            return sorted(waiting, key=lambda r: -r.arrival)

    mod.Newest, mod.NotAPolicy = Newest, dict
    sys.modules[mod.__name__] = mod
    try:
        assert isinstance(make_policy("policy_plugin_for_test:Newest"), Newest)
        with pytest.raises(ValueError, match="not a scheduling policy"):
            make_policy("policy_plugin_for_test:NotAPolicy")
        with pytest.raises(ValueError, match="cannot load"):
            make_policy("policy_plugin_for_test:Missing")
    finally:
        del sys.modules[mod.__name__]
    with pytest.raises(ValueError, match="unknown scheduling policy 'sjf'"):
        make_policy("sjf")


# ---------------------------------------------------------------- built-ins, by their defining behaviour


def test_lpm_raises_the_hit_rate_under_snapshot_pressure():
    """Four system prompts, requests of each interleaved, room for few snapshots: FCFS rotates
    through the groups and evicts each prefix before its next request; LPM serves the cached group
    while it is cached."""
    rng = random.Random(0)
    systems = [ids(rng, 192) for _ in range(4)]
    prompts = [systems[i % 4] + ids(rng, 20) for i in range(32)]
    hit_rate = {}
    for name in ("fcfs", "lpm"):
        engine = engine_with(make_policy(name), num_slots=6, max_running=2)
        rids = [engine.add_request(p, sp(4)) for p in prompts]
        outs = drive(engine)
        for rid, p in zip(rids, prompts):
            assert outs[rid].output_ids == reference_continuation(p, 4, VOCAB)
        stats = engine.scheduler.cache.stats
        hit_rate[name] = stats.hit_tokens / stats.query_tokens
        assert_pools_free_after_flush(engine)
    assert hit_rate["lpm"] > 2 * hit_rate["fcfs"], hit_rate


@settings(max_examples=40, deadline=None)
@given(paths=st.lists(st.lists(st.integers(1, 4), max_size=3).map(tuple), min_size=1, max_size=12))
def test_dfs_weight_groups_shared_prefixes_heaviest_first(paths):
    """Against the definition: a permutation of the queue in which every subtree's requests are
    contiguous, sibling subtrees appear heaviest first, and a node's own requests follow its subtree."""
    reqs = [types.SimpleNamespace(rid=f"r{i}", arrival=i, path=p) for i, p in enumerate(paths)]
    view = types.SimpleNamespace(prefix_path=lambda r: r.path)
    out = DFSWeight().order(reqs, view)
    assert sorted(r.rid for r in out) == sorted(r.rid for r in reqs)
    weight = lambda prefix: sum(r.path[:len(prefix)] == prefix for r in reqs)  # noqa: E731
    for prefix in {r.path[:d] for r in reqs for d in range(len(r.path) + 1)}:
        at = [i for i, r in enumerate(out) if r.path[:len(prefix)] == prefix]
        assert at == list(range(at[0], at[-1] + 1)), f"subtree {prefix} is not contiguous"
        own = [i for i in at if out[i].path == prefix]
        assert own == at[len(at) - len(own):], f"requests at {prefix} do not follow its subtree"
        kids = []
        for i in at:
            if len(out[i].path) > len(prefix) and (not kids or kids[-1] != out[i].path[:len(prefix) + 1]):
                kids.append(out[i].path[:len(prefix) + 1])
        assert [weight(k) for k in kids] == sorted((weight(k) for k in kids), reverse=True)


def test_dfs_weight_admits_the_heavier_cached_group_first():
    rng = random.Random(2)
    engine = engine_with(DFSWeight(), max_running=1)
    a, b = ids(rng, 130), ids(rng, 130)
    engine.generate([a, b], sp(2))
    ra = engine.add_request(a + ids(rng, 5), sp(2))
    rbs = [engine.add_request(b + ids(rng, 5), sp(2)) for _ in range(3)]
    order = [rid for rid, _ in sorted(first_token_steps(engine).items(), key=lambda kv: kv[1])]
    # weights are recounted every step: b (3, then 2 waiting) beats a (1); at 1 against 1, arrival decides
    assert order == rbs[:2] + [ra, rbs[2]]


def test_priority_preempts_a_worse_class_and_stays_exact():
    rng = random.Random(3)
    engine = engine_with(PriorityClasses(), max_running=2)
    low = [ids(rng, 40) for _ in range(2)]
    lows = [engine.add_request(p, sp(30, priority=5)) for p in low]
    for _ in range(4):
        engine.step()
    assert len(engine.scheduler.running) == 2
    urgent = ids(rng, 40)
    rid = engine.add_request(urgent, sp(3, priority=-1))
    engine.step()
    sched = engine.scheduler
    assert rid in [r.rid for r in sched.running]
    assert sched.num_preemptions == 1 and [r.rid for r in sched.waiting] == [lows[1]]  # the newest low one
    outs = drive(engine)
    assert outs[rid].output_ids == reference_continuation(urgent, 3, VOCAB)
    for r, p in zip(lows, low):
        assert outs[r].output_ids == reference_continuation(p, 30, VOCAB)
    assert_pools_free_after_flush(engine)


def test_priority_never_preempts_an_equal_or_better_class():
    rng = random.Random(4)
    engine = engine_with(PriorityClasses(), max_running=2)
    for prio in (0, 1):
        engine.add_request(ids(rng, 40), sp(20, priority=prio))
    engine.step()
    engine.add_request(ids(rng, 40), sp(3, priority=1))
    drive(engine)
    assert engine.scheduler.num_preemptions == 0


def test_spjf_finishes_short_jobs_first():
    rng = random.Random(5)
    engine = engine_with(ShortestPredictedJobFirst(), max_running=1)
    lengths = [rng.randrange(1, 40) for _ in range(8)]
    rids = {engine.add_request(ids(rng, 30), sp(n)): n for n in lengths}
    steps = first_token_steps(engine)
    by_start = sorted(rids, key=lambda r: steps[r])
    assert [rids[r] for r in by_start] == sorted(lengths)


def test_spjf_uses_the_given_predictor():
    rng = random.Random(6)
    engine = engine_with(ShortestPredictedJobFirst(predictor=lambda r: 100 - r.sampling.max_tokens), max_running=1)
    rids = {engine.add_request(ids(rng, 30), sp(n)): n for n in (3, 9, 5)}
    steps = first_token_steps(engine)
    assert [rids[r] for r in sorted(rids, key=lambda r: steps[r])] == [9, 5, 3]


@pytest.mark.parametrize("quiet_count", [1, 3])
def test_fair_share_bounds_a_noisy_tenant(quiet_count):
    """A tenant that queues 24 requests ahead of a quiet one: FCFS makes the quiet one wait for all
    of them; fair share admits each quiet request within two admissions of a running place freeing."""
    rng = random.Random(7)
    waits = {}
    for name in ("fcfs", "fair"):
        engine = engine_with(make_policy(name), max_running=2)
        for _ in range(24):
            engine.add_request(ids(rng, 20), sp(6, tenant="noisy"))
        engine.step()
        quiet = [engine.add_request(ids(rng, 20), sp(6, tenant="quiet")) for _ in range(quiet_count)]
        steps = first_token_steps(engine)
        order = sorted(steps, key=lambda r: (steps[r], r))
        waits[name] = max(order.index(q) for q in quiet)
    assert waits["fcfs"] >= 24
    assert waits["fair"] <= 2 + 2 * quiet_count, waits


def test_fair_share_counters_follow_service():
    policy = FairShare(input_weight=1.0, output_weight=2.0)
    engine = engine_with(policy)
    rng = random.Random(8)
    engine.add_request(ids(rng, 50), sp(5, tenant="a"))
    engine.add_request(ids(rng, 10), sp(5, tenant="b"))
    drive(engine)
    assert policy.counters == {"a": 50 + 2 * 5, "b": 10 + 2 * 5}


# ---------------------------------------------------------------- hooks


class SmallSteps(Policy):
    name = "small-steps"

    def token_budget(self, view):
        return min(8, view.max_prefill_tokens)

    def chunk_size(self, req, budget, view):
        return min(budget, 5)


def test_token_budget_and_chunk_size_bound_every_step():
    rng = random.Random(9)
    engine = engine_with(SmallSteps())
    prompts = [ids(rng, n) for n in (70, 3, 130)]
    rids = [engine.add_request(p, sp(6)) for p in prompts]
    planned = []
    orig = engine.scheduler.schedule

    def spy():
        plan = orig()
        if plan is not None:
            planned.append(plan)
        return plan

    engine.scheduler.schedule = spy
    outs = drive(engine)
    assert planned and all(p.num_tokens <= 8 and all(len(r.tokens) <= 5 for r in p.rows) for p in planned)
    for rid, p in zip(rids, prompts):
        assert outs[rid].output_ids == reference_continuation(p, 6, VOCAB)


@pytest.mark.parametrize("hook, answer, message", [
    ("token_budget", lambda self, view: 0, "token_budget 0"),
    ("chunk_size", lambda self, req, budget, view: budget + 1, "chunk_size"),
    ("order", lambda self, waiting, view: list(view.running) + list(waiting), "not waiting"),
])
def test_bad_hook_answers_are_clear_errors(hook, answer, message):
    bad = type("Bad", (Policy,), {"name": "bad", hook: answer})()
    engine = engine_with(bad)
    rng = random.Random(10)
    engine.add_request(ids(rng, 20), sp(4))
    engine.add_request(ids(rng, 20), sp(4))
    with pytest.raises(ValueError, match=message):
        for _ in range(4):
            engine.step()


def test_a_victim_outside_the_candidates_is_a_clear_error():
    class Outsider(PriorityClasses):
        def victim(self, req, candidates, view, admitting):
            return req

    engine = engine_with(Outsider(), max_running=1)
    rng = random.Random(11)
    engine.add_request(ids(rng, 20), sp(8, priority=1))
    engine.step()
    engine.add_request(ids(rng, 20), sp(8, priority=0))
    with pytest.raises(ValueError, match="not one of the candidates"):
        engine.step()


class DeepestSnapshotFirst:
    """An eviction priority unlike LRU: deepest snapshot / leaf first."""

    def kv_key(self, node):
        return -node.end

    def snapshot_key(self, node):
        return -node.end


def test_eviction_priority_decides_which_snapshot_goes():
    for eviction, survivor in ((None, 192), (DeepestSnapshotFirst(), 64)):
        pages, slots = PageAllocator(64), SlotAllocator(8)
        cache = HybridRadixCache(pages, slots, 16)
        cache.eviction = eviction
        key = list(range(200))
        got = pages.alloc(12)
        snaps = {b: slots.alloc() for b in (64, 128, 192)}
        cache.insert(key[:192], got, snaps)
        pages.decref(got)
        cache.match(key[:193])     # LRU: the snapshot at 192 is the most recently used
        assert cache.evict_snapshots(2) == 2
        assert [n.end for n in cache._nodes() if n.snapshot is not None] == [survivor]
        cache.check_invariants()


class RandomEverything(Policy):
    """Random (but legal) answers to every hook, to show no policy can break the engine."""

    name = "random"
    admission_preempts = True

    def __init__(self, seed):
        self.rng = random.Random(seed)
        self.eviction = self

    def order(self, waiting, view):
        return self.rng.sample(list(waiting), len(waiting))

    def token_budget(self, view):
        return self.rng.randint(1, view.max_prefill_tokens)

    def chunk_size(self, req, budget, view):
        return self.rng.randint(0 if self.rng.random() < 0.1 else 1, budget)

    def victim(self, req, candidates, view, admitting):
        return self.rng.choice(list(candidates)) if self.rng.random() < 0.7 else None

    def kv_key(self, node):
        return self.rng.random()

    def snapshot_key(self, node):
        return self.rng.random()


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**31 - 1))
def test_any_legal_policy_keeps_hit_equal_cold_and_leaks_nothing(seed):
    rng = random.Random(seed)
    engine = engine_with(RandomEverything(seed), num_pages=40, num_slots=8, max_prefill=48, max_running=3)
    bases = [ids(rng, rng.choice([0, 64, 130])) for _ in range(3)]
    expected = {}
    for _ in range(25):
        p = rng.choice(bases) + ids(rng, rng.randrange(1, 60))
        n = rng.randrange(1, 20)
        expected[engine.add_request(p, sp(n, priority=rng.randrange(3)))] = reference_continuation(p, n, VOCAB)
    outs = drive(engine, max_steps=20000)
    assert {rid: o.output_ids for rid, o in outs.items()} == expected
    assert engine.snapshot_checksum_mismatches == 0
    assert_pools_free_after_flush(engine)


# ---------------------------------------------------------------- memoized prefix queries rank as fresh ones


def reference_lpm(waiting, cache):
    """LPM ranked with a fresh ``peek`` of every request (no memo)."""
    return sorted(waiting, key=lambda r: (-cache.peek(r.all_cache_ids), r.arrival))


def reference_spjf(waiting, cache, budget):
    def work(r):
        return max(0.0, r.sampling.max_tokens - len(r.output_ids)) + (len(r.all_cache_ids) - cache.peek(r.all_cache_ids)) / budget

    return sorted(waiting, key=lambda r: (work(r), r.arrival))


def reference_dfs_weight(waiting, cache):
    """DFS-weight written out plainly over fresh ``peek_path`` tuples: trie nodes are path prefixes."""
    children, at, weight, first = defaultdict(dict), defaultdict(list), defaultdict(int), {}
    for req in sorted(waiting, key=lambda r: r.arrival):
        path = cache.peek_path(req.all_cache_ids)
        at[path].append(req)
        for depth in range(len(path) + 1):
            weight[path[:depth]] += 1
            first.setdefault(path[:depth], req.arrival)
            if depth < len(path):
                children[path[:depth]][path[depth]] = path[:depth + 1]

    def emit(node):
        for kid in sorted(children[node].values(), key=lambda c: (-weight[c], first[c])):
            yield from emit(kid)
        yield from at[node]

    return list(emit(()))


def ranking_machine(**harness_kwargs):
    """The radix cache's state machine (tests/cache/reference_model.py: admit, donate, finish, query,
    both evictions and flush, each checked against a reference model) plus a queue of waiting
    requests that arrive, leave and grow output (a preempted request), and a rule that ranks the
    queue with one long-lived ``SchedulerView``. Its memoized probes must answer as fresh ``peek`` /
    ``peek_path`` calls, and LPM, DFS-weight and SPJF must give the orders the fresh answers give,
    however the tree changed since a request was last probed (splits, merges, tombstones, removals)."""

    class RankingMachine(make_machine(**harness_kwargs)):
        def __init__(self):
            super().__init__()
            self.queue: list[Request] = []
            self.view = SchedulerView(types.SimpleNamespace(cache=self.h.tree, waiting=self.queue, running=()))

        @rule(data=st.data())
        def arrive(self, data):
            req = Request(f"w{len(self.queue)}", list(self._ids(data)), sp(data.draw(st.integers(1, 9), label="max_tokens")))
            self.queue.append(req)

        @precondition(lambda self: self.queue)
        @rule(data=st.data())
        def leave_or_grow(self, data):
            req = data.draw(st.sampled_from(self.queue), label="request")
            if data.draw(st.booleans(), label="leave"):
                self.queue.remove(req)
            else:
                req.output_ids.append(data.draw(st.integers(0, 1), label="token"))

        @precondition(lambda self: self.queue)
        @rule()
        def rank(self):
            tree, queue, view = self.h.tree, self.queue, self.view
            assert LongestPrefixMatch().order(queue, view) == reference_lpm(queue, tree)
            assert DFSWeight().order(queue, view) == reference_dfs_weight(queue, tree)
            budget = 7
            view_with_budget = types.SimpleNamespace(max_prefill_tokens=budget, prefix_len=view.prefix_len)
            assert ShortestPredictedJobFirst().order(queue, view_with_budget) == reference_spjf(queue, tree, budget)
            for req in queue:
                assert view.prefix_len(req) == tree.peek(req.all_cache_ids)
                assert view.prefix_path(req) == tree.peek_path(req.all_cache_ids)

    return RankingMachine


_ranking_settings = settings(max_examples=40, stateful_step_count=40, deadline=None,
                             suppress_health_check=[HealthCheck.too_slow])
TestRankingHybrid = ranking_machine(num_pages=40, num_slots=14).TestCase
TestRankingHybrid.settings = _ranking_settings
TestRankingPlain = ranking_machine(num_pages=40, hybrid=False).TestCase
TestRankingPlain.settings = _ranking_settings
TestRankingBounded = ranking_machine(num_pages=40, num_slots=14, max_per_path=2).TestCase
TestRankingBounded.settings = _ranking_settings


def test_the_view_forgets_requests_that_left():
    """The memo holds probes of live (waiting or running) requests only, once the gone ones pile up."""
    pages, slots = PageAllocator(64), SlotAllocator(8)
    cache = HybridRadixCache(pages, slots, 16)
    waiting = []
    view = SchedulerView(types.SimpleNamespace(cache=cache, waiting=waiting, running=()))
    rng = random.Random(12)
    for i in range(300):
        waiting.append(Request(f"r{i}", ids(rng, 40), sp(1)))
        view.prefix_len(waiting[-1])
        if len(waiting) > 5:
            waiting.pop(0)
    assert len(view._probes) <= 2 * len(waiting) + 65
    assert set(waiting) <= set(view._probes)


def test_lpm_falls_back_to_fcfs_above_its_threshold():
    """``fcfs_above`` (SGLang's 128): arrival order while the queue is longer, LPM up to it."""
    rng = random.Random(13)
    engine = engine_with(LongestPrefixMatch())
    cached = ids(rng, 130)
    engine.generate([cached], sp(1))
    waiting = [Request(f"r{i}", ids(rng, 40) if i < 3 else cached + ids(rng, 5), sp(1)) for i in range(4)]
    view = engine.scheduler.view
    lpm_order = [waiting[3]] + waiting[:3]
    assert LongestPrefixMatch().order(waiting, view) == lpm_order
    assert LongestPrefixMatch(fcfs_above=4).order(waiting, view) == lpm_order
    assert LongestPrefixMatch(fcfs_above=3).order(waiting, view) == waiting
    with pytest.raises(ValueError, match="fcfs_above"):
        LongestPrefixMatch(fcfs_above=-1)


def test_a_memoized_prefix_follows_its_snapshot_going_and_coming_back():
    """Hybrid: a waiting request's walk ends at a branch point; its snapshot is evicted (a tombstone:
    the walk is unchanged, the hit is gone), then donated again (the hit is back)."""
    pages, slots = PageAllocator(64), SlotAllocator(8)
    cache = HybridRadixCache(pages, slots, 16)
    cache.eviction = types.SimpleNamespace(kv_key=lambda n: n.end, snapshot_key=lambda n: n.end)  # shallowest first
    view = SchedulerView(types.SimpleNamespace(cache=cache, waiting=[], running=()))
    rng = random.Random(14)
    base, tails = ids(rng, 64), [ids(rng, 64) for _ in range(2)]

    def donate(key, boundaries):
        got = pages.alloc(len(key) // 16)
        cache.insert(key, got, {b: slots.alloc() for b in boundaries})
        pages.decref(got)

    for tail in tails:
        donate(base + tail, (64, 128))
    req = Request("r", base + ids(rng, 30), sp(1))
    assert view.prefix_len(req) == 64
    path = view.prefix_path(req)
    assert cache.evict_snapshots(1) == 1
    assert view.prefix_len(req) == cache.peek(req.all_cache_ids) == 0
    assert view.prefix_path(req) == cache.peek_path(req.all_cache_ids) == path  # the walk is the same
    donate(base, (64,))
    assert view.prefix_len(req) == cache.peek(req.all_cache_ids) == 64
    cache.check_invariants()
