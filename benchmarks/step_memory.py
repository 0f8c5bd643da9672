"""XLA's memory analysis of every serving step program of a model, without its weights (CPU or GPU).

Compiles the step programs ``jaxserve serve`` would compile (``Buckets.programs()``: the mixed /
prefill token buckets up to ``--max-prefill``, the decode row buckets up to ``--max-seqs``) exactly
as start-up does (``runner.lower_step`` -> ``.compile()``, ``startup.step_memory``), against
``jax.ShapeDtypeStruct`` params (``params.abstract_params``) and pools, so a real-size model needs
no memory for its weights. For each program it reports XLA's temporaries (``temp_size_in_bytes``),
the step's need beside params and pools (what ``plan_memory`` reserves for) and the compile seconds.

Which intermediates a program has (and which are huge) is the same on the CPU as on the GPU for the
jnp paths (``--kernels jnp``, the CPU default); how XLA schedules them, so what is live at once, may
differ. The Mosaic GPU kernels compile only on a GPU. ``--layers N`` keeps the first N layers of the
config (real widths; 4 = 3 GDN + 1 attention for the 3 : 1 hybrids; 0 = all): on 2 CPU cores a
4-layer program compiles in ~4 s, a 24-layer one in ~10-15 s. Temporaries that differ between the
two are some layer's work live beside another's.

``--buffers K`` also dumps the compiled modules (``XLA_FLAGS=--xla_dump_to``) and prints the K largest
buffers of XLA's memory-usage report of the program with the most temporaries, each with the shapes
of the HLO values that live in it (what dominates; ``--tokens 8192 --kinds prefill`` to dump only
that program). Results: benchmarks/RESULTS.md "Step memory (CPU compile analysis)".

    python benchmarks/step_memory.py --layers 0 --buffers 12 --label after --json benchmarks/results/step-memory-cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULT_CONFIG = REPO / "benchmarks" / "configs" / "qwen3_5_moe-6b.json"
GiB, MiB = 1 << 30, 1 << 20


def _fmt(n: int) -> str:
    return f"{n / GiB:.2f} GiB" if n >= GiB else f"{n / MiB:.1f} MiB"


def model_config(path: Path, layers: int | None, kernels: str):
    from jaxserve.config import ModelConfig

    raw = json.loads(Path(path).read_text())
    if layers is not None:
        raw = {**raw, "num_hidden_layers": layers, "layer_types": raw["layer_types"][:layers]}
    cfg = ModelConfig.from_hf(raw, source=str(path))
    import dataclasses
    return dataclasses.replace(cfg, kernels=kernels)


def reports(dump_dir: Path) -> set[Path]:
    """XLA's memory-usage reports of the step modules dumped so far."""
    return set(dump_dir.glob("*_step*memory-usage-report.txt"))


def largest_buffers(report: Path, k: int) -> list[dict]:
    """The ``k`` largest rows of one XLA memory-usage report: each a buffer (offset range) of the
    program's memory and the shapes of the HLO values that live in it over the program."""
    rows = []
    for line in report.read_text().splitlines():
        m = re.match(r"\s*[\d.]+[GMK]?i?B\(\s*\d+%\);\s*([\d.]+)([GMK]i)?B;\s*(\d+);\s*(\d+);\s*(.*)", line)
        if m:
            scale = {"Gi": GiB, "Mi": MiB, "Ki": 1024, None: 1}[m.group(2)]
            rows.append({"bytes": int(float(m.group(1)) * scale), "offset": int(m.group(3)),
                         "values": int(m.group(4)), "shapes": m.group(5)})
        elif rows and "The rest" in line:
            break
    return rows[:k]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default=str(DEFAULT_CONFIG), help="a Hugging Face config.json")
    ap.add_argument("--layers", type=int, default=4, help="keep the first N layers (default 4); 0 = all")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--kernels", default="jnp", help="ModelConfig.kernels (the Pallas kernels compile only on a GPU)")
    ap.add_argument("--max-prefill", type=int, default=8192, help="largest token bucket (serve's --max-prefill-length)")
    ap.add_argument("--max-seqs", type=int, default=32, help="serve's --max-running-requests")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--max-model-len", type=int, default=None, help="default: the config's max_position_embeddings")
    ap.add_argument("--kv-tokens", type=int, default=262144, help="KV pool size in tokens (an argument: no memory)")
    ap.add_argument("--slots", type=int, default=None, help="linear-state slots (default 2 * max_seqs + 1)")
    ap.add_argument("--tokens", default=None, help="only these token buckets, comma-separated (default all)")
    ap.add_argument("--kinds", default="prefill,decode", help="prefill (mixed) and/or decode programs")
    ap.add_argument("--layout", choices=("stacked", "list"), default="stacked",
                    help="params layout: stacked (the engine's; the repeating layers run as one scan) or list")
    ap.add_argument("--buffers", type=int, default=0, help="print the K largest allocations of the largest program")
    ap.add_argument("--label", default="", help="a name for this run in the JSON (e.g. before / after)")
    ap.add_argument("--note", default="", help="a line saying what code this run measured")
    ap.add_argument("--json", default=None, help="write (or merge into, keyed by --label) this JSON file")
    args = ap.parse_args()

    dump = None
    if args.buffers:
        dump = Path(tempfile.mkdtemp(prefix="step-memory-hlo-"))
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                                   f" --xla_dump_to={dump} --xla_dump_hlo_as_text --xla_dump_hlo_module_re=.*_step.*"
                                   " --xla_dump_hlo_pass_re=^$")

    sys.path.insert(0, str(REPO))
    import jax
    import jax.numpy as jnp

    from jaxserve.engine import runner, startup
    from jaxserve.engine.pools import plan_pools
    from jaxserve.models.params import abstract_params

    cfg = model_config(Path(args.config), args.layers or None, args.kernels)
    dtype = jnp.dtype(args.dtype)
    max_len = min(args.max_model_len or cfg.max_position_embeddings, cfg.max_position_embeddings)
    buckets = runner.Buckets.for_limits(max_prefill_tokens=args.max_prefill, max_seqs=args.max_seqs,
                                        max_model_len=max_len, page_size=args.page_size)
    slots = args.slots or 2 * args.max_seqs + 1
    plan = plan_pools(cfg, dtype, page_size=args.page_size, max_seqs=args.max_seqs,
                      num_pages=args.kv_tokens // args.page_size + 1, num_slots=slots)
    pools = startup.pool_structs(cfg, dtype, plan)
    params = abstract_params(cfg, dtype)
    if args.layout == "stacked":  # as the engine loads a model (jaxserve.models.decoder's module doc)
        from jaxserve.models import decoder
        params = decoder.stack_layers(cfg, params, decoder.stack_structs)
    compiler = startup.StepCompiler(params, cfg, buckets)

    kinds = set(args.kinds.split(","))
    only = None if args.tokens is None else {int(t) for t in args.tokens.split(",")}
    programs = [p for p in buckets.programs()
                if (("decode" in kinds) if p[3] else ("prefill" in kinds)) and (only is None or p[0] in only)]
    print(f"{cfg.model_type}: {cfg.num_layers} layers ({', '.join(sorted(set(cfg.layer_types)))}), hidden "
          f"{cfg.hidden_size}, vocab {cfg.vocab_size}, {dtype.name}, kernels={cfg.kernels}, {jax.default_backend()}; "
          f"params {_fmt(compiler.param_bytes)}, pools {plan.describe()}; page table width "
          f"{buckets.pages_per_seq}; {len(programs)} programs", flush=True)
    rows, dumped = [], {}
    for i, program in enumerate(programs, 1):
        before = reports(dump) if dump else set()
        T, B, S, decode = program
        t0 = time.perf_counter()
        lowered = runner.lower_step(compiler.params, cfg, pools, buckets, program)
        t1 = time.perf_counter()
        compiled = lowered.compile()
        t2 = time.perf_counter()
        stats = compiled.memory_analysis()
        mem = startup.step_memory(compiled, program, compiler.param_bytes, plan.total_bytes, t2 - t0)
        row = {"T": T, "B": B, "S": S, "decode": decode, "temp_bytes": mem.temp_bytes, "need_bytes": mem.need_bytes,
               "output_bytes": int(stats.output_size_in_bytes), "alias_bytes": int(stats.alias_size_in_bytes),
               "argument_bytes": int(stats.argument_size_in_bytes), "lower_s": round(t1 - t0, 2),
               "compile_s": round(t2 - t1, 2)}
        rows.append(row)
        if dump:
            dumped[program] = sorted(reports(dump) - before)
        kind = f"decode B={B:<4}" if decode else f"prefill T={T:<5} B={B:<3}"
        print(f"[{i}/{len(programs)}] {kind} S={S:<4} temp {_fmt(mem.temp_bytes):>11}  need {_fmt(mem.need_bytes):>11}"
              f"  lower {t1 - t0:5.1f}s compile {t2 - t1:6.1f}s", flush=True)

    result = {"config": {"source": str(Path(args.config).relative_to(REPO)) if Path(args.config).is_relative_to(REPO)
                         else args.config, "model_type": cfg.model_type, "layers": cfg.num_layers,
                         "layer_types": list(cfg.layer_types), "dtype": dtype.name, "kernels": cfg.kernels,
                         "backend": jax.default_backend(), "jax": jax.__version__, "max_prefill": args.max_prefill,
                         "max_seqs": args.max_seqs, "page_size": args.page_size, "max_model_len": max_len,
                         "pages_per_seq": buckets.pages_per_seq, "num_pages": plan.num_pages,
                         "num_slots": plan.num_slots,
                         "param_bytes": compiler.param_bytes, "pool_bytes": plan.total_bytes},
              "date": time.strftime("%Y-%m-%d"), "note": args.note, "programs": rows}
    if dump is not None and rows:
        worst = max(rows, key=lambda r: r["temp_bytes"])
        program = (worst["T"], worst["B"], worst["S"], worst["decode"])
        top = largest_buffers(dumped[program][-1], args.buffers) if dumped.get(program) else []
        result["largest_buffers"] = {"program": list(program), "buffers": top}
        print(f"largest buffers of the program with the most temporaries, {program} (XLA memory-usage report, "
              f"{dump}):")
        for b in top:
            print(f"  {_fmt(b['bytes']):>11}  {b['shapes'][:160]}")
    if args.json:
        path = Path(args.json)
        out = json.loads(path.read_text()) if path.exists() else {}
        out[args.label or "run"] = result
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(out, indent=1) + "\n")
        print(f"wrote {path} [{args.label or 'run'}]")


if __name__ == "__main__":
    main()
