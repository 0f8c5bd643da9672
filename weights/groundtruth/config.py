"""``TrainConfig``: every knob of a training run, with its default and what it does.

The command line (``train.main``) is built from these fields: a field ``batch_tokens`` is the flag
``--batch-tokens`` with the field's help and default (``config_overrides`` is ``--config``). A
config is checked when it is made (bad values raise ValueError before any work); settings whose
default depends on others (``lr``, ``batch_tokens``, ``warmup``: None) are resolved by the
``peak_lr``, ``tokens_per_step`` and ``warmup_steps`` properties.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

from weights.groundtruth import tasks
from weights.groundtruth.architecture import model_config
from weights.groundtruth.forward import GPU_ONLY_ATTENTION, MATMUL_PRECISIONS, TRAIN_ATTENTION
from weights.groundtruth.tokenizer import BASE_VOCAB

COMPUTE_DTYPES = ("bfloat16", "float32")


def _knob(default, doc: str, **kw):
    """A field with its default and its one-line doc (its flag's ``--help``)."""
    return field(default=default, metadata={"help": doc}, **kw)


@dataclass(frozen=True)
class TrainConfig:
    """One training run: train (resuming from ``out``/checkpoints if present), export to
    ``out``/export. The batches are a function of (the data settings, ``seed``, step)."""

    out: str | Path = field(metadata={"help": "run folder: checkpoints/ and export/ go here"})
    steps: int = _knob(3000, "planned optimiser steps (the learning-rate schedule's length)")
    smoke: bool = _knob(False, "tiny model, short sequences (CPU / CI)")
    moe: bool = _knob(False, "train the qwen3_5_moe variant")
    seed: int = _knob(0, "seed of the random weights and of the batches")
    lr: float | None = _knob(None, "peak learning rate (default 1e-3; smoke 3e-3)")
    batch_tokens: int | None = _knob(None, "padded tokens per step (default 16384; smoke 2048)")
    warmup: int | None = _knob(None, "warmup steps (default steps / 10, at most 200)")
    curriculum: float = _knob(0.25, "fraction of steps before long needles join")
    kinds: tuple[str, ...] | None = _knob(
        None, "train on these task kinds only (default: every probe kind; 'echo' is training-only, tasks.needle_echo)")
    cycle: tuple[int, ...] | None = _knob(
        None, "bucket order (indices into data.buckets(); repeat one to weight it) instead of the default cycle")
    arith_mixed: float = _knob(1.0, "fraction of arithmetic problems with operands drawn by digit count; "
                                    "the rest uniform over 0..9999 like the probes")
    needle_shared: float = _knob(0.0, "fraction of needle contexts with distractor codes sharing the asked "
                                      "codes' leading digits (tasks._share_prefixes)")
    ckpt_every: int = _knob(200, "orbax checkpoint every N steps (2 kept)")
    time_limit: float | None = _knob(None, "seconds of training, then checkpoint + export (rerun to resume)")
    stop_at: int | None = _knob(None, "end after this step's checkpoint, without export, as a preempted run would")
    profile: int = _knob(0, "after training, N extra steps per bucket (on copies of the state) timed per GPU kernel")
    delta_precision: str = _knob("highest", "precision of the training delta rule's fp32 products: highest "
                                            "(full fp32) or default (the configured one: TF32 on a GPU)")
    train_attention: str = _knob("dense", "full attention in training: dense softmax, or cudnn "
                                          "(cuDNN flash attention; GPU and bf16 only)")
    dtype: str | None = _knob(None, "compute dtype (default bfloat16 on a GPU, float32 elsewhere)")
    log_every: int = _knob(10, "log a line every N steps")
    data_workers: int = _knob(0, "processes building batches (0: one background thread); "
                                 "use 2-4 with large --batch-tokens")
    init_from: str | Path | None = _knob(
        None, "start from an earlier run's export instead of random weights (new optimiser state); "
              "with --moe, a dense export of the same size is upcycled (same function at step 0)")
    grow: bool = _knob(False, "with --init-from and --config: add layers / attention heads to the export's "
                              "model (same function at step 0: weights/groundtruth/grow.py)")
    grow_lr_scale: float = _knob(1.0, "with --grow: the new weights' updates are K times the rest's")
    extend_vocab: bool = _knob(False, "with --init-from: append one token per needle NAME to the export's "
                                      "tokenizer (ids kept) and matching embedding rows (mean of the name's old pieces)")
    config_overrides: dict | None = _knob(
        None, "override a model config key (VALUE as JSON; repeatable): HF config keys, "
              "partial_rotary_factor, attention_every=N (every N-th layer full attention)")

    def __post_init__(self):
        for name in ("arith_mixed", "needle_shared"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name}={getattr(self, name)}: a fraction in [0, 1]")
        for name, value, allowed in (("delta_precision", self.delta_precision, sorted(MATMUL_PRECISIONS)),
                                     ("train_attention", self.train_attention, sorted(TRAIN_ATTENTION)),
                                     ("dtype", self.dtype, [*COMPUTE_DTYPES, None])):
            if value not in allowed:
                raise ValueError(f"{name}={value!r}; choose one of {list(allowed)}")
        unknown = set(self.kinds or ()) - set(tasks.TRAIN_KINDS)
        if unknown:
            raise ValueError(f"kinds: no task kind {sorted(unknown)}; kinds are {list(tasks.TRAIN_KINDS)}")
        if self.grow and (self.init_from is None or self.moe or self.extend_vocab):
            raise ValueError("grow needs init_from (a dense export), without moe or extend_vocab")
        if self.grow_lr_scale <= 0 or (self.grow_lr_scale != 1.0 and not self.grow):
            raise ValueError(f"grow_lr_scale={self.grow_lr_scale}: positive, and only with grow")
        if self.extend_vocab and self.init_from is None:
            raise ValueError("extend_vocab extends an --init-from export's tokenizer; "
                             "a fresh run's already has the name tokens")
        # bad config keys fail here, before any work (the vocabulary size is not known yet)
        model_config(BASE_VOCAB, moe_variant=self.moe, smoke=self.smoke, overrides=self.config_overrides)

    def check_backend(self, backend: str) -> None:
        """ValueError if this config cannot train on ``backend`` (``jax.default_backend()``)."""
        if self.train_attention in GPU_ONLY_ATTENTION and (backend != "gpu" or self.dtype == "float32"):
            raise ValueError(f"train_attention={self.train_attention!r} runs on a GPU in bf16 only "
                             f"(backend {backend}, compute {self.dtype or 'default'})")

    @property
    def peak_lr(self) -> float:
        return self.lr if self.lr is not None else (3e-3 if self.smoke else 1e-3)

    @property
    def tokens_per_step(self) -> int:
        return self.batch_tokens or (2048 if self.smoke else 16384)

    @property
    def warmup_steps(self) -> int:
        return self.warmup if self.warmup is not None else min(200, max(1, self.steps // 10))

    @classmethod
    def help(cls, name: str) -> str:
        """The one-line doc of field ``name`` (what ``--help`` prints for its flag)."""
        return next(f.metadata["help"] for f in dataclasses.fields(cls) if f.name == name)
