"""Scheduler + radix cache + engine against the fake device (tests/engine/fake_device.py).

The fake device makes every token a function of the KV a request reads and the linear state it
carries, so "hit equals cold" and "nothing leaks" are checked here over thousands of steps in
seconds: every finished request must produce exactly ``reference_continuation`` of its prompt,
and the invariant check (every page and slot free, held by a live request, or held by the tree)
runs after every step. Every test runs twice: with the step loop synchronous and overlapped
(step N+1 planned and dispatched before step N is committed).
"""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jaxserve.cache.allocator import PageAllocator, SlotAllocator
from jaxserve.cache.radix import HybridRadixCache
from jaxserve.engine.engine import Engine
from jaxserve.engine.policy import make_policy
from jaxserve.engine.scheduler import Scheduler
from jaxserve.sampling_params import SamplingParams
from tests.engine.checks import assert_pools_free_after_flush
from tests.engine.faults import FAULTS, FaultyScheduler
from tests.engine.fake_device import FakeExecutor, reference_continuation

VOCAB = 1000
OVERLAP = [False]  # set per test by the ``loop`` fixture


@pytest.fixture(autouse=True, params=[False, True], ids=["sync", "overlap"])
def loop(request):
    OVERLAP[0] = request.param
    yield request.param
    OVERLAP[0] = False


def make_engine(*, hybrid=True, num_pages=128, num_slots=24, page_size=16, max_prefill=96, max_running=8,
                policy="fcfs", max_pages_per_seq=64):
    pages = PageAllocator(num_pages)
    slots = SlotAllocator(num_slots) if hybrid else None
    cache = HybridRadixCache(pages, slots, page_size, hybrid=hybrid)
    sched = Scheduler(pages=pages, slots=slots, cache=cache, page_size=page_size, max_prefill_tokens=max_prefill,
                      max_running=max_running, max_pages_per_seq=max_pages_per_seq, policy=make_policy(policy))
    ex = FakeExecutor(num_pages, num_slots, page_size, VOCAB, hybrid)
    return Engine(sched, ex, vocab_size=VOCAB, debug_snapshot_checksums=True, overlap=OVERLAP[0])


def prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(VOCAB) for _ in range(n)]


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, ignore_eos=True)


@pytest.mark.parametrize("hybrid", [True, False])
@pytest.mark.parametrize("length", [1, 40, 63, 64, 65, 129, 200, 300])
def test_repeat_hits_and_equals_cold(hybrid, length):
    rng = random.Random(length)
    engine = make_engine(hybrid=hybrid)
    p = prompt(rng, length)
    cold, hit = engine.generate([p], greedy(12))[0], engine.generate([p], greedy(12))[0]
    ref = reference_continuation(p, 12, VOCAB, hybrid)
    assert cold.output_ids == ref and hit.output_ids == ref
    assert cold.cached_tokens == 0
    unit = 64 if hybrid else 16
    assert hit.cached_tokens == (length - 1) // unit * unit  # the last token is always recomputed
    assert engine.snapshot_checksum_mismatches == 0
    assert_pools_free_after_flush(engine)


@pytest.mark.parametrize("fault", FAULTS)
def test_injected_fault_corrupts_every_hit(fault):
    """The fault the probe tests rely on (tests/engine/faults.py) does corrupt hits: cold runs stay
    right, every hit (one admitted beside another running hit, for ``wrong-snapshot``) goes wrong,
    and the bookkeeping stays sound."""
    rng = random.Random(7)
    engine = make_engine()
    FaultyScheduler.corrupt(engine.scheduler, fault)
    prompts = [prompt(rng, 200), prompt(rng, 150)]
    refs = [reference_continuation(p, 12, VOCAB) for p in prompts]
    assert [o.output_ids for o in engine.generate(prompts, greedy(12))] == refs
    hits = engine.generate(prompts, greedy(12))
    assert [o.cached_tokens for o in hits] == [192, 128]
    assert all(o.output_ids != ref for o, ref in zip(hits, refs))
    assert_pools_free_after_flush(engine)
    with pytest.raises(ValueError, match="fault must be one of"):
        FaultyScheduler.corrupt(make_engine().scheduler, "bit-flip")


def test_multi_turn_follow_up_hits_last_boundary_of_prompt_plus_answer():
    rng = random.Random(0)
    engine = make_engine()
    turn1 = prompt(rng, 100)
    out1 = engine.generate([turn1], greedy(40))[0]
    turn2 = turn1 + out1.output_ids + prompt(rng, 30)
    out2 = engine.generate([turn2], greedy(10))[0]
    assert out2.cached_tokens == 128  # prompt + answer = 140 tokens -> the ×64 boundary at 128
    assert out2.output_ids == reference_continuation(turn2, 10, VOCAB)
    assert_pools_free_after_flush(engine)


@pytest.mark.parametrize("max_prefill", [7, 16, 64, 100, 1000])
def test_chunked_prefill_sizes_give_same_tokens(max_prefill):
    rng = random.Random(1)
    prompts = [prompt(rng, n) for n in (150, 70, 5, 260)]
    engine = make_engine(max_prefill=max_prefill)
    outs = engine.generate(prompts, greedy(9))
    for p, o in zip(prompts, outs):
        assert o.output_ids == reference_continuation(p, 9, VOCAB)
    assert_pools_free_after_flush(engine)


def test_concurrency_one_still_hits():
    rng = random.Random(2)
    engine = make_engine(max_running=1)
    p = prompt(rng, 140)
    outs = engine.generate([p, p, p], greedy(5))
    assert [o.cached_tokens for o in outs] == [0, 128, 128]
    assert all(o.output_ids == reference_continuation(p, 5, VOCAB) for o in outs)


def test_abort_queued_prefilling_and_decoding_frees_everything():
    rng = random.Random(3)
    engine = make_engine(max_prefill=32, max_running=2)
    b = engine.add_request(prompt(rng, 10), greedy(50))   # decoding from the second step
    a = engine.add_request(prompt(rng, 200), greedy(50))  # prefilling for several steps
    c = engine.add_request(prompt(rng, 10), greedy(50))   # queued (max_running=2)
    for _ in range(3):
        engine.step()
        engine.check_invariants()
    reqs = engine.scheduler
    assert any(r.rid == a and r.num_pending > 1 for r in reqs.running)
    assert any(r.rid == b and r.num_pending == 1 for r in reqs.running)
    assert any(r.rid == c for r in reqs.waiting)
    for rid in (c, a, b):
        assert engine.abort(rid)
        engine.check_invariants()
    assert not engine.scheduler.has_work()
    assert engine.step() == [] and not engine.has_work()  # overlapped: the step in flight is dropped
    assert not engine.abort(a)
    assert_pools_free_after_flush(engine)


def test_preemption_under_page_pressure_still_equals_cold():
    rng = random.Random(4)
    # 20 usable pages of 16 tokens: four 100-token requests generating 60 tokens cannot all fit.
    engine = make_engine(num_pages=21, num_slots=12, max_running=4, max_pages_per_seq=20)
    prompts = [prompt(rng, 100) for _ in range(4)]
    outs = engine.generate(prompts, greedy(60))
    assert engine.scheduler.num_preemptions > 0
    for p, o in zip(prompts, outs):
        assert o.output_ids == reference_continuation(p, 60, VOCAB)
    assert_pools_free_after_flush(engine)


def test_lpm_policy_prefers_cached_prefix():
    rng = random.Random(5)
    engine = make_engine(policy="lpm", max_running=1)
    shared = prompt(rng, 130)
    engine.generate([shared], greedy(2))
    cold_req = engine.add_request(prompt(rng, 130), greedy(2))
    warm_req = engine.add_request(shared + [1, 2, 3], greedy(2))
    engine.step()
    assert [r.rid for r in engine.scheduler.running] == [warm_req]
    engine.run_until_done()
    assert cold_req not in engine.requests


def test_stop_token_and_max_tokens_finish_reasons():
    rng = random.Random(6)
    engine = make_engine()
    p = prompt(rng, 30)
    ref = reference_continuation(p, 20, VOCAB)
    out = engine.generate([p], SamplingParams(max_tokens=20, stop_token_ids=(ref[4],)))[0]
    assert out.output_ids == ref[: ref.index(ref[4]) + 1] and out.finish_reason == "stop"
    out = engine.generate([p], greedy(3))[0]
    assert out.output_ids == ref[:3] and out.finish_reason == "length"


def test_bad_requests_are_refused_without_side_effects():
    engine = make_engine(max_pages_per_seq=4)
    with pytest.raises(ValueError, match="empty"):
        engine.add_request([], greedy(1))
    with pytest.raises(ValueError, match="token ids"):
        engine.add_request([VOCAB], greedy(1))
    with pytest.raises(ValueError, match="context"):
        engine.add_request([1] * 60, greedy(10))
    assert not engine.has_work()
    engine.check_invariants()


def test_injected_restore_fault_is_caught():
    """The checks must be able to fail: a device that restores a wrong state breaks hit == cold."""
    rng = random.Random(7)
    engine = make_engine()
    p = prompt(rng, 150)
    engine.generate([p], greedy(8))
    engine.executor.corrupt_restores = True
    hit = engine.generate([p], greedy(8))[0]
    assert hit.cached_tokens == 128
    assert hit.output_ids != reference_continuation(p, 8, VOCAB)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**31 - 1), hybrid=st.booleans(), pressure=st.sampled_from(["roomy", "tight"]))
def test_storm_of_submits_aborts_evictions(seed, hybrid, pressure):
    """Randomized storm: shared-prefix prompts, random lengths, aborts at random steps, pools small
    enough (``tight``) to force KV/snapshot eviction and preemption. Every step keeps the invariants;
    every request that finishes equals its cold reference; the pools drain to free."""
    rng = random.Random(seed)
    pages, slots = (40, 10) if pressure == "tight" else (200, 40)
    engine = make_engine(hybrid=hybrid, num_pages=pages, num_slots=slots, max_prefill=rng.choice([16, 48, 128]),
                         max_running=rng.choice([1, 3, 6]), max_pages_per_seq=pages - 1,
                         policy=rng.choice(["fcfs", "lpm"]))
    bases = [prompt(rng, rng.choice([0, 64, 100, 200])) for _ in range(3)]
    expected, live = {}, []
    for step in range(5000):
        if step < 250 and rng.random() < 0.3:
            p = rng.choice(bases) + prompt(rng, rng.randrange(1, 90))
            n = rng.randrange(1, 40)
            if (len(p) + n) // 16 + 1 < pages - 2:
                rid = engine.add_request(p, greedy(n))
                expected[rid] = reference_continuation(p, n, VOCAB, hybrid)
                live.append(rid)
        if live and rng.random() < 0.08:
            rid = live.pop(rng.randrange(len(live)))
            engine.abort(rid)
            expected.pop(rid)
        for out in engine.step():
            if out.finished:
                assert out.output_ids == expected.pop(out.request_id), f"seed {seed}: {out.request_id} differs from cold"
                live.remove(out.request_id)
        engine.check_invariants()
        if step >= 250 and not engine.has_work():
            break
    assert not engine.has_work() and not expected, "storm did not drain"
    assert engine.snapshot_checksum_mismatches == 0
    assert_pools_free_after_flush(engine)


def test_overlapped_loop_feeds_tokens_it_has_not_read_yet():
    """With overlap, a decode row is planned before its input token reaches the host: the row names
    the previous step's row (``feed``) and the device reads the token there. One step is always in
    flight while requests decode, and the tokens still equal the cold reference."""
    if not OVERLAP[0]:
        pytest.skip("overlap only")
    rng = random.Random(8)
    engine = make_engine()
    prompts = [prompt(rng, n) for n in (20, 70)]
    rids = [engine.add_request(p, greedy(12)) for p in prompts]
    fed = 0
    outs = {}
    while engine.has_work():
        for o in engine.step():
            outs[o.request_id] = o
        engine.check_invariants()
        if engine.scheduler.running:
            assert len(engine._in_flight) == 1
            fed += sum(row.feed >= 0 for row in engine._in_flight[0][0].rows)
    assert fed > 0
    for rid, p in zip(rids, prompts):
        assert outs[rid].output_ids == reference_continuation(p, 12, VOCAB)
    assert_pools_free_after_flush(engine)


@pytest.mark.parametrize("lose_state", [False, True], ids=["pools-kept", "pools-lost"])
def test_failed_step_fails_its_requests_and_the_engine_keeps_serving(lose_state):
    """A step that fails on the device fails exactly the requests it carried (finish_reason
    "error"); everything else finishes equal to cold, nothing leaks, and later requests (hits
    included) are served normally. When the failure took the pools with it, the cache is flushed
    and the other running requests are recomputed, never served from lost state."""
    rng = random.Random(9)
    engine = make_engine(max_prefill=64, max_running=3)
    shared = prompt(rng, 130)
    engine.generate([shared], greedy(3))  # a tree snapshot for later hits
    ex = engine.executor
    ex.lose_state_on_failure = lose_state
    prompts = [shared + prompt(rng, 10), prompt(rng, 40), prompt(rng, 90), prompt(rng, 5)]
    rids = [engine.add_request(p, greedy(20)) for p in prompts]
    engine.step()
    ex.fail_steps = {ex.steps + 3}
    outs = {}
    for _ in range(500):
        if not engine.has_work():
            break
        for o in engine.step():
            if o.finished:
                outs[o.request_id] = o
        engine.check_invariants()
    failed = [rid for rid in rids if outs[rid].finish_reason == "error"]
    assert 1 <= len(failed) < len(rids) and engine.failed_steps == 1
    for rid, p in zip(rids, prompts):
        if rid not in failed:
            assert outs[rid].output_ids == reference_continuation(p, 20, VOCAB), rid
    again = engine.generate([shared + prompt(rng, 3)], greedy(5))[0]
    assert again.output_ids == reference_continuation(shared + again.prompt_token_ids[130:], 5, VOCAB)
    assert engine.snapshot_checksum_mismatches == 0
    assert_pools_free_after_flush(engine)


@pytest.mark.parametrize("cap", [1, 2])
def test_a_step_holds_at_most_max_chunked_rows_rows_of_several_tokens(cap):
    """The scheduler keeps the chunk grid's promise (``ModelConfig.chunked_rows``): a burst of short
    prompts that one step's token budget would take together is spread over steps with at most
    ``cap`` rows of more than one token each (decodes ride along), and every output stays exact."""
    rng = random.Random(cap)
    engine = make_engine(max_prefill=96, max_running=8)
    engine.scheduler.max_chunked_rows = cap
    schedule, seen = engine.scheduler.schedule, []

    def spy():
        plan = schedule()
        if plan is not None:
            seen.append((sum(len(r.tokens) > 1 for r in plan.rows), len(plan.rows)))
        return plan

    engine.scheduler.schedule = spy
    prompts = [prompt(rng, rng.randrange(2, 12)) for _ in range(8)]
    outs = engine.generate(prompts, greedy(6))
    for p, out in zip(prompts, outs):
        assert out.output_ids == reference_continuation(p, 6, VOCAB, True)
    assert max(chunked for chunked, _ in seen) == cap
    assert any(rows > chunked > 0 for chunked, rows in seen)  # prefills beside decodes
    assert_pools_free_after_flush(engine)
