"""Check the program store (jaxserve/engine/program_store.py) on this machine's device: three
processes build the same engine (every program compiled ahead of time) and greedy-decode the same
prompts, each timing its build:

  fresh     empty compile cache and store: XLA compiles every program; the store saves them
  cached    the compile cache kept, the store emptied: JAX's persistent cache serves every
            program; the store saves those only where the platform re-serializes them whole
            (``program_store.RESERIALIZES``; ``--reserialize``: this platform too, to test that it
            does: then the third process runs what the second re-serialized)
  store     both kept: every program comes from the store, nothing is traced or lowered

The tokens of all three must be equal (a stored program that lost part of itself fails to run, or
computes other tokens). Prints one JSON line per process and a verdict; ``--out`` writes them.

    python benchmarks/program_store_check.py --out /tmp/store.json
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = [[1, 2, 3, 4, 5], list(range(10, 80)), [7] * 33]


def worker(model: str, cache: str, reserialize: bool) -> None:
    sys.path.insert(0, str(ROOT))
    import jax

    from jaxserve.engine import program_store
    if reserialize:
        program_store.RESERIALIZES = program_store.RESERIALIZES | {jax.devices()[0].platform}

    from jaxserve.engine.llm import EngineArgs, build_engine
    from jaxserve.sampling_params import SamplingParams

    t0 = time.perf_counter()
    engine = build_engine(EngineArgs(model=model, dtype="bfloat16", compile_all=True, compile_cache=cache,
                                     max_prefill_length=512, max_running_requests=8, progress=False))
    built = time.perf_counter() - t0
    store = engine.executor.executables
    outs = engine.generate(PROMPTS, SamplingParams(max_tokens=12))
    stored = list(Path(cache + "-programs").glob("*/*.bin"))
    print(json.dumps({"device": jax.devices()[0].device_kind, "build_s": round(built, 2),
                      "executables": 0 if store is None else len(store), "stored_files": len(stored),
                      "tokens": [o.output_ids for o in outs]}))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=str(ROOT / "weights/default"))
    ap.add_argument("--out", type=Path)
    ap.add_argument("--reserialize", action="store_true",
                    help="store the programs JAX's cache served on this platform too (to test that they run)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--cache", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args.model, args.cache, args.reserialize)
    tmp = Path(tempfile.mkdtemp(prefix="store-check-"))
    cache = tmp / "xla"
    runs = {}
    for name in ("fresh", "cached", "store"):
        if name == "cached":
            shutil.rmtree(tmp / "xla-programs", ignore_errors=True)
        p = subprocess.run([sys.executable, __file__, "--worker", "--model", args.model, "--cache", str(cache)]
                           + ["--reserialize"] * args.reserialize, capture_output=True, text=True)
        log = [ln for ln in p.stderr.splitlines() if "program store" in ln or "compiled" in ln or "Error" in ln]
        last = p.stdout.strip().splitlines()[-1:] if p.returncode == 0 else []
        runs[name] = {"rc": p.returncode, **(json.loads(last[0]) if last else {}), "log": log[-4:],
                      **({} if p.returncode == 0 else {"stderr_tail": p.stderr[-2000:]})}
        print(json.dumps({name: {k: v for k, v in runs[name].items() if k != "tokens"}}), flush=True)
    tokens = [r.get("tokens") for r in runs.values()]
    ok = all(r["rc"] == 0 for r in runs.values()) and tokens[0] is not None and tokens.count(tokens[0]) == 3
    verdict = {"ok": ok, "equal_tokens": tokens.count(tokens[0]) == 3}
    print(json.dumps(verdict))
    if args.out:
        args.out.write_text(json.dumps({"runs": runs, **verdict}, indent=1))
    shutil.rmtree(tmp, ignore_errors=True)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
