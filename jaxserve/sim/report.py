"""What a simulation run reports: the summary (percentiles, goodput under SLOs, throughput, cache
and pool pressure), the JSON document, the text table and the PNG figures (matplotlib, imported
only when a plot is asked for)."""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

from jaxserve.bench.metrics import describe
from jaxserve.sim.replay import RequestRecord
from jaxserve.sim.simulator import SimResult


@dataclasses.dataclass(frozen=True)
class SLO:
    """A request meets the SLO when its TTFT and its TPOT (if it has one) are within these."""

    ttft_s: float = 2.0
    tpot_s: float = 0.1

    def met(self, r: RequestRecord) -> bool:
        return (r.finish is not None and r.ttft <= self.ttft_s
                and (r.tpot is None or r.tpot <= self.tpot_s))


def summarize(result: SimResult, slo: SLO = SLO()) -> dict[str, Any]:
    done = [r for r in result.requests if r.finish is not None]
    dur = result.duration_s
    per_s = lambda x: x / dur if dur > 0 else 0.0  # noqa: E731
    ms = lambda xs: describe([x * 1000 for x in xs if x is not None])  # noqa: E731
    prompt = sum(r.prompt_len for r in done)
    output = sum(r.output_tokens for r in done)
    good = sum(slo.met(r) for r in done)
    cache = result.cache
    return {
        "requests": len(result.requests), "completed": len(done),
        "rejected": sum(r.error is not None for r in result.requests),
        "duration_s": dur, "steps": result.steps, "device_busy_share": result.busy_s / dur if dur > 0 else 0.0,
        "request_throughput": per_s(len(done)), "output_throughput": per_s(output),
        "total_token_throughput": per_s(prompt + output),
        "ttft_ms": ms([r.ttft for r in done]), "tpot_ms": ms([r.tpot for r in done]), "e2e_ms": ms([r.e2e for r in done]),
        "slo": dataclasses.asdict(slo), "goodput": per_s(good), "slo_attainment": good / len(done) if done else None,
        "prompt_tokens": prompt, "cached_tokens": sum(r.cached_tokens for r in done),
        "hit_rate": sum(r.cached_tokens for r in done) / prompt if prompt else None,
        "preemptions": result.preemptions, "preempted_requests": sum(r.preemptions > 0 for r in done),
        "snapshots_written": result.snapshots_written, "snapshots_evicted": cache.get("snapshots_evicted", 0), "kv_pages_freed_by_eviction": cache.get("kv_pages_freed", 0),
        "pressure": result.pressure.summary(), "sim_wall_s": result.wall_s,
    }


def per_tenant(result: SimResult) -> dict[str, dict[str, Any]]:
    """TTFT and E2E per tenant (only when the trace names tenants)."""
    tenants = sorted({r.tenant for r in result.requests})
    if tenants == [""]:
        return {}
    out = {}
    for t in tenants:
        done = [r for r in result.requests if r.tenant == t and r.finish is not None]
        out[t or "(none)"] = {"completed": len(done), "ttft_ms": describe([r.ttft * 1000 for r in done]),
                              "e2e_ms": describe([r.e2e * 1000 for r in done])}
    return out


def request_rows(result: SimResult) -> list[dict[str, Any]]:
    return [{"rid": r.rid, "arrival_s": r.arrival, "prompt_len": r.prompt_len, "output_len": r.output_len,
             "tenant": r.tenant, "priority": r.priority, "session": r.session, "ttft_s": r.ttft, "tpot_s": r.tpot,
             "e2e_s": r.e2e, "finish_s": r.finish, "cached_tokens": r.cached_tokens, "preemptions": r.preemptions,
             "error": r.error} for r in result.requests]


def _fmt(v, spec=".1f") -> str:
    return "n/a" if v is None else format(v, spec)


def render(summary: dict[str, Any], title: str) -> str:
    s = summary
    p = s["pressure"]
    lines = [title,
             f"  requests     {s['completed']}/{s['requests']} completed ({s['rejected']} refused), "
             f"{s['duration_s']:.1f} virtual s, {s['steps']} steps, device busy {s['device_busy_share']:.0%}; "
             f"simulated in {s['sim_wall_s']:.1f} s",
             f"  throughput   {s['request_throughput']:.2f} req/s, {s['output_throughput']:.0f} output tok/s, "
             f"{s['total_token_throughput']:.0f} total tok/s",
             f"  goodput      {s['goodput']:.2f} req/s within TTFT <= {s['slo']['ttft_s']} s and TPOT <= "
             f"{s['slo']['tpot_s']} s ({_fmt(s['slo_attainment'] and s['slo_attainment'] * 100)} % of requests)"]
    for key, name in (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("e2e_ms", "E2E")):
        d = s[key]
        lines.append(f"  {name:<12} mean {_fmt(d['mean'])}  p50 {_fmt(d['p50'])}  p90 {_fmt(d['p90'])}  "
                     f"p99 {_fmt(d['p99'])} ms")
    lines.append(f"  cache        hit rate {_fmt(s['hit_rate'] and s['hit_rate'] * 100)} % of prompt tokens; "
                 f"{s['snapshots_written']} snapshots written, {s['snapshots_evicted']} evicted; {s['preemptions']} preemptions")
    if p:
        lines.append(f"  pools        pages used {p['pages_used']['mean']:.0%} (max {p['pages_used']['max']:.0%}), "
                     f"slots used {p['slots_used']['mean']:.0%} (max {p['slots_used']['max']:.0%}), "
                     f"snapshots hold {p['tree_slots']['mean']:.0%} of slots; queue {p['waiting']['mean']:.1f} "
                     f"(max {p['waiting']['max']})")
    return "\n".join(lines)


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ValueError("plots need matplotlib (pip install matplotlib); run without --plot meanwhile") from None
    return plt


def _cdf(ax, values: Sequence[float], label: str) -> None:
    xs = sorted(values)
    if xs:
        ax.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], label=label)


def plot_run(result: SimResult, path: str, title: str) -> None:
    """Four panels: TTFT and E2E CDFs, queue and running over time, pool occupancy over time."""
    plt = _pyplot()
    done = [r for r in result.requests if r.finish is not None]
    fig, axes = plt.subplots(2, 2, figsize=(11, 7.5))
    (a, b), (c, d) = axes
    for ax, key, name in ((a, "ttft", "TTFT"), (b, "e2e", "E2E latency")):
        _cdf(ax, [getattr(r, key) * 1000 for r in done], name)
        ax.set_xscale("log")
        ax.set_xlabel(f"{name} (ms)")
        ax.set_ylabel("share of requests")
        ax.grid(alpha=0.3)
    pr = result.pressure
    step = max(1, len(pr.t) // 4000)
    t = pr.t[::step]
    c.plot(t, pr.waiting[::step], label="waiting")
    c.plot(t, pr.running[::step], label="running")
    c.set_xlabel("virtual time (s)")
    c.set_ylabel("requests")
    c.legend()
    c.grid(alpha=0.3)
    for name in ("pages_used", "tree_pages", "slots_used", "tree_slots"):
        d.plot(t, getattr(pr, name)[::step], label=name.replace("_", " "))
    d.set_ylim(0, 1.05)
    d.set_xlabel("virtual time (s)")
    d.set_ylabel("share of pool")
    d.legend(fontsize=8)
    d.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_sweep(rows: list[dict[str, Any]], path: str, title: str) -> None:
    """p99 TTFT and goodput against load, one line per policy, one column per pool size."""
    plt = _pyplot()
    pools = sorted({(r["num_pages"], r["num_slots"]) for r in rows})
    policies = sorted({r["policy"] for r in rows})
    fig, axes = plt.subplots(2, len(pools), figsize=(4.5 * len(pools), 7), squeeze=False)
    for j, pool in enumerate(pools):
        for pol in policies:
            pts = sorted((r["load"], r) for r in rows if r["policy"] == pol and (r["num_pages"], r["num_slots"]) == pool)
            loads = [x for x, _ in pts]
            axes[0][j].plot(loads, [r["ttft_p99_ms"] for _, r in pts], marker="o", label=pol)
            axes[1][j].plot(loads, [r["goodput"] for _, r in pts], marker="o", label=pol)
        axes[0][j].set_title(f"{pool[0]} pages, {pool[1]} slots")
        axes[0][j].set_yscale("log")
        axes[0][j].set_ylabel("p99 TTFT (ms)")
        axes[1][j].set_ylabel("goodput (req/s)")
        for ax in (axes[0][j], axes[1][j]):
            ax.set_xlabel("load (x trace rate)")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
