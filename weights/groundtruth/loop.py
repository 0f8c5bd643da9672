"""The training loop: optimiser, jitted step, orbax checkpoints, and ``run`` (one ``TrainConfig``
from its start to its export).

flax ``TrainState`` + optax AdamW (warmup + cosine, global-norm clip 1.0), fp32 master params; on
a GPU the forward runs in bf16 (params cast in the step), on the CPU in fp32. The step is jitted
once per length bucket (static shapes) and donates the state. Checkpoints go to
``out``/checkpoints every ``ckpt_every`` steps; a run whose folder has one resumes from the latest,
bit-identically to an uninterrupted run (the data stream is a function of (seed, step)).
"""

from __future__ import annotations

import functools
import json
import time
from functools import partial
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.config import ModelConfig
from jaxserve.models.params import build_params
from weights.groundtruth import data, start
from weights.groundtruth.architecture import model_config
from weights.groundtruth.config import TrainConfig
from weights.groundtruth.export import MAX_EXPORT_BYTES, export
from weights.groundtruth.forward import loss_fn


@functools.lru_cache(maxsize=None)
def _optimizer(lr: float, steps: int, warmup: int):
    """(tx, schedule), cached: the same object for the same settings keeps the TrainState's
    tree structure equal across calls, so a cached jitted step is reused (tests resume in-process)."""
    import optax

    schedule = optax.warmup_cosine_decay_schedule(0.0, lr, max(1, warmup), max(steps, warmup + 1), lr * 0.1)
    tx = optax.chain(optax.clip_by_global_norm(1.0),
                     optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=0.1, mask=_decay_mask))
    return tx, schedule


def _decay_mask(params):
    """Weight decay on matrices only (not norms, A_log, dt_bias)."""
    return jax.tree.map(lambda x: x.ndim >= 2, params)


class _ElementScales(NamedTuple):
    scales: Any  # a pytree like the params: each update element's multiplier


def _scale_elements(scales):
    """An optax transform multiplying each update element by ``scales`` (a params-like pytree),
    kept in the optimiser state (device arrays, not constants baked into the compiled step)."""
    import optax

    return optax.GradientTransformation(lambda params: _ElementScales(scales),
                                        lambda updates, state, params=None: (
                                            jax.tree.map(jnp.multiply, updates, state.scales), state))


def make_train_state(params, lr: float, steps: int, warmup: int, lr_scales=None):
    """A fresh TrainState; ``lr_scales`` (a params-like pytree, e.g. ``--grow-lr-scale`` on the
    elements ``grow.new_elements`` marks) multiplies each element's AdamW update."""
    import optax
    from flax.training import train_state

    tx, schedule = _optimizer(lr, steps, warmup)
    if lr_scales is not None:
        tx = optax.chain(tx, _scale_elements(lr_scales))
    state = train_state.TrainState.create(apply_fn=None, params=params, tx=tx)
    # Every leaf a device array with a fixed dtype (``step`` starts as a Python int): the fresh, the
    # restored and the stepped state then share one compiled step.
    return jax.tree.map(jnp.asarray, state.replace(step=jnp.asarray(0, jnp.int32))), schedule


@functools.lru_cache(maxsize=None)
def _step_fn(cfg: ModelConfig, cdtype, remat: bool, delta_precision: str = "highest", attention: str = "dense"):
    @partial(jax.jit, donate_argnums=(0,))
    def step_fn(state, tokens, mask):
        (loss, accs), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params, cfg, tokens, mask, cdtype, remat,
                                                                        delta_precision, attention)
        return state.apply_gradients(grads=grads), loss, accs

    return step_fn


def profile_buckets(step_fn, state, batch, steps: range, calls: int = 3, log=print) -> dict:
    """Where a training step's GPU time goes: for each bucket that ``batch(step)`` yields over
    ``steps``, ``calls`` steps on copies of ``state`` (the run is not advanced) timed per kernel
    (``jaxserve.profiling``: total and the 10 costliest kernels) and by the wall clock. Returns and
    logs ``{"kind[BxT]": summary}``; off the GPU only ``wall_ms``."""
    from jaxserve import profiling

    out: dict = {}
    for s in steps:
        bucket, (toks, mask) = batch(s)
        label = f"{bucket['kind']}[{bucket['B']}x{bucket['T']}]"
        if label in out:
            continue
        toks, mask = jnp.asarray(toks), jnp.asarray(mask)
        copies = [jax.tree.map(jnp.copy, state) for _ in range(2 * calls + 1)]
        jax.block_until_ready(copies)

        def call():
            jax.block_until_ready(step_fn(copies.pop(), toks, mask))

        call()  # compile (a bucket the run never used) and warm up
        t0 = time.perf_counter()
        for _ in range(calls):
            call()
        res = dict(wall_ms=round((time.perf_counter() - t0) * 1e3 / calls, 3), tokens=int(toks.size))
        per_call = profiling.kernel_timings(call, calls)
        if per_call:
            res.update(profiling.summarize(per_call, top=10))
        out[label] = res
        log(json.dumps({"profile": label, **res}))
    return out


def _checkpointer(path: Path, every: int):
    """An orbax manager of ``path`` saving every ``every`` steps and keeping the last two."""
    import orbax.checkpoint as ocp

    opts = ocp.CheckpointManagerOptions(max_to_keep=2, save_interval_steps=every, create=True)
    return ocp.CheckpointManager(path.resolve(), options=opts)


def run(config: TrainConfig, log=print) -> dict:
    """Train ``config`` (resuming from its checkpoints if present) and export to ``out``/export.
    Returns a summary (``final_params``: the trained pytree). ``stop_at`` ends the run early after
    a checkpoint, without export (``stopped_at`` in the summary), as a preempted run would;
    ``time_limit`` ends it early too but checkpoints AND exports what it has, so a run cut short
    by a device call's limit still returns a model: rerun with the same ``steps`` to continue.
    With checkpoints, the run resumes from them (and the tokenizer in its export folder) and
    ignores ``init_from``."""
    import orbax.checkpoint as ocp

    from jaxserve.tokenizer import Tokenizer

    config.check_backend(jax.default_backend())
    out = Path(config.out)
    export_dir = out / "export"
    start.prepare_tokenizer(export_dir, config.init_from, config.extend_vocab)
    tok = Tokenizer.from_dir(export_dir)
    hf_config = model_config(tok.vocab_size, moe_variant=config.moe, smoke=config.smoke,
                             overrides=config.config_overrides)
    cfg = ModelConfig.from_hf(hf_config)
    cdtype = jnp.dtype(config.dtype or ("bfloat16" if jax.default_backend() == "gpu" else "float32"))
    steps, batch_tokens = config.steps, config.tokens_per_step

    params, lr_scales = _initial_params(config, cfg, hf_config, tok, log)
    n_params = sum(x.size for x in jax.tree.leaves(params))
    state, schedule = make_train_state(params, config.peak_lr, steps, config.warmup_steps, lr_scales)
    mngr = _checkpointer(out / "checkpoints", config.ckpt_every)
    first = 0
    if mngr.latest_step() is not None:
        first = mngr.latest_step()
        restored = mngr.restore(first, args=ocp.args.StandardRestore(state))
        state = jax.tree.map(lambda ref, x: jnp.asarray(np.asarray(x), ref.dtype), state, restored)
        log(f"resumed from {out / 'checkpoints'} step {first}")
    log(f"model {hf_config['model_type']}: {n_params / 1e6:.2f}M params ({2 * n_params / 2**20:.1f} MiB as bf16), "
        f"backend {jax.default_backend()}, compute {cdtype.name}, steps {first}..{steps}")

    # smoke: short sequences, no need to rematerialise
    step_fn = _step_fn(cfg, cdtype, not config.smoke, config.delta_precision, config.train_attention)
    bks = data.buckets(config.smoke, batch_tokens)
    if config.cycle is not None:
        data.check_cycle(config.cycle, bks, config.kinds)
    end = min(steps, config.stop_at) if config.stop_at is not None else steps
    batch = partial(data.batch_for_step, tokenizer_dir=str(export_dir), steps=steps, bks=bks, smoke=config.smoke,
                    curriculum=config.curriculum, kinds=config.kinds, seed=config.seed, cycle=config.cycle,
                    arith_mixed=config.arith_mixed, needle_shared=config.needle_shared)
    workers = config.data_workers
    fetch = data.Prefetcher(batch, range(first, end), depth=16 if workers else 8, workers=workers)
    compiled: set = set()
    losses: list[float] = []
    timed_tokens, timed_s, wait_s = 0, 0.0, 0.0
    t_log = time.perf_counter()
    t_loop = time.perf_counter()
    timed_out = False
    for step in range(first, end):
        if config.time_limit is not None and time.perf_counter() - t_loop > config.time_limit:
            end, timed_out = step, True
            log(f"time limit {config.time_limit:.0f}s reached at step {step}/{steps}: checkpointing and exporting")
            break
        t0 = time.perf_counter()
        _, (bucket, (toks, mask)) = fetch.get()
        wait_s += time.perf_counter() - t0
        key = (bucket["T"], bucket["B"])
        t1 = time.perf_counter()
        state, loss, (acc, first_acc) = step_fn(state, jnp.asarray(toks), jnp.asarray(mask))
        loss = float(loss)  # syncs
        dt = time.perf_counter() - t1
        if key in compiled:  # steps that compiled are not timed
            timed_tokens += toks.size
            timed_s += dt
        compiled.add(key)
        losses.append(loss)
        done = step + 1
        if done % config.log_every == 0 or done == steps:
            tps = timed_tokens / timed_s if timed_s else float("nan")
            log(f"step {done}/{steps} {bucket['kind']}[{bucket['B']}x{bucket['T']}] loss {loss:.4f} "
                f"answer-acc {float(acc):.3f} first-token-acc {float(first_acc):.3f} lr {float(schedule(step)):.2e} "
                f"tok/s {tps:,.0f} (data wait {wait_s:.1f}s, wall {time.perf_counter() - t_log:.1f}s)")
        mngr.save(done, args=ocp.args.StandardSave(state))
    if mngr.latest_step() != end and end > first:
        mngr.save(end, args=ocp.args.StandardSave(state), force=True)
    mngr.wait_until_finished()
    mngr.close()
    profiled = None
    if config.profile:
        cycle_len = len(config.cycle or data.CYCLE[config.smoke])
        profiled = profile_buckets(step_fn, state, batch, range(end, end + cycle_len), config.profile, log)
    first_loss, last_loss = (losses[0], losses[-1]) if losses else (None, None)
    if end < steps and not timed_out:
        return {"stopped_at": end, "start": first, "first_loss": first_loss, "last_loss": last_loss,
                "final_params": state.params}

    export(state.params, hf_config, export_dir, export_dir)
    size = (export_dir / "model.safetensors").stat().st_size
    tps = timed_tokens / timed_s if timed_s else float("nan")
    if size > MAX_EXPORT_BYTES and not config.smoke:
        log(f"WARNING: model.safetensors is {size} bytes, over the {MAX_EXPORT_BYTES} budget")
    return {"steps": end, "planned_steps": steps, "start": first, "first_loss": first_loss, "last_loss": last_loss,
            "params": n_params, "export": str(export_dir), "safetensors_bytes": size, "tokens_per_s": tps,
            "padded_tokens_per_step": batch_tokens, "profile": profiled, "final_params": state.params}


def _initial_params(config: TrainConfig, cfg: ModelConfig, hf_config: dict, tok, log):
    """(fp32 params, per-element update scales or None) of the run's step 0 (``start``)."""
    as_f32 = lambda x: jnp.asarray(x, jnp.float32)  # noqa: E731
    if config.grow:
        tensors, new = start.grown_tensors(config.init_from, cfg, hf_config, config.seed)
        scale = config.grow_lr_scale
        lr_scales = (build_params(cfg, {k: 1.0 + (scale - 1.0) * m for k, m in new.items()}, as_f32)
                     if scale != 1.0 else None)
        log(f"grown from {config.init_from}: {int(sum(m.sum() for m in new.values())):,} new parameters "
            f"(updates x{scale:g})")
    else:
        lr_scales = None
        tensors = (start.init_tensors(cfg, config.seed) if config.init_from is None
                   else start.export_tensors(config.init_from, cfg, hf_config, tok if config.extend_vocab else None,
                                             config.seed))
    return build_params(cfg, tensors, as_f32), lr_scales
