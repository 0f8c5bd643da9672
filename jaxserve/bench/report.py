"""The report: the table on stdout and the figure (matplotlib, imported only for ``--plot``)."""

from __future__ import annotations

from typing import Any

from jaxserve.bench.metrics import STATS


def _num(v: float | None, fmt: str = ".1f") -> str:
    return "n/a" if v is None else format(v, fmt)


def _share(s: dict) -> str:
    v = s["prefix_cache_hit_share"]
    return "n/a" if v is None else f"{v:.1%}"


def render(result: dict[str, Any]) -> str:
    """The human report: one block per run, then a throughput-vs-concurrency table when sweeping."""
    c, runs = result["config"], result["runs"]
    arrivals = "all sent at once" if c["request_rate"] == "inf" else f"Poisson arrivals at {c['request_rate']}/s"
    lines = [f"bench {c['workload']} against {c['url']} (model {c['model']}): {c['num_prompts']} requests per run, "
             f"{c['api']} API, {c['prompt_format']} prompts, {arrivals}, seed {c['seed']}"]
    for run in runs:
        s = run["summary"]
        lines += [f"max concurrency {run['max_concurrency'] or 'unlimited'}: {s['completed']} ok, "
                  f"{s['errors']} errors, {s['duration_s']:.2f} s",
                  f"  throughput   {s['request_throughput']:.2f} req/s, {s['output_throughput']:.1f} output tok/s, "
                  f"{s['total_token_throughput']:.1f} total tok/s",
                  f"  tokens       {s['prompt_tokens']} prompt, {s['output_tokens']} output"
                  + (f" ({s['short_outputs']} requests stopped short)" if s["short_outputs"] else "")
                  + f"; prefix-cache hit share {_share(s)} ({s['cached_tokens']} cached)",
                  f"  {'latency (ms)':<12}" + "".join(f"{k:>10}" for k in STATS)]
        for name, key in (("TTFT", "ttft_ms"), ("TPOT", "tpot_ms"), ("ITL", "itl_ms"), ("E2E", "e2e_ms")):
            lines.append(f"  {name:<12}" + "".join(f"{_num(s[key][k]):>10}" for k in STATS))
        if s["errors"]:
            refused = "ignore_eos" in s["error_sample"]
            hint = " (the server refuses vLLM's ignore_eos: pass --no-ignore-eos)" if refused else ""
            lines.append(f"  errors: {s['errors']}, e.g. {s['error_sample']}{hint}")
    if len(runs) > 1:
        heads = ("conc", "ok", "err", "req/s", "out tok/s", "tot tok/s", "TTFT p50", "TTFT p99", "TPOT p50",
                 "TPOT p99", "E2E p50", "cache hit")
        lines += ["throughput vs concurrency (latencies in ms):", "  " + "".join(f"{h:>10}" for h in heads)]
        for run in runs:
            s = run["summary"]
            cells = (run["max_concurrency"] or "inf", s["completed"], s["errors"], _num(s["request_throughput"], ".2f"),
                     _num(s["output_throughput"]), _num(s["total_token_throughput"]), _num(s["ttft_ms"]["p50"]),
                     _num(s["ttft_ms"]["p99"]), _num(s["tpot_ms"]["p50"]), _num(s["tpot_ms"]["p99"]),
                     _num(s["e2e_ms"]["p50"]), _share(s))
            lines.append("  " + "".join(f"{x:>10}" for x in cells))
    return "\n".join(lines)


def plot(result: dict[str, Any], path: str) -> None:
    """Latency CDFs (TTFT, TPOT, E2E; one line per run) and, when sweeping, output and total
    tokens/s vs concurrency. Agg canvas: no display, no global pyplot state."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    runs = result["runs"]
    sweep = len(runs) > 1
    fig = Figure(figsize=(11, 8) if sweep else (15, 4))
    FigureCanvasAgg(fig)
    axes = list(fig.subplots(2, 2).flat if sweep else fig.subplots(1, 3))
    for ax, key, title in zip(axes, ("ttft_ms", "tpot_ms", "e2e_ms"), ("TTFT", "TPOT", "end-to-end latency")):
        for run in runs:
            xs = sorted(r[key] for r in run["requests"] if r[key] is not None and r["error"] is None)
            if xs:
                ax.step(xs, [(i + 1) / len(xs) for i in range(len(xs))], where="post",
                        label=f"concurrency {run['max_concurrency'] or 'unlimited'}")
        ax.set(xlabel=f"{title} (ms)", ylabel="share of requests", title=f"{title} CDF", ylim=(0, 1.02))
        ax.grid(alpha=0.3)
    if axes[0].get_legend_handles_labels()[0]:
        axes[0].legend(fontsize="small")
    if sweep:
        ax, cs = axes[3], [r["max_concurrency"] for r in runs]
        for key, label in (("output_throughput", "output tok/s"), ("total_token_throughput", "total tok/s")):
            ax.plot(cs, [r["summary"][key] for r in runs], marker="o", label=label)
        ax.set(xlabel="max concurrency", ylabel="tokens/s", title="throughput vs concurrency")
        ax.set_xscale("log", base=2)
        ax.set_xticks(cs, [str(c) for c in cs])
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    fig.suptitle(f"jaxserve bench: {result['config']['workload']} against {result['config']['url']}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
