"""``jaxserve sim``: scheduling research on a virtual clock.

    jaxserve sim --trace T [--policy P] [--cost C] [--load X] [pool flags] [--json F] [--plot F.png]
    jaxserve sim sweep --trace T --policies fcfs,lpm --loads 0.5,1,2 [--pools PAGES:SLOTS,...] --out DIR
    jaxserve sim gen WORKLOAD [--n N] [--rate R] [--seed S] --out trace.jsonl
    jaxserve sim calibrate [--model DIR] --out cost.json [engine flags]     (runs the real engine)
    jaxserve sim validate --trace T [--model DIR] [--cost C] --out result.json (real engine vs simulator)

``--trace`` is a JSONL / Mooncake / BurstGPT file or the name of a shipped trace; ``--workload``
generates one instead. ``--cost`` is a cost-model JSON from ``calibrate`` (default: the shipped
``cpu-default``, measured on the default model on a CPU); the simulated engine takes the
calibrated engine's configuration unless a pool flag overrides it.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from jaxserve.engine.policy import POLICIES, make_policy
from jaxserve.sim.cost import CostModel
from jaxserve.sim.report import SLO, per_tenant, plot_run, plot_sweep, render, request_rows, summarize
from jaxserve.sim.simulator import SimConfig, simulate
from jaxserve.sim.trace import load_trace, write_trace
from jaxserve.sim.workload import WORKLOADS

POLICY_HELP = (f"scheduling policy: {', '.join(POLICIES)}, or package.module:ClassName "
               f"(a jaxserve.engine.policy.Policy subclass)")


def _positive_floats(text: str) -> list[float]:
    try:
        xs = [float(x) for x in text.split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None
    if not xs or any(x <= 0 for x in xs):
        raise argparse.ArgumentTypeError(f"expected positive numbers, got {text!r}")
    return xs


def _pools(text: str) -> list[tuple[int, int]]:
    try:
        out = [tuple(int(v) for v in p.split(":")) for p in text.split(",") if p]
    except ValueError:
        out = []
    if not out or any(len(p) != 2 or min(p) < 1 for p in out):
        raise argparse.ArgumentTypeError(f"expected PAGES:SLOTS[,PAGES:SLOTS...], got {text!r}")
    return out


def _add_source(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--trace", help="trace file (JSONL, Mooncake JSONL, BurstGPT CSV) or a shipped trace's name")
    src.add_argument("--workload", choices=sorted(WORKLOADS), help="generate the trace instead (--n, --rate, --seed)")
    p.add_argument("--n", type=int, default=None, help="--workload: requests (sessions for agent-sessions)")
    p.add_argument("--rate", type=float, default=None, help="--workload: arrivals per second")
    p.add_argument("--seed", type=int, default=0)


def _add_sim_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cost", default="cpu-default", help="cost-model JSON from `jaxserve sim calibrate` or a shipped "
                                                         "one's name (default: cpu-default)")
    p.add_argument("--num-pages", type=int, default=None, help="usable KV pages (default: the cost model's engine)")
    p.add_argument("--num-slots", type=int, default=None, help="usable linear-state slots")
    p.add_argument("--max-running", type=int, default=None, help="max running requests")
    p.add_argument("--max-prefill-tokens", type=int, default=None, help="tokens per step")
    p.add_argument("--page-size", type=int, default=None)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-snapshots-per-path", type=int, default=None)
    p.add_argument("--snapshot-interval", type=int, default=None,
                   help="tokens between a request's linear-state snapshots, a multiple of 64 (default: the cost "
                        "model's engine)")
    p.add_argument("--no-overlap", action="store_true", help="simulate the synchronous step loop")
    p.add_argument("--check-invariants", type=int, default=0, metavar="N",
                   help="run the engine's leak and cache invariant check every N steps (default 0: never; "
                        "it walks every page, slot and tree node)")
    p.add_argument("--slo-ttft-ms", type=float, default=2000.0, help="goodput SLO on TTFT (default: 2000)")
    p.add_argument("--slo-tpot-ms", type=float, default=100.0, help="goodput SLO on TPOT (default: 100)")


def build_parsers() -> dict[str, argparse.ArgumentParser]:
    run = argparse.ArgumentParser(prog="jaxserve sim", description=__doc__.split("\n\n")[0])
    _add_source(run)
    run.add_argument("--policy", default="fcfs", help=POLICY_HELP)
    run.add_argument("--load", type=float, default=1.0, help="multiply the trace's arrival rate (default: 1)")
    _add_sim_flags(run)
    run.add_argument("--json", default=None, metavar="PATH", help="write summary, per-tenant and per-request rows")
    run.add_argument("--plot", default=None, metavar="PATH.png", help="latency CDFs, queue and pool occupancy")
    sweep = argparse.ArgumentParser(prog="jaxserve sim sweep", description="policies x loads x pool sizes")
    _add_source(sweep)
    sweep.add_argument("--policies", default="fcfs,lpm", help="comma-separated policies (default: fcfs,lpm)")
    sweep.add_argument("--loads", type=_positive_floats, default=[1.0], help="comma-separated rate multipliers")
    sweep.add_argument("--pools", type=_pools, default=None, metavar="PAGES:SLOTS,...",
                       help="pool sizes to compare (default: the cost model's)")
    _add_sim_flags(sweep)
    sweep.add_argument("--out", required=True, metavar="DIR", help="writes sweep.json, sweep.md and sweep.png")
    gen = argparse.ArgumentParser(prog="jaxserve sim gen", description="write a generated workload as a JSONL trace")
    gen.add_argument("workload", choices=sorted(WORKLOADS))
    gen.add_argument("--n", type=int, default=None)
    gen.add_argument("--rate", type=float, default=None)
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--out", required=True)
    return {"run": run, "sweep": sweep, "gen": gen}


def _records(args) -> tuple[list, str]:
    if args.trace:
        return load_trace(args.trace), args.trace
    return _generate(args), f"{args.workload} (seed {args.seed})"


def _generate(args) -> list:
    kw: dict[str, Any] = {"seed": args.seed}
    if args.rate is not None:
        kw["rate"] = args.rate
    if args.n is not None:
        kw["sessions" if args.workload == "agent-sessions" else "n"] = args.n
    return WORKLOADS[args.workload](**kw)


def _setup(args) -> tuple[CostModel, SimConfig, SLO]:
    cost = CostModel.load(args.cost)
    config = SimConfig.from_engine(cost.engine, num_pages=args.num_pages, num_slots=args.num_slots,
                                   max_running=args.max_running, max_prefill_tokens=args.max_prefill_tokens,
                                   page_size=args.page_size, max_model_len=args.max_model_len,
                                   max_snapshots_per_path=args.max_snapshots_per_path,
                                   snapshot_interval=args.snapshot_interval,
                                   overlap=False if args.no_overlap else None)
    return cost, config, SLO(args.slo_ttft_ms / 1000, args.slo_tpot_ms / 1000)


def run(args) -> int:
    make_policy(args.policy)  # a bad name fails before anything is read
    records, name = _records(args)
    cost, config, slo = _setup(args)
    result = simulate(records, args.policy, cost, config, scale=args.load, check_invariants=args.check_invariants)
    summary = summarize(result, slo)
    title = f"sim {name}: policy {args.policy}, load x{args.load}, {config.num_pages} pages, {config.num_slots} slots"
    print(render(summary, title))
    if args.json:
        doc = {"trace": name, "policy": args.policy, "load": args.load, "config": config.__dict__,
               "cost_model": cost.to_json(), "summary": summary, "tenants": per_tenant(result),
               "requests": request_rows(result)}
        Path(args.json).write_text(json.dumps(doc, indent=1) + "\n")
    if args.plot:
        plot_run(result, args.plot, title)
    return 0


def sweep(args) -> int:
    policies = [p for p in args.policies.split(",") if p]
    for p in policies:
        make_policy(p)
    records, name = _records(args)
    cost, base, slo = _setup(args)
    pools = args.pools or [(base.num_pages, base.num_slots)]
    rows = []
    for pages, slots in pools:
        config = SimConfig(**{**base.__dict__, "num_pages": pages, "num_slots": slots})
        for load in args.loads:
            for policy in policies:
                s = summarize(simulate(records, policy, cost, config, scale=load,
                                       check_invariants=args.check_invariants), slo)
                rows.append({"policy": policy, "load": load, "num_pages": pages, "num_slots": slots,
                             "ttft_p50_ms": s["ttft_ms"]["p50"], "ttft_p99_ms": s["ttft_ms"]["p99"],
                             "tpot_p50_ms": s["tpot_ms"]["p50"], "e2e_p99_ms": s["e2e_ms"]["p99"],
                             "goodput": s["goodput"], "output_throughput": s["output_throughput"],
                             "hit_rate": s["hit_rate"], "preemptions": s["preemptions"],
                             "refused": s["rejected"], "sim_wall_s": s["sim_wall_s"]})
                r = rows[-1]
                print(f"{policy:>12} load x{load:<5} {pages:>6}p {slots:>5}s  p99 TTFT {r['ttft_p99_ms']:.0f} ms  "
                      f"goodput {r['goodput']:.2f}/s  hit {100 * (r['hit_rate'] or 0):.1f} %", file=sys.stderr)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "sweep.json").write_text(json.dumps({"trace": name, "cost_model": cost.to_json(), "slo": slo.__dict__,
                                                "rows": rows}, indent=1) + "\n")
    table = sweep_table(rows)
    (out / "sweep.md").write_text(f"# sweep of {name}\n\n{table}\n")
    print(table)
    try:
        plot_sweep(rows, str(out / "sweep.png"), f"sweep of {name}")
    except ValueError as e:  # no matplotlib: the table and JSON are still written
        print(f"jaxserve: {e}", file=sys.stderr)
    return 0


def sweep_table(rows: list[dict[str, Any]]) -> str:
    cols = ("policy", "load", "num_pages", "num_slots", "ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "goodput",
            "hit_rate", "preemptions")
    fmt = lambda v: "n/a" if v is None else (f"{v:.3g}" if isinstance(v, float) else str(v))  # noqa: E731
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(fmt(r[c]) for c in cols) + " |" for r in rows]
    return "\n".join(lines)


def gen(args) -> int:
    records = _generate(args)
    write_trace(records, args.out)
    print(f"wrote {len(records)} records to {args.out}")
    return 0


def main(argv: list[str]) -> int:
    """Entry point for ``jaxserve sim ...``; user errors print one line and return 2."""
    from jaxserve.sim.cost import CostModelError
    from jaxserve.sim.trace import TraceError

    sub = argv[0] if argv and argv[0] in ("sweep", "gen", "calibrate", "validate") else "run"
    rest = argv[1:] if sub != "run" else argv
    try:
        if sub in ("calibrate", "validate"):
            from jaxserve.sim import calibrate

            return calibrate.main(sub, rest)
        args = build_parsers()[sub].parse_args(rest)
        if getattr(args, "n", None) is not None and args.n < 1 or getattr(args, "rate", None) is not None and args.rate <= 0:
            raise ValueError("--n must be >= 1 and --rate > 0")
        if getattr(args, "check_invariants", 0) < 0:
            raise ValueError("--check-invariants must be >= 0")
        return {"run": run, "sweep": sweep, "gen": gen}[sub](args)
    except (TraceError, CostModelError, ValueError, OSError) as e:
        print(f"jaxserve: error: {e}", file=sys.stderr)
        return 2
