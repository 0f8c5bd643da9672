"""Measuring the real engine: ``jaxserve sim calibrate`` fits the cost model to its steps, and
``jaxserve sim validate`` replays one trace through the real engine and through the simulator and
compares them request by request.

A step's measured time is the period between the completions of consecutive steps while the
engine is never idle (``TimedExecutor``): with the overlapped loop (the serving default) that is
max(host, device) per step, synchronously their sum, so the fitted model charges what a step costs
the engine as it serves, host work included. Every step program is compiled before measuring
(``compile_all``), so no compile lands in a measurement.

The calibration workload covers the feature space in rounds: for each batch size of the runner's
decode ladder and each prompt length of a ladder up to twice the prefill budget, that many requests of
that length, half of them sharing a prefix with an earlier round (hit restores), each generating
enough tokens for many decode steps. Rounds of more than four full prefill steps are skipped.
Those rounds are mostly decode steps (on the CPU 16 mixed steps of 709), while a TTFT is made of
prefill steps, so prefill rounds follow: at every token bucket, prompts filling it alone (the
one-row program an idle server runs, three times) and two at once (the full-width program), one
output token each, so they add mixed steps and no decode steps.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import random
import sys
import time
from pathlib import Path
from typing import Any

from jaxserve.bench.metrics import percentile
from jaxserve.engine.engine import Engine
from jaxserve.sampling_params import SamplingParams
from jaxserve.sim.cost import CostModel, fit, step_features
from jaxserve.sim.replay import Replay, drive_trace
from jaxserve.sim.simulator import SimConfig, simulate
from jaxserve.sim.trace import load_trace


class TimedExecutor:
    """Wraps an executor; records (features, seconds) of every fetched step (see module docstring)."""

    def __init__(self, inner, desc: dict[str, Any]):
        self.inner = inner
        self._shapes = desc["token_buckets"], desc["seq_buckets"], desc["one_row_programs"]
        self.samples: list[tuple[tuple[float, ...], float]] = []
        self._pending: list[tuple[tuple[float, ...], float]] = []
        self._last_fetch = 0.0

    def dispatch(self, plan):
        t = time.perf_counter()
        handle = self.inner.dispatch(plan)
        self._pending.append((step_features(plan.rows, *self._shapes), t))
        return handle

    def fetch(self, handle):
        out = self.inner.fetch(handle)
        t = time.perf_counter()
        feats, dispatched = self._pending.pop(0)
        self.samples.append((feats, t - max(self._last_fetch, dispatched)))
        self._last_fetch = t
        return out

    def recover(self):
        return self.inner.recover()

    def barrier(self):
        self.inner.barrier()

    def slot_checksum(self, slot):
        return self.inner.slot_checksum(slot)


def engine_description(engine: Engine) -> dict[str, Any]:
    """The configuration the simulator needs to simulate this engine (``SimConfig`` fields + buckets)."""
    s, buckets = engine.scheduler, engine.executor.buckets
    return {"page_size": s.page_size, "num_pages": s.pages.capacity, "num_slots": 0 if s.slots is None else s.slots.capacity,
            "max_prefill_tokens": s.max_prefill_tokens, "max_running": s.max_running,
            "max_model_len": s.max_pages_per_seq * s.page_size, "hybrid": s.hybrid, "snapshot_interval": s.interval,
            "max_snapshots_per_path": s.cache.max_snapshots_per_path, "overlap": engine.overlap,
            "token_buckets": list(buckets.tokens), "seq_buckets": list(buckets.seqs),
            "one_row_programs": buckets.one_row_programs}


def calibration_rounds(engine: Engine, desc: dict[str, Any], seed: int,
                       output_len: int) -> list[tuple[list[list[int]], int]]:
    """Rounds of (prompts, output tokens each) (see the module docstring), within the engine's
    context and pools; ``desc``: its ``engine_description``."""
    s = engine.scheduler
    rng = random.Random(seed)
    vocab_hi = min(engine.vocab_size - 1, 1000)
    room = min(s.max_pages_per_seq, s.pages.capacity // max(1, s.max_running)) * s.page_size - output_len
    lengths, n = [], 32
    while n <= min(2 * s.max_prefill_tokens, room):  # past the budget: chunked prefills too
        lengths.append(n)
        n *= 4
    batches = [b for b in desc["seq_buckets"] if b <= s.max_running]
    shared = [rng.randrange(10, vocab_hi) for _ in range(max(lengths, default=32))]
    rounds = []
    for L in lengths:
        for B in (b for b in batches if b * L <= 4 * s.max_prefill_tokens):  # bounded rounds on slow devices
            prompts = []
            for i in range(B):
                own = [rng.randrange(10, vocab_hi) for _ in range(L)]
                prompts.append(shared[:L // 2] + own[L // 2:] if i % 2 else own)
            rounds.append((prompts, output_len))
    fresh = lambda n: [rng.randrange(10, vocab_hi) for _ in range(n)]  # noqa: E731 - no hits: every token computed
    for T in desc["token_buckets"]:
        n = min(T, room)
        rounds += [([fresh(n)], 1) for _ in range(3)] + ([([fresh(n // 2), fresh(n // 2)], 1)] if n >= 2 else [])
    return rounds


def calibrate(engine: Engine, *, seed: int = 0, output_len: int = 64, device: str = "",
              samples: list | None = None) -> CostModel:
    """Run the calibration rounds on ``engine`` and fit the cost model to its steps. ``samples``, if
    given, receives every measured step as (features, seconds): to refit other models offline
    (``write_samples`` / ``benchmarks/sim_refit.py``)."""
    desc = engine_description(engine)
    inner = engine.executor
    timed = TimedExecutor(inner, desc)
    engine.executor = timed
    try:
        for prompts, max_tokens in calibration_rounds(engine, desc, seed, output_len):
            engine.generate(prompts, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    finally:
        engine.executor = inner
    engine.scheduler.cache.flush()
    if samples is not None:
        samples.extend(timed.samples)
    feats, secs = zip(*timed.samples)
    return fit(feats, secs, engine=desc, device=device)


def write_samples(path: str | Path, samples: list, engine: dict[str, Any], device: str) -> None:
    """The measured steps of a calibration, one ``[features..., seconds]`` row each (``FEATURES``
    order), with the engine they were measured on."""
    from jaxserve.sim.cost import FEATURES, VERSION

    Path(path).write_text(json.dumps({"version": VERSION, "device": device, "features": list(FEATURES), "engine": engine,
                                      "steps": [[*f, s] for f, s in samples]}) + "\n")


def compare(real: list, sim: list) -> dict[str, Any]:
    """Per-request TTFT error, finish order agreement and aggregate errors between two runs of the
    same trace (records in the same order, rids equal)."""
    from scipy.stats import kendalltau

    pairs = [(r, s) for r, s in zip(real, sim) if r.finish is not None and s.finish is not None]
    rel = sorted(abs(s.ttft - r.ttft) / r.ttft for r, s in pairs if r.ttft > 0)
    tau = kendalltau([r.finish for r, _ in pairs], [s.finish for _, s in pairs]).statistic if len(pairs) > 1 else None

    def agg(xs_real, xs_sim, q):
        a, b = percentile(sorted(xs_real), q), percentile(sorted(xs_sim), q)
        return {"real_ms": a * 1000, "sim_ms": b * 1000, "rel_err": (b - a) / a if a else None}

    out: dict[str, Any] = {"requests": len(pairs),
                           "ttft_rel_err": {"p50": percentile(rel, 50), "p90": percentile(rel, 90)} if rel else None,
                           "finish_order_kendall_tau": tau}
    for name in ("ttft", "e2e", "tpot"):
        xr = [getattr(r, name) for r, s in pairs if getattr(r, name) is not None and getattr(s, name) is not None]
        xs = [getattr(s, name) for r, s in pairs if getattr(r, name) is not None and getattr(s, name) is not None]
        if xr:
            out[name] = {"p50": agg(xr, xs, 50), "p99": agg(xr, xs, 99)}
    return out


def validate(engine: Engine, records, cost: CostModel, policy: str = "fcfs",
             details: dict | None = None) -> dict[str, Any]:
    """The trace through the real engine (wall clock, arrivals on time) and through the simulator
    configured as that engine; both start from an empty prefix cache. ``details``, if given,
    receives both runs' request records (``"real"``, ``"sim"``: ``RequestRecord`` fields) and the
    real run's steps timed as calibration times them (``"real_steps"``: features, seconds, and the
    seconds the cost model predicted), so another cost model can be compared with the same real run,
    request by request and step by step, offline (``benchmarks/sim_refit.py``)."""
    engine.scheduler.cache.flush()
    desc = engine_description(engine)
    inner = engine.executor
    timed = TimedExecutor(inner, desc)
    engine.executor = timed
    t0 = time.perf_counter()
    now = lambda: time.perf_counter() - t0  # noqa: E731
    try:
        real = drive_trace(engine, Replay(records), now, lambda t: time.sleep(max(0.0, t - now())))
    finally:
        engine.executor = inner
    real_duration = max(r.finish for r in real if r.finish is not None) - min(r.arrival for r in real)
    config = SimConfig.from_engine(engine_description(engine))
    result = simulate(records, policy, cost, config)
    cmp = compare(real, result.requests)
    if details is not None:
        details["real"] = [dataclasses.asdict(r) for r in real]
        details["sim"] = [dataclasses.asdict(r) for r in result.requests]
        details["real_steps"] = [[*f, s, cost.predict(f)] for f, s in timed.samples]
    cmp["duration"] = {"real_s": real_duration, "sim_s": result.duration_s,
                       "rel_err": (result.duration_s - real_duration) / real_duration}
    return cmp


def _parser(sub: str) -> argparse.ArgumentParser:
    from jaxserve.engine.flags import add_engine_flags

    p = argparse.ArgumentParser(prog=f"jaxserve sim {sub}")
    add_engine_flags(p)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-len", type=int, default=64, help="calibration: tokens per request (decode steps)")
    p.add_argument("--out", required=True, metavar="PATH.json")
    p.add_argument("--samples", default=None, metavar="PATH.json",
                   help="also write the calibration's measured steps (features and seconds), to refit offline")
    if sub == "validate":
        p.add_argument("--trace", required=True, help="trace file or shipped trace name")
        p.add_argument("--cost", default=None, help="cost model (default: calibrate this engine first, in this run)")
    return p


def main(sub: str, argv: list[str]) -> int:
    from jaxserve.engine.flags import engine_args
    from jaxserve.engine.llm import build_engine

    args = _parser(sub).parse_args(argv)
    # the serving configuration: every program compiled before any measurement, no debug hooks
    args.command, args.debug_snapshot_checksums = "serve", False
    eargs = engine_args(args, progress=True)
    records = load_trace(args.trace) if sub == "validate" else None
    engine = build_engine(eargs)
    import jax

    device = f"{jax.devices()[0].device_kind} ({platform.node()}), model {Path(eargs.model).name}, {eargs.dtype}"
    if sub == "calibrate" or args.cost is None:
        t0 = time.perf_counter()
        samples: list = []
        cost = calibrate(engine, seed=args.seed, output_len=args.output_len, device=device, samples=samples)
        if args.samples:
            write_samples(args.samples, samples, engine_description(engine), device)
        print(f"jaxserve: calibrated on {cost.fit_stats['steps']} steps in {time.perf_counter() - t0:.0f} s: "
              f"median step error {cost.fit_stats['median_rel_err']:.1%}, p90 {cost.fit_stats['p90_rel_err']:.1%}",
              file=sys.stderr)
    else:
        cost = CostModel.load(args.cost)
    if sub == "calibrate":
        cost.save(args.out)
        print(f"jaxserve: wrote {args.out}", file=sys.stderr)
        return 0
    details: dict = {}
    result = {"trace": args.trace, "policy": eargs.policy, "device": device, "cost_model": cost.to_json(),
              "comparison": validate(engine, records, cost, eargs.policy, details)}
    result["requests"] = details
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result["comparison"], indent=1))
    return 0
