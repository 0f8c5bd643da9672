"""Checkpoint load time: ``weights.load_model`` (stacked, as the engine loads) against the host
layout it replaced (every transposed weight laid out by numpy before ``device_put``), on the same
checkpoint, each run once after a warm-up read of the file (the page cache, as on a restart).

    python benchmarks/load_time.py --ckpt runs/e2e-ck --out load.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import jax
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a script from anywhere


def timed(fn) -> float:
    t0 = time.perf_counter()
    jax.block_until_ready(fn())
    return time.perf_counter() - t0


def main() -> None:
    from jaxserve.config import ModelConfig
    from jaxserve.models import decoder
    from jaxserve.models.params import build_params, hf_shapes
    from weights import loader

    ap = argparse.ArgumentParser()
    ap.add_argument("--ckpt", type=Path, required=True)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    cfg = ModelConfig.from_file(args.ckpt / "config.json")
    target = loader._target_dtype(args.dtype)
    sources = loader._plan(args.ckpt, hf_shapes(cfg), cfg.tie_word_embeddings)
    size = sum(s.nbytes for s in sources.values())
    for f in sorted(args.ckpt.glob("*.safetensors")):  # into the page cache
        with open(f, "rb") as fh:
            while fh.read(1 << 26):
                pass

    def host_layout():
        bar = loader._progress_bar(size, False, args.ckpt)
        params = build_params(cfg, loader._LazyTensors(sources, target, bar),
                              lambda a: jax.device_put(np.asarray(a, target)))
        return decoder.stack_layers(cfg, params, decoder.stack_deleting)

    res = {"device": jax.devices()[0].device_kind, "checkpoint_gb": round(size / 1e9, 2)}
    for name, fn in (("load_model", lambda: loader.load_model(args.ckpt, args.dtype, progress=False, stacked=True).params),
                     ("host_layout", host_layout)):
        s = timed(fn)
        res[name] = {"s": round(s, 2), "gb_s": round(size / 1e9 / s, 2)}
        print(f"{name}: {s:.2f} s, {size / 1e9 / s:.2f} GB/s", flush=True)
    if args.out:
        args.out.write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
