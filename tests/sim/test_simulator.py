"""The simulator: virtual time follows the cost model exactly (checked against timelines worked
out by hand), the real scheduler and cache keep their invariants on it, and the built-in policies
show their defining behaviour on whole traces."""

from __future__ import annotations

import dataclasses
import types

import pytest

from jaxserve.engine.policy import POLICIES, Policy
from jaxserve.sim import workload
from jaxserve.sim.cost import FEATURES, CostModel
from jaxserve.sim.report import SLO, per_tenant, summarize
from jaxserve.sim.simulator import SimConfig, simulate
from jaxserve.sim.trace import TraceRecord

SMALL = SimConfig(num_pages=512, num_slots=32, max_prefill_tokens=256, max_running=8, max_model_len=4096)


def cost(**coef) -> CostModel:
    return CostModel(tuple(coef.get(f, 0.0) for f in FEATURES))


@pytest.mark.parametrize("overlap", [False, True])
def test_single_request_timeline_matches_the_cost_model(overlap):
    """One prefill step of P tokens (c + a*P), then N-1 decode steps of c + a each: TTFT and E2E
    follow, with the step loop synchronous or overlapped (the overlap hides host time, which the
    cost model already contains, so both give the same timeline)."""
    c, a, P, N = 0.01, 0.001, 100, 5
    recs = [TraceRecord(t=0.0, input_len=P, output_len=N), TraceRecord(t=50.0, input_len=P, output_len=N)]
    res = simulate(recs, "fcfs", cost(const=c, tokens=a), SimConfig(**{**SMALL.__dict__, "overlap": overlap}),
                   check_invariants=True)
    for r in res.requests:
        assert r.ttft == pytest.approx(c + a * P)
        assert r.e2e == pytest.approx(c + a * P + (N - 1) * (c + a))
        assert r.tpot == pytest.approx(c + a)
    assert res.duration_s == pytest.approx(50 + res.requests[1].e2e)
    assert res.steps == 2 * N


def test_chunked_prefill_and_padding_buckets():
    """A 600-token prompt under a 256-token budget takes chunks 256, 256, 88; with token buckets
    (32, 128, 256) the last chunk is charged as 128 tokens."""
    m = CostModel(tuple(1.0 if f == "tokens" else 0.0 for f in FEATURES),
                  engine={"token_buckets": [32, 128, 256], "seq_buckets": [1, 2, 4, 8]})
    res = simulate([TraceRecord(t=0, input_len=600, output_len=1)], "fcfs", m, SMALL)
    assert res.requests[0].ttft == pytest.approx(256 + 256 + 128)


def test_invariants_hold_and_everything_finishes_on_a_mixed_trace():
    recs = (workload.agent_sessions(sessions=6, turns=4, rate=2.0, system_len=256, first_len=128, tool_len=64,
                                    output_len=24, seed=1)
            + workload.shared_prompts(40, rate=20.0, groups=3, group_len=192, input_len=40, output_len=16, seed=2))
    res = simulate(recs, "lpm", cost(const=0.005, tokens=1e-5),
                   SimConfig(**{**SMALL.__dict__, "num_pages": 160, "num_slots": 12}), check_invariants=True)
    assert all(r.finish is not None and r.output_tokens == r.output_len for r in res.requests)
    later_turns = [r for r in res.requests if r.session and r.cached_tokens]
    assert later_turns, "multi-turn sessions never hit their own history"


def test_a_request_too_long_is_refused_and_reported():
    recs = [TraceRecord(t=0, input_len=5000, output_len=10), TraceRecord(t=0, input_len=10, output_len=2)]
    res = simulate(recs, "fcfs", cost(const=0.01), SMALL)
    s = summarize(res)
    assert s["rejected"] == 1 and s["completed"] == 1 and "maximum context" in res.requests[0].error


def test_load_scale_compresses_arrivals():
    recs = [TraceRecord(t=float(i), input_len=10, output_len=1) for i in range(5)]
    res = simulate(recs, "fcfs", cost(const=0.01), SMALL, scale=4.0)
    assert [r.arrival for r in res.requests] == [0, 0.25, 0.5, 0.75, 1.0]


def test_summary_percentiles_goodput_and_hit_rate():
    recs = [TraceRecord(t=0, input_len=130, output_len=3, group="g", group_len=129) for _ in range(3)]
    res = simulate(recs, "fcfs", cost(const=0.1), SimConfig(**{**SMALL.__dict__, "max_running": 1}))
    s = summarize(res, SLO(ttft_s=0.25, tpot_s=1.0))
    # one at a time: TTFT 0.1, 0.4, 0.7 s (each runs 3 steps of 0.1 s); the 2nd and 3rd hit 128 tokens
    assert [round(r.ttft, 6) for r in res.requests] == [0.1, 0.4, 0.7]
    assert s["ttft_ms"]["p50"] == pytest.approx(400)
    assert s["slo_attainment"] == pytest.approx(1 / 3) and s["goodput"] == pytest.approx(1 / 0.9)
    assert s["hit_rate"] == pytest.approx(256 / 390)


def test_lpm_beats_fcfs_on_hit_rate_when_snapshots_are_scarce():
    recs = workload.shared_prompts(200, rate=50.0, groups=6, group_len=512, input_len=32, output_len=8,
                                   zipf=0.0, seed=5)
    config = SimConfig(**{**SMALL.__dict__, "num_slots": 10, "max_running": 4})
    rate = {p: summarize(simulate(recs, p, cost(const=0.01, tokens=1e-4), config))["hit_rate"] for p in ("fcfs", "lpm")}
    assert rate["lpm"] > rate["fcfs"] + 0.1, rate


def test_fair_share_bounds_the_noisy_tenant_on_a_trace():
    recs = workload.tenants(300, rate=40.0, noisy_share=0.9, input_len=128, output_len=32, seed=2)
    config = SimConfig(**{**SMALL.__dict__, "max_running": 4})
    m = cost(const=0.01, tokens=1e-4)
    quiet = {p: per_tenant(simulate(recs, p, m, config))["quiet"]["ttft_ms"]["p90"] for p in ("fcfs", "fair")}
    assert quiet["fair"] < quiet["fcfs"] / 3, quiet


def test_priority_class_gets_lower_ttft_under_overload():
    recs = [TraceRecord(t=i * 0.01, input_len=128, output_len=32, priority=0 if i % 5 == 0 else 1) for i in range(150)]
    config = SimConfig(**{**SMALL.__dict__, "max_running": 4})
    res = simulate(recs, "priority", cost(const=0.01, tokens=1e-4), config)
    ttft = {p: sorted(r.ttft for r in res.requests if r.priority == p) for p in (0, 1)}
    assert ttft[0][len(ttft[0]) // 2] * 5 < ttft[1][len(ttft[1]) // 2]
    assert res.preemptions > 0


def test_a_plug_in_policy_object_runs():
    class Newest(Policy):
        name = "newest"

        def order(self, waiting, view):
            return sorted(waiting, key=lambda r: -r.arrival)

    recs = [TraceRecord(t=0, input_len=20, output_len=4) for _ in range(6)]
    res = simulate(recs, Newest(), cost(const=0.01), SimConfig(**{**SMALL.__dict__, "max_running": 1}))
    finish = [r.finish for r in res.requests]
    assert finish == sorted(finish, reverse=True)


@pytest.mark.parametrize("every", [0, 1, 7])
def test_invariant_check_runs_every_n_steps(every, monkeypatch):
    """``check_invariants=N`` (``jaxserve sim --check-invariants N``) checks after every N-th step
    of the engine loop, 0 never; the timeline does not depend on it."""
    from jaxserve.engine.engine import Engine

    calls = []
    check = Engine.check_invariants
    monkeypatch.setattr(Engine, "check_invariants", lambda self: (calls.append(1), check(self)))
    recs = workload.shared_prompts(12, rate=5.0, groups=2, group_len=128, input_len=64, output_len=16)
    res = simulate(recs, "fcfs", cost(const=0.01, tokens=1e-4), SMALL, check_invariants=every)
    base = simulate(recs, "fcfs", cost(const=0.01, tokens=1e-4), SMALL)
    loop_steps = len(res.pressure.t)  # one pressure sample per step of the engine loop
    assert len(calls) == (loop_steps // every if every else 0) and (every == 0 or calls)
    assert [(r.first_token, r.finish) for r in res.requests] == [(r.first_token, r.finish) for r in base.requests]


class FreshPrefixQueries:
    """A built-in policy whose view answers every prefix query with a fresh walk of the cache (the
    reference for the memoized ``SchedulerView``)."""

    def order(self, waiting, view):
        cache = view._s.cache  # the scheduler's own cache: a test may look past the view
        fresh = types.SimpleNamespace(max_prefill_tokens=view.max_prefill_tokens,
                                      prefix_len=lambda r: cache.peek(r.all_cache_ids),
                                      prefix_path=lambda r: cache.peek_path(r.all_cache_ids))
        return super().order(waiting, fresh)


@pytest.mark.parametrize("name", ["lpm", "dfs-weight", "spjf"])
@pytest.mark.parametrize("hybrid", [True, False])
def test_memoized_prefix_queries_give_the_same_schedule(name, hybrid):
    """Multi-turn sessions and shared prompts on scarce pages and slots (evictions, tombstones,
    preemptions): every request's timeline is the one fresh prefix queries give."""
    recs = (workload.agent_sessions(sessions=8, turns=4, rate=4.0, system_len=256, first_len=128, tool_len=64,
                                    output_len=24, seed=3)
            + workload.shared_prompts(80, rate=40.0, groups=5, group_len=192, input_len=40, output_len=16, seed=4))
    config = SimConfig(**{**SMALL.__dict__, "num_pages": 64, "num_slots": 10, "hybrid": hybrid})
    built_in = POLICIES[name]
    reference = type(f"Fresh{built_in.__name__}", (FreshPrefixQueries, built_in), {})()
    m = cost(const=0.005, tokens=1e-5)
    got, want = simulate(recs, name, m, config), simulate(recs, reference, m, config)
    assert want.preemptions > 0 and want.cache["snapshots_evicted" if hybrid else "kv_pages_freed"] > 0
    assert [dataclasses.astuple(r) for r in got.requests] == [dataclasses.astuple(r) for r in want.requests]
    assert (got.steps, got.cache) == (want.steps, want.cache)
