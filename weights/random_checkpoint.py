"""Random checkpoints of any size in the Hugging Face format, written with numpy alone.

For benchmarks and device runs where transformers is not at hand (or a model is too big to build
with torch): the tensors are exactly ``hf_shapes(cfg)`` of the given config, saved as
``model.safetensors`` (experts in the fused 3D layout the loader passes through) beside the ``config.json``, with the tokenizer files of a donor folder
(default: the shipped ``weights/default``). Weights are N(0, init_std²), norms 0 (zero-centered)
or 1, ``A_log`` log U(1, 16), ``dt_bias`` 1 — the same families of values transformers initialises.

    python -m weights.random_checkpoint --config cfg.json --out DIR [--dtype bfloat16] [--seed 0]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import ml_dtypes
import numpy as np
from safetensors.numpy import save_file

from jaxserve.config import ModelConfig
from jaxserve.models.params import hf_shapes

DEFAULT_DONOR = Path(__file__).resolve().parent / "default"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")


def _value(name: str, shape: tuple[int, ...], cfg: ModelConfig, rng: np.random.Generator, init_std: float) -> np.ndarray:
    if name.endswith("A_log"):
        return np.log(rng.uniform(1.0, 16.0, shape)).astype(np.float32)
    if name.endswith("dt_bias"):
        return np.ones(shape, np.float32)
    if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
        gated_gdn_norm = ".linear_attn.norm." in name  # RMSNormGated scales by w, not 1 + w
        return np.ones(shape, np.float32) if gated_gdn_norm or not cfg.zero_centered_norm else np.zeros(shape, np.float32)
    if name.endswith(".bias"):
        return np.zeros(shape, np.float32)
    out = rng.standard_normal(shape, dtype=np.float32)  # float32 draws: ~5x faster than normal()'s float64
    out *= np.float32(init_std)
    return out


def _bf16(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 by truncation (the top 16 bits): plain integer ops, which release the
    GIL (ml_dtypes' cast does not), and for random weights as good as rounding."""
    return (x.view(np.uint32) >> 16).astype(np.uint16).view(ml_dtypes.bfloat16)


def write_random_checkpoint(config: dict, out: str | Path, *, dtype: str = "bfloat16", seed: int = 0,
                            init_std: float = 0.02, donor: str | Path = DEFAULT_DONOR) -> Path:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    cfg = ModelConfig.from_hf(config, source="config")
    shapes = list(hf_shapes(cfg).items())
    # One generator per tensor, seeded by (seed, index): the values do not depend on the thread
    # count, and numpy fills and casts release the GIL, so the threads draw in parallel.
    seeds = np.random.SeedSequence(seed).spawn(len(shapes))

    def one(i: int) -> np.ndarray:
        name, shape = shapes[i]
        v = _value(name, shape, cfg, np.random.default_rng(seeds[i]), init_std)
        return _bf16(v) if dtype == "bfloat16" else v

    with ThreadPoolExecutor(min(16, os.cpu_count() or 1)) as pool:
        tensors = {name: t for (name, _), t in zip(shapes, pool.map(one, range(len(shapes))))}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps({**config, "torch_dtype": dtype}, indent=2))
    for f in TOKENIZER_FILES:
        if (Path(donor) / f).exists():
            shutil.copy(Path(donor) / f, out / f)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", required=True, help="a config.json (Hugging Face format)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    write_random_checkpoint(json.loads(Path(args.config).read_text()), args.out, dtype=args.dtype, seed=args.seed)


if __name__ == "__main__":
    main()
