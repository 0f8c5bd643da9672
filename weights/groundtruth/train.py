"""Train a ground-truth hybrid (qwen3_5, or qwen3_5_moe with --moe) on the tasks, export it, and
score the export on held-out probes.

    python -m weights.groundtruth.train --out DIR [--steps N] [--moe] [--smoke] [--seed S] [--config KEY=VALUE ...]

``--help`` lists every option: the fields of ``config.TrainConfig`` (same names, dashes for
underscores; ``--config`` is ``config_overrides``) plus the evaluation and compile-cache flags
below. In Python, ``train(out, steps, **fields)`` runs the same. The pieces, in the order a run
uses them:

- ``start``: the run's tokenizer (``tokenizer``: BPE on the task corpus, or an export's) and its
  step-0 weights (random, an ``--init-from`` export, upcycled into ``--moe``, or ``--grow``n);
- ``architecture``: the model's HF config (``--config KEY=VALUE`` changes it);
- ``data``: length buckets and the batch of each step, a function of (settings, seed, step);
- ``forward``: the training forward (the engine's decoder layers, training backends) and loss;
- ``loop``: optimiser, jitted step, orbax checkpoints and resume, the loop itself;
- ``export``: the Hugging Face folder DIR/export (``build_params`` inverted);
- ``evaluate``: accuracy per task on held-out probes, decoded greedily through the serving path.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import jax

from weights.groundtruth import loop, tasks
from weights.groundtruth.architecture import parse_config_overrides
from weights.groundtruth.config import COMPUTE_DTYPES, TrainConfig
from weights.groundtruth.evaluate import evaluate
from weights.groundtruth.forward import MATMUL_PRECISIONS, TRAIN_ATTENTION


def train(out: str | Path, steps: int, *, log=print, **fields) -> dict:
    """``loop.run(TrainConfig(out, steps, **fields))``: train, checkpoint, export; the summary."""
    return loop.run(TrainConfig(out=out, steps=steps, **fields), log)


# argparse settings of each TrainConfig field that is a flag (help and default come from the field).
_FLAGS: dict[str, dict] = {
    "out": dict(required=True), "steps": dict(type=int), "smoke": dict(action="store_true"),
    "moe": dict(action="store_true"), "seed": dict(type=int), "lr": dict(type=float),
    "batch_tokens": dict(type=int), "warmup": dict(type=int), "curriculum": dict(type=float),
    "kinds": dict(nargs="+", choices=tasks.TRAIN_KINDS), "cycle": dict(type=int, nargs="+", metavar="I"),
    "arith_mixed": dict(type=float, metavar="F"), "needle_shared": dict(type=float, metavar="F"),
    "ckpt_every": dict(type=int), "time_limit": dict(type=float), "profile": dict(type=int, metavar="N"),
    "delta_precision": dict(choices=sorted(MATMUL_PRECISIONS)), "train_attention": dict(choices=sorted(TRAIN_ATTENTION)),
    "dtype": dict(choices=COMPUTE_DTYPES), "log_every": dict(type=int), "data_workers": dict(type=int),
    "init_from": dict(metavar="EXPORT_DIR"), "grow": dict(action="store_true"),
    "grow_lr_scale": dict(type=float, metavar="K"), "extend_vocab": dict(action="store_true"),
    "config_overrides": dict(flag="--config", action="append", metavar="KEY=VALUE", default=[]),
}
# Fields with no flag: ``stop_at`` (a preempted run, for tests) is for Python callers only.
_PYTHON_ONLY = ("stop_at",)


class _HelpWithDefaults(argparse.HelpFormatter):
    """Help lines end with the default where there is one to show (not None, off, or empty)."""

    def _get_help_string(self, action):
        d = action.default
        if action.required or d is None or d is False or d == [] or d is argparse.SUPPRESS:
            return action.help
        return f"{action.help} (default: {' '.join(map(str, d)) if isinstance(d, tuple) else d})"


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=_HelpWithDefaults)
    for f in dataclasses.fields(TrainConfig):
        if f.name in _PYTHON_ONLY:
            continue
        kw = dict(_FLAGS[f.name])
        flag = kw.pop("flag", "--" + f.name.replace("_", "-"))
        if "required" not in kw:
            kw.setdefault("default", f.default)
        ap.add_argument(flag, dest=f.name, help=f.metadata["help"], **kw)
    ap.add_argument("--compile-cache", metavar="DIR",
                    help="persistent XLA compilation cache (default: jax_cache beside --out, shared by sibling runs)")
    ap.add_argument("--probes", type=int, default=100, help="held-out probes per task after training (0: none)")
    ap.add_argument("--probe-needle-tokens", type=int, nargs=2, default=(1000, 4000), metavar=("MIN", "MAX"),
                    help="needle probes' context length range")
    ap.add_argument("--eval-mode", choices=("generate", "pieces"), default="generate",
                    help="pieces: same greedy tokens, far fewer compilations (evaluate.greedy_pieces)")
    return ap


def parse_args(argv: list[str] | None) -> tuple[TrainConfig, argparse.Namespace]:
    """The ``TrainConfig`` of a command line, and its other options (``compile_cache``, ``probes``,
    ``probe_needle_tokens``, ``eval_mode``). Bad values (config keys included) raise ValueError."""
    args = vars(_parser().parse_args(argv))
    other = argparse.Namespace(**{k: args.pop(k) for k in ("compile_cache", "probes", "probe_needle_tokens",
                                                           "eval_mode")})
    args["config_overrides"] = parse_config_overrides(args["config_overrides"]) or None
    for name in ("kinds", "cycle"):
        args[name] = tuple(args[name]) if args[name] else None
    return TrainConfig(**args), other


def main(argv: list[str] | None = None) -> int:
    config, opts = parse_args(argv)  # before any work
    # Compiled steps persist across runs: a resumed run, and every run of the same model shape
    # under the same parent folder (side-by-side variants compiled 85-125 s each on a fresh H200).
    cache = opts.compile_cache or str(Path(config.out).resolve().parent / "jax_cache")
    jax.config.update("jax_compilation_cache_dir", cache)
    t0 = time.perf_counter()
    summary = loop.run(config)
    summary.pop("final_params")
    summary["train_wall_s"] = time.perf_counter() - t0
    print(json.dumps({"train": summary}), flush=True)
    if opts.probes:
        t1 = time.perf_counter()
        acc = evaluate(summary["export"], opts.probes, tuple(opts.probe_needle_tokens), mode=opts.eval_mode)
        print(json.dumps({"eval": acc, "eval_wall_s": time.perf_counter() - t1}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
