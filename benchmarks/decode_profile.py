"""Where a decode step's time goes, in-process (no HTTP): the engine on a real-size checkpoint,
decode tok/s at batch 1 and 32 with the step loop synchronous and overlapped, and the per-kernel
GPU time of one decode step (CUPTI, ``jaxserve/profiling.py``). Device-only.

    python benchmarks/decode_profile.py --ckpt runs/e2e-ck --out $OUT/decode.json [--kernels auto]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def log(msg: str) -> None:
    print(f"[decode {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def decode_rate(engine, batch: int, prompt_len: int, new: int, seed: int) -> dict:
    """Serve ``batch`` random prompts together; tok/s over the steps after every prompt is prefilled."""
    from jaxserve.generate import SamplingParams

    rng = random.Random(seed)
    sp = SamplingParams(max_tokens=new, ignore_eos=True)
    for _ in range(batch):
        engine.add_request([rng.randrange(1000, 150000) for _ in range(prompt_len)], sp)
    stamps, produced = [], []
    while engine.has_work():
        outs = engine.step()
        stamps.append(time.perf_counter())
        produced.append(sum(len(o.new_ids) for o in outs))
    # steady state: from the step where every request has its first token to the end
    firsts, seen = 0, 0
    for i, n in enumerate(produced):
        seen += n
        if seen >= batch:
            firsts = i
            break
    toks = sum(produced[firsts + 1:])
    dt = stamps[-1] - stamps[firsts]
    return {"batch": batch, "tok_s": round(toks / dt, 1), "step_ms": round(dt / max(1, len(stamps) - firsts - 1) * 1e3, 3),
            "steps": len(stamps)}


def kernel_breakdown(engine, batch: int, prompt_len: int, seed: int) -> dict | None:
    from jaxserve import profiling
    from jaxserve.generate import SamplingParams

    rng = random.Random(seed)
    for _ in range(batch):
        engine.add_request([rng.randrange(1000, 150000) for _ in range(prompt_len)],
                           SamplingParams(max_tokens=40, ignore_eos=True))
    overlap, engine.overlap = engine.overlap, False
    while any(r.num_pending > 1 or not r.output_ids for r in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()
    for _ in range(3):
        engine.step()

    def run():
        engine.step()
        engine.executor.barrier()

    per = profiling.kernel_timings(run, 5)
    engine.overlap = overlap
    while engine.has_work():
        engine.step()
    return profiling.summarize(per, top=12) if per else None


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ckpt", type=Path, default=ROOT / "runs/e2e-ck")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--kernels", default="auto")
    ap.add_argument("--batches", default="1,32")
    args = ap.parse_args()
    from jaxserve.engine.llm import EngineArgs, build_engine

    t0 = time.time()
    engine = build_engine(EngineArgs(model=str(args.ckpt), dtype="bfloat16", max_running_requests=32,
                                     max_prefill_length=4096, num_pages=4096, num_slots=96, kernels=args.kernels))
    log(f"built in {time.time() - t0:.0f}s")
    res = {"kernels": args.kernels, "rows": []}
    for b in map(int, args.batches.split(",")):
        for overlap in (False, True):
            engine.overlap = overlap
            decode_rate(engine, b, 512, 8, seed=b)  # compiles this batch's programs
            t0 = time.time()
            row = {"overlap": overlap, **decode_rate(engine, b, 512, 128, seed=100 + b)}
            row["wall_s"] = round(time.time() - t0, 1)
            res["rows"].append(row)
            log(json.dumps(row))
            engine.scheduler.cache.flush()
        bd = kernel_breakdown(engine, b, 512, seed=200 + b)
        res[f"kernels_b{b}"] = bd
        log(f"b={b} kernels: {json.dumps(bd)[:1500]}")
        engine.scheduler.cache.flush()
        args.out.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
