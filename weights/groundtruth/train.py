"""Train a ground-truth hybrid (qwen3_5, or qwen3_5_moe with --moe) on the tasks and export it.

    python -m weights.groundtruth.train --out DIR [--steps N] [--moe] [--smoke] [--seed S] [--config KEY=VALUE ...]

What it does, in order:
1. tokenizer: ``weights.groundtruth.tokenizer`` (BPE on the task corpus), saved into DIR/export;
2. model: a qwen3_5(_moe) config (``--config KEY=VALUE``, repeatable, VALUE as JSON, changes it:
   any HF config key, ``partial_rotary_factor=F`` into ``rope_parameters``, ``attention_every=N``
   for every N-th layer full attention; unknown keys raise ValueError); HF-named tensors initialised at random (the families of values
   transformers uses; or ``--init-from`` an earlier export's, a dense one upcycled into ``--moe``)
   and mapped by ``jaxserve.models.params.build_params`` into the params pytree, so training
   updates exactly the tensors that are exported;
3. training: flax ``TrainState`` + optax AdamW (warmup + cosine, global-norm clip 1.0), fp32 master
   params; on GPU the forward runs in bf16 (params cast in the step), on CPU in fp32. The step is
   jitted once per length bucket (static shapes) and donates the state. Orbax checkpoints to
   DIR/checkpoints every ``--ckpt-every`` steps; a run whose DIR has one resumes from the latest
   (the data stream is a function of (seed, step), so a resumed run sees the batches it would
   have seen);
4. export: ``build_params`` inverted (back to HF [out, in] layout, split GDN projections, experts
   per expert as transformers' save_pretrained writes them) -> DIR/export: config.json,
   model.safetensors (bf16), generation_config.json, tokenizer files;
5. evaluation: the export is reloaded with ``weights.load_model`` and held-out probes are decoded
   greedily with ``jaxserve.generate.generate``; accuracy per task is printed as JSON.

The forward of training (``train_logits``) is the decoder stack of ``jaxserve.models.decoder``
built from the same layer functions (``rms_norm``, ``attention_in``/``attention_out``, ``mlp``,
``moe``, the GDN projections / conv / gated norm), with two training backends: full attention is a
dense causal softmax over the [B, T] batch (the paged backend's key-block loop has a data-dependent
trip count, which reverse-mode autodiff rejects), and the delta rule is a per-sequence chunked form
(``_delta_rule_train``; the serving reference's ragged grid needs O(T^2) memory in its gradient).
Tests check ``train_logits`` against ``decoder.forward``.

Batches: no packing; each step takes one length bucket (kind, T, B) with about the same number of
tokens (B*T ~ ``--batch-tokens``), rows right-padded. Curriculum: during the first
``--curriculum`` fraction of steps only the short needle buckets (contexts of 20-120 and 100-800
tokens) are used; then the 1k-2k and 2k-4k context buckets join. Needle conversations carry up to
``NEEDLE_FOLLOW_UPS`` extra questions about the same context.
"""

from __future__ import annotations

import argparse
import functools
import json
import queue
import random
import shutil
import sys
import threading
import time
from functools import partial
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from jaxserve.config import LINEAR_ATTENTION, ModelConfig
from jaxserve.models import decoder, gated_deltanet
from jaxserve.models.layers import attention_in, attention_out, mlp, moe, rms_norm
from jaxserve.models.params import build_params, hf_shapes
from weights.groundtruth import grow as gt_grow
from weights.groundtruth import tasks
from weights.groundtruth import tokenizer as gt_tokenizer

MAX_EXPORT_BYTES = 20 * 1024 * 1024

_COMMON = dict(
    hidden_act="silu", rms_norm_eps=1e-6, attention_bias=False, attention_dropout=0.0,
    linear_conv_kernel_dim=4, max_position_embeddings=8192, tie_word_embeddings=True,
    initializer_range=0.02, use_cache=True, bos_token_id=None, pad_token_id=None,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
)


def _layer_types(n: int, every: int = 4) -> list[str]:
    """GDN : full attention = (every - 1) : 1 (every ``every``-th layer full attention; 4 as Qwen3.5)."""
    return ["full_attention" if (i + 1) % every == 0 else "linear_attention" for i in range(n)]


# Derived override keys (not HF config keys) accepted by ``model_config``'s ``overrides``.
DERIVED_OVERRIDES = ("partial_rotary_factor", "attention_every")


def _apply_overrides(cfg: dict, overrides: dict) -> dict:
    """``cfg`` with ``overrides``: keys of the HF config replace their values; ``partial_rotary_factor``
    goes into ``rope_parameters``; ``attention_every=N`` makes every N-th layer full attention
    (``layer_types`` is rebuilt too when ``num_hidden_layers`` changes). Unknown keys raise."""
    unknown = sorted(k for k in overrides if k not in cfg and k not in DERIVED_OVERRIDES)
    if unknown:
        raise ValueError(f"unknown config override(s) {unknown}; allowed: the model's HF config keys "
                         f"{sorted(cfg)} and {list(DERIVED_OVERRIDES)}")
    cfg = {**cfg, **{k: v for k, v in overrides.items() if k not in DERIVED_OVERRIDES}}
    if "partial_rotary_factor" in overrides:
        f = overrides["partial_rotary_factor"]
        if not isinstance(f, (int, float)) or not 0 < f <= 1:
            raise ValueError(f"partial_rotary_factor must be in (0, 1], got {f!r}")
        cfg["rope_parameters"] = {**cfg["rope_parameters"], "partial_rotary_factor": float(f)}
    every = overrides.get("attention_every")
    if every is not None and (not isinstance(every, int) or isinstance(every, bool) or every < 1):
        raise ValueError(f"attention_every must be a positive integer, got {every!r}")
    if "layer_types" in overrides and ("attention_every" in overrides or len(cfg["layer_types"]) != cfg["num_hidden_layers"]):
        raise ValueError("layer_types override conflicts with attention_every / num_hidden_layers")
    if "layer_types" not in overrides and (every is not None or "num_hidden_layers" in overrides):
        cfg["layer_types"] = _layer_types(cfg["num_hidden_layers"], every or 4)
    return cfg


def model_config(vocab_size: int, *, moe_variant: bool, smoke: bool, overrides: dict | None = None) -> dict:
    """The HF config.json (text config) of the model to train; ``overrides`` (``--config KEY=VALUE``)
    change it, see ``_apply_overrides``. The MoE variant's shared expert is as wide as the dense
    MLP (``shared_expert_intermediate_size == intermediate_size``), so a dense export upcycles into
    it exactly (``_upcycle_dense_mlp``); its routed experts are narrow, to stay in the export budget."""
    if smoke:
        size = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=2,
                    num_key_value_heads=1, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=2,
                    linear_key_head_dim=8, linear_value_head_dim=8)
        moe_size = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8, shared_expert_intermediate_size=64)
    else:
        size = dict(hidden_size=256, intermediate_size=768, num_hidden_layers=8, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=64, linear_num_key_heads=4, linear_num_value_heads=8,
                    linear_key_head_dim=32, linear_value_head_dim=32)
        moe_size = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=768)
    cfg = {**_COMMON, **size, "vocab_size": vocab_size, "layer_types": _layer_types(size["num_hidden_layers"])}
    if moe_variant:
        cfg.pop("intermediate_size")
        cfg.update(moe_size, router_aux_loss_coef=0.001, output_router_logits=False)
        cfg = {"architectures": ["Qwen3_5MoeForCausalLM"], "model_type": "qwen3_5_moe_text", **cfg}
    else:
        cfg = {"architectures": ["Qwen3_5ForCausalLM"], "model_type": "qwen3_5_text", **cfg}
    return _apply_overrides(cfg, overrides) if overrides else cfg


def parse_config_overrides(items: list[str] | None) -> dict:
    """``["KEY=VALUE", ...]`` (``--config``) -> dict; VALUE is JSON (``1.0``, ``2``, ``true``, ``[...]``),
    or the bare string where it is not valid JSON."""
    out: dict = {}
    for item in items or ():
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--config expects KEY=VALUE, got {item!r}")
        try:
            out[key.strip()] = json.loads(value)
        except json.JSONDecodeError:
            out[key.strip()] = value
    return out


def init_tensors(cfg: ModelConfig, seed: int, init_std: float = 0.02) -> dict[str, np.ndarray]:
    """HF-named fp32 tensors at random (normal weights, zero-centred norms 0, GDN norm 1,
    A_log = log U(1, 16), dt_bias 1), in the canonical names/shapes of ``hf_shapes``."""
    from weights.random_checkpoint import _value

    rng = np.random.default_rng(seed)
    return {name: _value(name, shape, cfg, rng, init_std) for name, shape in hf_shapes(cfg).items()}


# ---------------------------------------------------------------------------------------------
# The training forward: decoder's stack over a dense [B, T] batch (see the module doc).
# ---------------------------------------------------------------------------------------------


def causal_attention_weights(q, k, cfg: ModelConfig, B: int, T: int):
    """Causal GQA softmax weights ``[B, kv_heads, group, T (query), T (key)]`` of q ``[B*T, nh, hd]``
    and k ``[B*T, kv_heads, hd]`` (head h reads kv head h // group, as transformers' repeat_kv)."""
    nh, nkv, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    qg = q.reshape(B, T, nkv, nh // nkv, hd)
    s = jnp.einsum("bqkgd,bskd->bkgqs", qg, k.reshape(B, T, nkv, hd), preferred_element_type=jnp.float32) * (hd ** -0.5)
    s = jnp.where(jnp.tril(jnp.ones((T, T), bool)), s, -1e30)
    return jax.nn.softmax(s, axis=-1).astype(q.dtype)


def _dense_causal_attention(p, cfg: ModelConfig, x, positions, B: int, T: int):
    q, k, v, gate = attention_in(p, cfg, x, positions)
    w = causal_attention_weights(q, k, cfg, B, T)
    v = v.reshape(B, T, cfg.num_kv_heads, cfg.head_dim)
    out = jnp.einsum("bkgqs,bskd->bqkgd", w, v, preferred_element_type=jnp.float32).astype(q.dtype)
    return attention_out(p, cfg, out.reshape(B * T, cfg.num_heads * cfg.head_dim), gate)


def _sdpa_causal_attention(p, cfg: ModelConfig, x, positions, B: int, T: int, *, implementation: str):
    """``_dense_causal_attention`` through ``jax.nn.dot_product_attention`` with ``implementation``:
    - "xla" (``--train-attention fused``; what ``implementation=None`` picks on every backend in
      jax 0.11.2, whatever its docs promise): XLA's softmax, which materialises the
      [B, heads, T, T] scores as ``dense`` does: the 4224-token bucket's step needs 16.33 GiB of
      temporaries on the H200, and the CPU compile's largest buffers are those scores;
    - "cudnn" (``--train-attention cudnn``): cuDNN's flash attention, forward and backward, no
      scores in memory; GPU only, bf16/fp16 only (``train`` refuses it elsewhere)."""
    q, k, v, gate = attention_in(p, cfg, x, positions)
    nh, nkv, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    out = jax.nn.dot_product_attention(q.reshape(B, T, nh, hd), k.reshape(B, T, nkv, hd), v.reshape(B, T, nkv, hd),
                                       scale=hd ** -0.5, is_causal=True, implementation=implementation)
    return attention_out(p, cfg, out.reshape(B * T, nh * hd), gate)


TRAIN_ATTENTION = {"dense": _dense_causal_attention,  # --train-attention
                   "fused": partial(_sdpa_causal_attention, implementation="xla"),
                   "cudnn": partial(_sdpa_causal_attention, implementation="cudnn")}
GPU_ONLY_ATTENTION = ("cudnn",)


MATMUL_PRECISIONS = {"highest": jax.lax.Precision.HIGHEST, "default": None}  # --delta-precision


def _delta_rule_train(q, k, v, g, beta, C: int = 64, precision: str = "highest"):
    """The gated delta rule of one sequence from a zero state, chunked (UT transform, a scan over
    chunks), written for the backward pass: the serving reference (``gdn_chunked``) lays ragged
    tokens on a grid whose gradient needs O(T^2) memory. Same math and conventions as
    ``pallas_kernels.kda_reference`` (fp32, q/k l2-normalised, q scaled by dk^-0.5, grouped heads);
    tests check the whole model against ``decoder.forward``. q, k [T, Hk, dk]; v [T, Hv, dv];
    g, beta [T, Hv]. Returns o [T, Hv, dv] in v.dtype. ``precision`` of its fp32 products: "highest"
    (full fp32, the serving reference's) or "default" (the configured one: TF32 on a GPU)."""
    from pallas_kernels.kda_reference import _prepare

    out_dtype = v.dtype
    q, k, v, g, beta = _prepare(q, k, v, g, beta, None, True)
    T = q.shape[0]
    pad = (-T) % C  # zero k and beta leave the state alone; zero g decays nothing
    if pad:
        q, k, v, g, beta = (jnp.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1)) for x in (q, k, v, g, beta))
    n = q.shape[0] // C
    chunks = lambda x: jnp.swapaxes(x.reshape(n, C, *x.shape[1:]), 1, 2)  # noqa: E731 - [n, H, C, ...]
    q, k, v, g, beta = map(chunks, (q, k, v, g, beta))
    gc = jnp.cumsum(g, axis=-1)  # [n, H, C]
    incl = jnp.tril(jnp.ones((C, C), bool))
    strict = jnp.tril(jnp.ones((C, C), bool), -1)
    decay = jnp.exp(jnp.where(incl, gc[..., :, None] - gc[..., None, :], -jnp.inf))
    mm = partial(jnp.matmul, precision=MATMUL_PRECISIONS[precision])
    kb = k * beta[..., None]
    lower = jnp.where(strict, mm(kb, jnp.swapaxes(k, -1, -2)) * decay, 0.0)
    eye = jnp.eye(C, dtype=jnp.float32)
    inv = jax.scipy.linalg.solve_triangular(eye + lower, jnp.broadcast_to(eye, lower.shape), lower=True)
    u = mm(inv, v * beta[..., None])
    w = mm(inv, kb * jnp.exp(gc)[..., None])
    a_qk = jnp.where(incl, mm(q, jnp.swapaxes(k, -1, -2)) * decay, 0.0)

    def step(S, xs):  # S [H, dk, dv]
        qi, ki, ui, wi, gi, ai = xs
        v_new = ui - mm(wi, S)
        o = mm(qi * jnp.exp(gi)[..., None], S) + mm(ai, v_new)
        last = gi[:, -1]
        S = S * jnp.exp(last)[:, None, None] + mm(jnp.swapaxes(ki * jnp.exp(last[:, None] - gi)[..., None], -1, -2), v_new)
        return S, o

    S0 = jnp.zeros((q.shape[1], q.shape[-1], v.shape[-1]), jnp.float32)
    _, o = jax.lax.scan(step, S0, (q, k, u, w, gc, a_qk))
    o = jnp.swapaxes(o, 1, 2).reshape(n * C, *o.shape[1:2], o.shape[-1])[:T]
    return o.astype(out_dtype)


def _causal_conv_train(x: jax.Array, weight: jax.Array) -> jax.Array:
    """SiLU(causal depthwise conv) of one fresh sequence x [T, C] with weight [C, K] (tap K-1 on the
    current token, tap 0 on the oldest), in fp32, returned in x.dtype: what the serving
    reference ``causal_conv1d_prefill`` computes for a single sequence from a zero state, as K
    shifted multiply-adds. That reference gathers each token's window (a scatter in the backward
    pass, which profiled as one of the costliest kernels of a training step on the H200)."""
    T, K = x.shape[0], weight.shape[1]
    xp = jnp.pad(x.astype(jnp.float32), ((K - 1, 0), (0, 0)))
    w = weight.astype(jnp.float32)
    return jax.nn.silu(sum(xp[i:i + T] * w[:, i] for i in range(K))).astype(x.dtype)


def _gdn_train(p: dict, cfg: ModelConfig, x: jax.Array, precision: str = "highest") -> jax.Array:
    """``gated_deltanet.gated_deltanet`` for one fresh sequence x [T, H] (the same projections, conv
    and gated norm), with ``_delta_rule_train`` as the delta-rule backend."""
    mixed, z, beta, g = gated_deltanet.project(p, cfg, x)
    mixed = _causal_conv_train(mixed, p["conv_w"])
    q, k, v = gated_deltanet.split_qkv(cfg, mixed)
    return gated_deltanet.output(p, cfg, _delta_rule_train(q, k, v, g, beta, precision=precision), z)


def train_logits(params: dict, cfg: ModelConfig, tokens: jax.Array, remat: bool = True,
                 delta_precision: str = "highest", attention: str = "dense") -> jax.Array:
    """fp32 logits [B, T, V] of ``tokens`` [B, T], each row a fresh sequence at positions 0..T-1.
    ``delta_precision`` (``MATMUL_PRECISIONS``) and ``attention`` (a ``TRAIN_ATTENTION`` name, or a
    function with their signature: ``needle_attention`` records weights with one) pick the training
    backends."""
    B, T = tokens.shape
    positions = jnp.tile(jnp.arange(T, dtype=jnp.int32), B)

    def gdn_row(p, h):  # h [T, H], one sequence from position 0
        return _gdn_train(p, cfg, h, delta_precision)

    def layer(x, p, layer_type, is_moe):
        h = rms_norm(x, p["input_layernorm"], cfg.rms_norm_eps, cfg.zero_centered_norm)
        if layer_type == LINEAR_ATTENTION:
            h = jax.vmap(gdn_row, in_axes=(None, 0))(p["linear_attn"], h.reshape(B, T, -1)).reshape(B * T, -1)
        else:
            h = TRAIN_ATTENTION.get(attention, attention)(p["self_attn"], cfg, h, positions, B, T)
        x = x + h
        h = rms_norm(x, p["post_attention_layernorm"], cfg.rms_norm_eps, cfg.zero_centered_norm)
        h = moe(p["mlp"], cfg, h) if is_moe else mlp(p["mlp"], h)
        return x + h

    # one-hot product, not a gather: its gradient is a matmul instead of a scatter-add into the
    # embedding (the scatter profiled among the costliest kernels of a step on the H200)
    x = jax.nn.one_hot(tokens.reshape(-1), params["embed"].shape[0], dtype=params["embed"].dtype) @ params["embed"]
    for i, p in enumerate(params["layers"]):
        f = partial(layer, layer_type=cfg.layer_types[i], is_moe=cfg.moe_layers[i])
        x = (jax.checkpoint(f) if remat else f)(x, p)
    x = rms_norm(x, params["norm"], cfg.rms_norm_eps, cfg.zero_centered_norm)
    lm_head = params["embed"].T if cfg.tie_word_embeddings else params["lm_head"]
    return (x @ lm_head).astype(jnp.float32).reshape(B, T, -1)


def loss_fn(params, cfg: ModelConfig, tokens, mask, compute_dtype, remat: bool = True, delta_precision: str = "highest",
            attention: str = "dense"):
    """Mean cross-entropy over answer tokens (mask on the predicted token), and two accuracies:
    over all answer tokens, and over each answer's FIRST token only. The first is flattering under
    teacher forcing (once a needle's first digits are given, the rest can be found by matching
    them); the second is the one greedy decoding lives on (which line / how large a result)."""
    p = jax.tree.map(lambda a: a.astype(compute_dtype), params)
    logits = train_logits(p, cfg, tokens, remat, delta_precision, attention)[:, :-1]
    targets, m = tokens[:, 1:], mask[:, 1:].astype(jnp.float32)
    # logsumexp minus the target's logit picked by a one-hot product: elementwise in the backward
    # pass (take_along_axis's gradient is a scatter over [B, T, V])
    target_logit = (logits * jax.nn.one_hot(targets, logits.shape[-1], dtype=logits.dtype)).sum(-1)
    nll = jax.nn.logsumexp(logits, axis=-1) - target_logit
    return (nll * m).sum() / jnp.maximum(m.sum(), 1.0), answer_accuracies(logits, tokens, mask)


def answer_accuracies(logits, tokens, mask):
    """(accuracy over all answer tokens, over each answer's first token) of next-token ``logits``
    [B, T-1, V] for ``tokens`` / loss ``mask`` [B, T]. A first token is an answer token whose
    input token is not one (the assistant header before it)."""
    targets, m = tokens[:, 1:], mask[:, 1:].astype(jnp.float32)
    right = (jnp.argmax(logits, -1) == targets).astype(jnp.float32)
    first = m * (1.0 - mask[:, :-1].astype(jnp.float32))
    return (right * m).sum() / jnp.maximum(m.sum(), 1.0), (right * first).sum() / jnp.maximum(first.sum(), 1.0)


# ---------------------------------------------------------------------------------------------
# Data: length buckets and a prefetching batch stream.
# ---------------------------------------------------------------------------------------------


def buckets(smoke: bool, batch_tokens: int) -> list[dict]:
    """(kind, T, B, needle context range, phase) per bucket; phase 1 buckets join after the
    curriculum. T is a multiple of 64 (the GDN chunk)."""
    if smoke:
        spec = [("arithmetic", 64, None, 0), ("recall", 256, None, 0), ("needle", 128, (30, 90), 0),
                ("echo", 128, (30, 90), 0)]
    else:
        spec = [("arithmetic", 64, None, 0), ("recall", 320, None, 0), ("needle", 1024, (100, 800), 0),
                ("needle", 2048, (900, 1800), 1), ("needle", 4224, (1950, 3900), 1), ("needle", 320, (20, 120), 0),
                ("echo", 320, (20, 120), 0), ("echo", 1024, (100, 800), 0),
                ("needle", 5248, (2900, 4900), 1)]
    return [dict(kind=k, T=T, B=max(1, batch_tokens // T), needle=nr, phase=ph) for k, T, nr, ph in spec]


# Bucket order within a cycle (indices into buckets()); arithmetic gets the most steps.
# Short needles (5) come often: retrieval is learnt there first, then carried to long contexts.
# The training-only echo buckets (6, 7; smoke 3) are in the cycle only when ``kinds`` names "echo".
# Bucket 8 (contexts of 2.9k-4.9k tokens, past the probes' 4k) is in no default cycle: ``--cycle``
# adds it, so that the probes' longest needles are not the longest the model has seen.
_CYCLE = {False: [0, 5, 1, 0, 2, 5, 0, 3, 1, 0, 5, 4, 0, 2, 6, 7, 6], True: [0, 1, 0, 2, 3]}

# Extra questions per needle context in training (the probes ask one); each answer is supervised.
NEEDLE_FOLLOW_UPS = 8


def check_cycle(cycle: tuple[int, ...], bks: list[dict], kinds: tuple[str, ...] | None) -> None:
    """ValueError unless every index of ``cycle`` names a bucket and one of them is of ``kinds``."""
    bad = [i for i in cycle if not 0 <= i < len(bks)]
    if bad:
        raise ValueError(f"--cycle: no bucket {bad}; buckets are 0..{len(bks) - 1}: "
                         + ", ".join(f"{i}={b['kind']}[T={b['T']}]" for i, b in enumerate(bks)))
    if not any(bks[i]["kind"] in (kinds or tasks.KINDS) for i in cycle):
        raise ValueError(f"--cycle {list(cycle)}: none of its buckets is of kinds {list(kinds or tasks.KINDS)}")


def bucket_for_step(step: int, steps: int, bks: list[dict], smoke: bool, curriculum: float,
                    kinds: tuple[str, ...] | None = None, cycle: tuple[int, ...] | None = None) -> dict:
    """The bucket of ``step``: ``cycle`` (default ``_CYCLE``; indices into ``bks``, a bucket as
    often as it appears) filtered to ``kinds``, and to phase 0 before the curriculum ends."""
    kinds = kinds or tasks.KINDS
    cycle = [i for i in (cycle or _CYCLE[smoke]) if bks[i]["kind"] in kinds]
    if step < curriculum * steps:
        cycle = [i for i in cycle if bks[i]["phase"] == 0] or cycle
    return bks[cycle[step % len(cycle)]]


def make_batch(tok, bucket: dict, seed: int, step: int, arith_hard: float = 0.0,
               arith_mixed: float = 1.0, needle_shared: float = 0.0) -> tuple[np.ndarray, np.ndarray]:
    """[B, T] tokens (padded with <|endoftext|>) and loss mask; a function of (seed, step).
    ``arith_hard``: the fraction of arithmetic problems drawn carry/borrow-heavy, ``arith_mixed``
    the fraction with operands drawn by digit count, the rest as the probes draw them
    (``tasks.arithmetic``); ``needle_shared`` the fraction of needle contexts with distractor codes
    sharing the asked codes' leading digits (``tasks.needle``)."""
    rng = random.Random(seed * 1_000_003 + step)
    pad = tok.token_to_id("<|endoftext|>")
    B, T = bucket["B"], bucket["T"]
    count = lambda s: len(tok.encode(s))  # noqa: E731
    toks = np.full((B, T), pad, np.int32)
    mask = np.zeros((B, T), np.int32)
    for b in range(B):
        while True:
            if bucket["kind"] == "echo":
                ids, m = tasks.encode_segments(tok, tasks.needle_echo(rng, rng.randint(*bucket["needle"]), count))
            else:
                msgs = tasks.example(bucket["kind"], rng, bucket["needle"] or (0, 0), count, NEEDLE_FOLLOW_UPS,
                                     mixed_digits=arith_mixed, arith_hard=arith_hard, needle_shared=needle_shared)
                ids, m = tasks.encode(tok, msgs)
            if len(ids) <= T:
                break
        toks[b, : len(ids)] = ids
        mask[b, : len(ids)] = m
    return toks, mask


class Prefetcher:
    """Builds batches ahead of the device (``depth`` in flight) so it does not wait on Python data
    generation: on a background thread, or with ``workers`` > 0 in that many spawned processes
    (a batch of 64k tokens takes ~0.1-0.2 s of Python, as long as a device step). ``fn`` must be
    picklable for workers; batches come back in step order either way."""

    def __init__(self, fn, steps: range, depth: int = 8, workers: int = 0):
        self._q: queue.Queue = queue.Queue(depth)
        if workers > 0:
            import concurrent.futures as cf
            import multiprocessing as mp

            pool = cf.ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn"))

            def feed():
                pending: list = []
                for s in steps:
                    pending.append((s, pool.submit(fn, s)))
                    if len(pending) >= depth:
                        s0, f = pending.pop(0)
                        self._q.put((s0, f.result()))
                for s0, f in pending:
                    self._q.put((s0, f.result()))
                pool.shutdown()

            target = feed
        else:
            target = lambda: [self._q.put((s, fn(s))) for s in steps]  # noqa: E731
        self._t = threading.Thread(target=target, daemon=True)
        self._t.start()

    def get(self):
        return self._q.get()


_WORKER_TOKENIZERS: dict = {}


def batch_for_step(step: int, *, tokenizer_dir: str, steps: int, bks: list[dict], smoke: bool, curriculum: float,
                   kinds: tuple[str, ...] | None, seed: int, cycle: tuple[int, ...] | None = None,
                   arith_hard: float = 0.0, arith_mixed: float = 1.0, needle_shared: float = 0.0):
    """(bucket, (tokens, mask)) of ``step``: a pure function of its arguments (picklable with
    ``functools.partial`` for Prefetcher's worker processes, which load the tokenizer once)."""
    from jaxserve.tokenizer import Tokenizer

    tok = _WORKER_TOKENIZERS.get(tokenizer_dir)
    if tok is None:
        tok = _WORKER_TOKENIZERS[tokenizer_dir] = Tokenizer.from_dir(tokenizer_dir)
    bucket = bucket_for_step(step, steps, bks, smoke, curriculum, kinds, cycle)
    return bucket, make_batch(tok, bucket, seed, step, arith_hard, arith_mixed, needle_shared)


# ---------------------------------------------------------------------------------------------
# Export: build_params inverted.
# ---------------------------------------------------------------------------------------------


def to_hf_tensors(params: dict, cfg: ModelConfig, per_expert: bool = True) -> dict[str, np.ndarray]:
    """The params pytree back to HF-named host arrays ([out, in] linears). Experts are written per
    expert (``mlp.experts.{j}.{gate,up,down}_proj.weight``, what transformers' save_pretrained
    writes) or, with ``per_expert=False``, fused (``gate_up_proj`` [E, 2I, H], ``down_proj``)."""
    assert not cfg.fused_linear_projections
    a = lambda x: np.asarray(jax.device_get(x))  # noqa: E731
    out: dict[str, np.ndarray] = {"model.embed_tokens.weight": a(params["embed"]), "model.norm.weight": a(params["norm"])}
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = a(params["lm_head"]).T

    def lin(name, p):
        out[f"{name}.weight"] = a(p["w"]).T
        if "b" in p:
            out[f"{name}.bias"] = a(p["b"])

    for i, (layer, lt) in enumerate(zip(params["layers"], cfg.layer_types)):
        pre = f"model.layers.{i}"
        out[f"{pre}.input_layernorm.weight"] = a(layer["input_layernorm"])
        out[f"{pre}.post_attention_layernorm.weight"] = a(layer["post_attention_layernorm"])
        if lt == LINEAR_ATTENTION:
            la, p = f"{pre}.linear_attn", layer["linear_attn"]
            for k in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj"):
                lin(f"{la}.{k}", p[k])
            out[f"{la}.conv1d.weight"] = a(p["conv_w"])[:, None, :]
            out[f"{la}.dt_bias"] = a(p["dt_bias"])
            out[f"{la}.A_log"] = a(p["A_log"])
            out[f"{la}.norm.weight"] = a(p["norm"])
        else:
            sa, p = f"{pre}.self_attn", layer["self_attn"]
            for k in ("q_proj", "k_proj", "v_proj", "o_proj"):
                lin(f"{sa}.{k}", p[k])
            out[f"{sa}.q_norm.weight"] = a(p["q_norm"])
            out[f"{sa}.k_norm.weight"] = a(p["k_norm"])
        m, p = f"{pre}.mlp", layer["mlp"]
        if cfg.moe_layers[i]:
            out[f"{m}.gate.weight"] = a(p["router"]).T
            gate_up = a(p["gate_up"]).transpose(0, 2, 1)  # [E, 2I, H]
            down = a(p["down"]).transpose(0, 2, 1)  # [E, H, I]
            if per_expert:
                inter = cfg.moe_intermediate_size
                for j in range(cfg.num_experts):
                    out[f"{m}.experts.{j}.gate_proj.weight"] = gate_up[j, :inter]
                    out[f"{m}.experts.{j}.up_proj.weight"] = gate_up[j, inter:]
                    out[f"{m}.experts.{j}.down_proj.weight"] = down[j]
            else:
                out[f"{m}.experts.gate_up_proj"] = gate_up
                out[f"{m}.experts.down_proj"] = down
            for k in ("gate_proj", "up_proj", "down_proj"):
                lin(f"{m}.shared_expert.{k}", p["shared_expert"][k])
            out[f"{m}.shared_expert_gate.weight"] = a(p["shared_expert_gate"]).T
        else:
            for k in ("gate_proj", "up_proj", "down_proj"):
                lin(f"{m}.{k}", p[k])
    return {k: np.ascontiguousarray(v) for k, v in out.items()}


def export(params: dict, config: dict, out: str | Path, tokenizer_dir: str | Path, dtype: str = "bfloat16") -> Path:
    """Write a Hugging Face folder: config.json, model.safetensors, generation_config.json and the
    tokenizer files."""
    from safetensors.numpy import save_file

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    cfg = ModelConfig.from_hf(config)
    store = {"bfloat16": ml_dtypes.bfloat16, "float32": np.float32}[dtype]
    tensors = {k: v.astype(store) for k, v in to_hf_tensors(params, cfg).items()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if Path(tokenizer_dir).resolve() != out.resolve():
            shutil.copy(Path(tokenizer_dir) / f, out / f)
    eos = json.loads((out / "tokenizer.json").read_text())
    eos_id = next(t["id"] for t in eos["added_tokens"] if t["content"] == "<|im_end|>")
    full = {**config, "eos_token_id": eos_id, "dtype": dtype, "transformers_version": "5.24.0"}
    (out / "config.json").write_text(json.dumps(dict(sorted(full.items())), indent=2) + "\n")
    gen = {"do_sample": False, "eos_token_id": eos_id, "transformers_version": "5.24.0"}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    return out


# ---------------------------------------------------------------------------------------------
# Evaluation on held-out probes through the serving code path.
# ---------------------------------------------------------------------------------------------


def greedy_pieces(params, cfg: ModelConfig, prompt_ids: list[int], max_tokens: int, eos_ids, max_len: int) -> list[int]:
    """Greedy decoding like ``generate`` (prefill, then one-token steps through
    ``decoder.forward``), with the prompt prefilled in power-of-two pieces (2048, 1024, ..., 1)
    into one fixed-size state, so a few hundred prompts of distinct lengths compile a dozen shapes
    instead of one per length. GDN chunks are aligned to absolute positions, so pieces compute
    what one prefill would; tests check it returns what ``generate`` returns."""
    state = decoder.init_state(cfg, 1, max_len, jnp.float32)
    pos, logits, n = 0, None, len(prompt_ids)
    piece = 2048
    while pos < n:
        while piece > n - pos:
            piece //= 2
        toks = jnp.asarray([prompt_ids[pos:pos + piece]], jnp.int32)
        logits, state = decoder.forward(params, cfg, toks, jnp.arange(pos, pos + piece, dtype=jnp.int32)[None],
                                        state, last_only=True)
        pos += piece
    out: list[int] = []
    for step in range(max_tokens):
        tok = int(jnp.argmax(logits[0]))
        out.append(tok)
        if tok in eos_ids or step + 1 == max_tokens:
            break
        logits, state = decoder.forward(params, cfg, jnp.asarray([[tok]], jnp.int32),
                                        jnp.asarray([[n + step]], jnp.int32), state, last_only=True)
    return out


def evaluate(folder: str | Path, n_per_kind: int, needle_tokens=(1000, 4000), seed: int = tasks.PROBE_SEED,
             max_tokens: int = 12, mode: str = "generate", misses: list | None = None,
             kinds: tuple[str, ...] = tasks.KINDS) -> dict:
    """Accuracy per task on held-out probes, greedy, on the model reloaded from ``folder``.
    ``mode``: ``generate`` (jaxserve.generate.generate; compiles one prefill per distinct prompt
    length) or ``pieces`` (``greedy_pieces``: same tokens, a dozen compiled shapes).
    ``misses``, when given, gets one dict per wrong answer (kind, prompt tokens, question,
    expected, got): where a model fails (borrow chains, needle lengths) without a second pass.
    ``kinds``: score only these (the probes are drawn for every kind first, so a kind's probes are
    the same whichever others are asked for)."""
    from jaxserve.generate import SamplingParams, generate
    from jaxserve.tokenizer import Tokenizer
    from weights import load_model

    model = load_model(folder, dtype="float32", progress=False)
    tok = Tokenizer.from_dir(folder)
    eos = tuple(tok.eos_token_ids)
    sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    count = lambda s: len(tok.encode(s))  # noqa: E731
    unknown = set(kinds) - set(tasks.KINDS)
    if unknown:
        raise ValueError(f"evaluate: no probe kind {sorted(unknown)}; kinds are {list(tasks.KINDS)}")
    probes = [pr for pr in tasks.probes(n_per_kind, seed, needle_tokens, count) if pr.kind in kinds]
    encoded = [tok.encode(tok.apply_chat_template(pr.messages, add_generation_prompt=True)) for pr in probes]
    max_len = -(-(max(map(len, encoded)) + max_tokens) // 256) * 256
    right: dict[str, int] = {k: 0 for k in kinds}
    total: dict[str, int] = {k: 0 for k in kinds}
    for pr, ids in zip(probes, encoded):
        if mode == "generate":
            out = generate(model.params, model.config, ids, sampling, eos_token_ids=eos).output_ids
        else:
            out = greedy_pieces(model.params, model.config, ids, max_tokens, eos, max_len)
        total[pr.kind] += 1
        got = tok.decode(out)
        ok = tasks.score(pr.answer, got)
        right[pr.kind] += ok
        if not ok and misses is not None:
            misses.append({"kind": pr.kind, "prompt_tokens": len(ids), "question": pr.messages[-1]["content"],
                           "expected": pr.answer, "got": got})
    return {k: {"right": right[k], "n": total[k], "accuracy": right[k] / max(total[k], 1)} for k in kinds}


# ---------------------------------------------------------------------------------------------
# Training loop.
# ---------------------------------------------------------------------------------------------


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
    import orbax.checkpoint as ocp

    opts = ocp.CheckpointManagerOptions(max_to_keep=2, save_interval_steps=every, create=True)
    return ocp.CheckpointManager(path.resolve(), options=opts)


# Config keys in which the MoE variant and the dense model it upcycles from may differ.
UPCYCLE_KEYS = ("architectures", "model_type", "intermediate_size", "moe_intermediate_size", "num_experts",
                "num_experts_per_tok", "output_router_logits", "router_aux_loss_coef", "shared_expert_intermediate_size")


def _upcycle_dense_mlp(dense: dict[str, np.ndarray], cfg: ModelConfig, seed: int) -> dict[str, np.ndarray]:
    """Sparse upcycling: HF-named tensors of the MoE model ``cfg`` that compute exactly the function
    of the dense model whose tensors are ``dense`` (same config but the MLP, its intermediate_size
    ``cfg.shared_expert_intermediate_size``). A MoE layer outputs ``routed(x) + sigmoid(x @
    shared_expert_gate) * shared_expert(x)`` (``layers.moe``), and here
      - the shared expert is the dense MLP with down_proj doubled and ``shared_expert_gate`` is 0:
        sigmoid(0) = 0.5 exactly, and 0.5 * (2 * down) = down (scaling by powers of two is exact
        in fp32 and bf16), so the shared path is the dense MLP's output;
      - every routed expert's down projection is 0: the routed sum is exactly 0 whichever experts
        the router picks (the down projections get gradients at once, the rest after them);
      - the router and the experts' gate/up projections are ``init_tensors(cfg, seed)``'s (random,
        so the experts differ once they train);
      - every other tensor is the dense model's.
    Non-MoE layers of ``cfg`` (none in qwen3_5_moe) keep the dense MLP."""
    fresh = init_tensors(cfg, seed)
    out = {name: dense.get(name, value) for name, value in fresh.items()}
    for i in (i for i, is_moe in enumerate(cfg.moe_layers) if is_moe):
        m = f"model.layers.{i}.mlp"
        for k in ("gate_proj", "up_proj"):
            out[f"{m}.shared_expert.{k}.weight"] = dense[f"{m}.{k}.weight"]
        out[f"{m}.shared_expert.down_proj.weight"] = 2 * dense[f"{m}.down_proj.weight"]
        out[f"{m}.shared_expert_gate.weight"] = np.zeros_like(fresh[f"{m}.shared_expert_gate.weight"])
        out[f"{m}.experts.down_proj"] = np.zeros_like(fresh[f"{m}.experts.down_proj"])
    assert all(k in dense for k in fresh if ".mlp." not in k) and all(out[k].shape == v.shape for k, v in fresh.items())
    return out


def _export_tensors(folder: str | Path, cfg: ModelConfig, config: dict, tok=None, seed: int = 0) -> dict[str, np.ndarray]:
    """HF-named fp32 tensors of an earlier export of this very model (``--init-from``). With ``tok``
    (``--extend-vocab``: the export's tokenizer plus appended tokens, ``config``'s vocab larger than
    the export's), the embedding rows of the appended tokens start as the mean of the rows of the
    pieces the export's tokenizer splits them into; every other tensor and row is the export's.
    A dense (qwen3_5_text) export of this MoE (qwen3_5_moe_text) model's config -- equal but for
    ``UPCYCLE_KEYS``, its intermediate_size this model's shared_expert_intermediate_size -- is
    upcycled (``_upcycle_dense_mlp``, random parts from ``seed``): same function, new experts.
    Any other difference raises ValueError."""
    from weights.loader import load_tensors

    with open(Path(folder) / "config.json") as f:
        theirs = json.load(f)
    upcycle = config["model_type"] == "qwen3_5_moe_text" and theirs.get("model_type") == "qwen3_5_text"
    ignored = {"torch_dtype", "dtype"} | ({"vocab_size"} if tok else set()) | (set(UPCYCLE_KEYS) if upcycle else set())
    differ = sorted(k for k in config if k not in ignored and theirs.get(k) != config[k])
    if differ:
        raise ValueError(f"--init-from {folder}: its config differs from this model's in {differ}")
    if upcycle and tok is not None:
        raise ValueError(f"--init-from {folder}: upcycling a dense export into --moe does not support --extend-vocab")
    if upcycle and theirs.get("intermediate_size") != config["shared_expert_intermediate_size"]:
        raise ValueError(f"--init-from {folder}: upcycling needs the dense intermediate_size "
                         f"({theirs.get('intermediate_size')}) == shared_expert_intermediate_size "
                         f"({config['shared_expert_intermediate_size']})")
    old_v = theirs["vocab_size"]
    if old_v != config["vocab_size"] and tok is None:
        raise ValueError(f"--init-from {folder}: vocab {old_v} != {config['vocab_size']}")
    old_cfg = ModelConfig.from_hf({**(theirs if upcycle else config), "vocab_size": old_v})
    tensors = load_tensors(folder, hf_shapes(old_cfg), "float32", tie_word_embeddings=cfg.tie_word_embeddings)
    if upcycle:
        return _upcycle_dense_mlp(tensors, cfg, seed)
    if old_v == config["vocab_size"]:
        return tensors
    from jaxserve.tokenizer import Tokenizer

    old_tok = Tokenizer.from_dir(folder)
    for key in [k for k in tensors if k.endswith("embed_tokens.weight") or k == "lm_head.weight"]:
        old = tensors[key]
        rows = [old[old_tok.encode(tok.decode([j], skip_special_tokens=False))].mean(0)
                for j in range(old_v, config["vocab_size"])]
        tensors[key] = np.concatenate([old, np.stack(rows).astype(old.dtype)])
    return tensors


def _grown_tensors(folder: str | Path, cfg: ModelConfig, config: dict, seed: int):
    """``--init-from EXPORT --grow``: (tensors, new-element masks) of the bigger model ``config``
    computing exactly the export's function (``grow.grow_tensors``; new parts random from ``seed``)."""
    from weights.loader import load_tensors

    with open(Path(folder) / "config.json") as f:
        theirs = json.load(f)
    gt_grow.check_growth(theirs, config)
    old_cfg = ModelConfig.from_hf(theirs)
    old = load_tensors(folder, hf_shapes(old_cfg), "float32", tie_word_embeddings=old_cfg.tie_word_embeddings)
    grown = gt_grow.grow_tensors(old, old_cfg, cfg, init_tensors(cfg, seed))
    return grown, gt_grow.new_elements(grown, old, old_cfg, cfg)


def train(out: str | Path, steps: int, *, smoke: bool = False, moe_variant: bool = False, seed: int = 0,
          lr: float | None = None, batch_tokens: int | None = None, ckpt_every: int = 200, warmup: int | None = None,
          curriculum: float = 0.25, log_every: int = 10, extend_vocab: bool = False,
          compute_dtype: str | None = None, kinds: tuple[str, ...] | None = None, stop_at: int | None = None,
          time_limit: float | None = None, data_workers: int = 0, init_from: str | Path | None = None,
          config_overrides: dict | None = None, profile: int = 0, delta_precision: str = "highest",
          attention: str = "dense", cycle: tuple[int, ...] | None = None, arith_hard: float = 0.0,
          arith_mixed: float = 1.0, grow: bool = False, grow_lr_scale: float = 1.0, needle_shared: float = 0.0,
          log=print) -> dict:
    """Train (resuming from DIR/checkpoints if present) and export to DIR/export. Returns a summary
    (``final_params``: the trained pytree). ``kinds`` restricts the buckets to those task kinds;
    ``stop_at`` ends the run early after a checkpoint, without export (as a preempted run would);
    ``time_limit`` (seconds of training loop) ends it early too, but checkpoints AND exports what it
    has (``stopped_at`` in the summary), so a run cut short by a device call's limit still returns a
    model; rerun with the same ``steps`` to continue. ``data_workers`` > 0 builds batches in that many
    processes (the same batches as in-thread). ``init_from``: start a fresh run from an earlier
    run's export (its bf16 weights as fp32 master params, its tokenizer files, a new optimiser
    state; the export's config must be this model's) instead of random weights: how a run
    continues on a machine that no longer has its checkpoints. With ``moe_variant``, a dense export
    of the same size is upcycled into the MoE model (``_upcycle_dense_mlp``: the same function at
    step 0, shared expert = the dense MLP, routed experts contributing 0). ``extend_vocab`` (with
    ``init_from``): the export's tokenizer gets ``tokenizer.with_single_token_names`` (every id
    kept, one token per needle NAME appended) and the embeddings the matching rows. A run with
    checkpoints resumes from them (and the tokenizer in its export folder) and ignores both. ``config_overrides``
    (``--config KEY=VALUE``) changes the model config: any key of the HF config, plus
    ``partial_rotary_factor`` (into ``rope_parameters``) and ``attention_every=N`` (every N-th layer
    full attention); unknown keys raise ValueError. ``profile`` > 0: after the last step, that many
    extra steps per bucket on copies of the state, timed per kernel (``profile_buckets``; the
    summary's ``profile``). ``delta_precision`` of the training delta rule's fp32 products
    (``MATMUL_PRECISIONS``: "highest", or "default" = TF32 on a GPU); ``attention`` its full-attention
    backend (``TRAIN_ATTENTION``: "dense" softmax, "fused" = XLA's ``jax.nn.dot_product_attention``,
    or "cudnn" = cuDNN's flash attention: a GPU and bf16 compute only).
    ``cycle`` (``--cycle``): the bucket order instead of ``_CYCLE`` (indices into ``buckets()``,
    repeated to weight a bucket, e.g. arithmetic on every other step); ValueError if an index is
    out of range or no bucket of ``kinds`` is left in it. ``arith_hard`` (``--arith-hard``): the
    fraction of arithmetic problems drawn carry/borrow-heavy (``tasks.arithmetic``); ``arith_mixed``
    (``--arith-mixed``) the fraction whose operands are drawn by digit count (1-4 digits equally
    often: short problems teach alignment and carries early), the rest uniform over 0..9999 as the
    probes draw them (81 % of them with two 4-digit operands, 6 % by digit count). ``grow``
    (``--grow``, with ``init_from``): the config may add layers and attention heads to the export's
    (``grow.GROW_KEYS``); the export is grown into it with the same function at step 0
    (``grow.grow_tensors``), and ``grow_lr_scale`` multiplies the updates of the new elements.
    ``needle_shared`` (``--needle-shared``): the fraction of training needle contexts with distractor
    lines whose codes share the asked codes' first 1-5 digits (``tasks.needle``; probes unchanged)."""
    for flag, f in (("arith_hard", arith_hard), ("arith_mixed", arith_mixed), ("needle_shared", needle_shared)):
        if not 0.0 <= f <= 1.0:
            raise ValueError(f"{flag}={f}: a fraction in [0, 1]")
    import orbax.checkpoint as ocp

    from jaxserve.tokenizer import Tokenizer

    if delta_precision not in MATMUL_PRECISIONS:
        raise ValueError(f"delta_precision={delta_precision!r}; choose one of {sorted(MATMUL_PRECISIONS)}")
    if attention not in TRAIN_ATTENTION:
        raise ValueError(f"attention={attention!r}; choose one of {sorted(TRAIN_ATTENTION)}")
    if attention in GPU_ONLY_ATTENTION and (jax.default_backend() != "gpu" or compute_dtype == "float32"):
        raise ValueError(f"attention={attention!r} runs on a GPU in bf16 only "
                         f"(backend {jax.default_backend()}, compute {compute_dtype or 'default'})")
    if grow and (init_from is None or moe_variant or extend_vocab):
        raise ValueError("grow needs init_from (a dense export), without moe_variant or extend_vocab")
    if grow_lr_scale <= 0 or (grow_lr_scale != 1.0 and not grow):
        raise ValueError(f"grow_lr_scale={grow_lr_scale}: positive, and only with grow")
    if extend_vocab and init_from is None:
        raise ValueError("extend_vocab extends an --init-from export's tokenizer; a fresh run's already has the name tokens")
    out = Path(out)
    export_dir = out / "export"
    if (export_dir / "tokenizer.json").exists():  # a resumed run keeps the tokenizer it was trained with
        pass
    elif init_from is not None:  # and a continued one its export's (extended with name tokens)
        export_dir.mkdir(parents=True, exist_ok=True)
        for name in gt_tokenizer.FILES:
            shutil.copyfile(Path(init_from) / name, export_dir / name)
        if extend_vocab:
            from tokenizers import Tokenizer as RawTokenizer

            raw = RawTokenizer.from_file(str(Path(init_from) / "tokenizer.json"))
            gt_tokenizer.with_single_token_names(raw).save(str(export_dir / "tokenizer.json"))
    else:
        gt_tokenizer.save(export_dir, seed=tasks.TRAIN_SEED)
    tok = Tokenizer.from_dir(export_dir)
    config = model_config(tok.vocab_size, moe_variant=moe_variant, smoke=smoke, overrides=config_overrides)
    cfg = ModelConfig.from_hf(config)
    on_gpu = jax.default_backend() == "gpu"
    cdtype = jnp.dtype(compute_dtype or ("bfloat16" if on_gpu else "float32"))
    lr = lr if lr is not None else (3e-3 if smoke else 1e-3)
    batch_tokens = batch_tokens or (2048 if smoke else 16384)
    warmup = warmup if warmup is not None else min(200, max(1, steps // 10))

    lr_scales = None
    if grow:
        tensors, new = _grown_tensors(init_from, cfg, config, seed)
        if grow_lr_scale != 1.0:
            lr_scales = build_params(cfg, {k: 1.0 + (grow_lr_scale - 1.0) * m for k, m in new.items()},
                                     lambda x: jnp.asarray(x, jnp.float32))
        log(f"grown from {init_from}: {int(sum(m.sum() for m in new.values())):,} new parameters "
            f"(updates x{grow_lr_scale:g})")
    else:
        tensors = (init_tensors(cfg, seed) if init_from is None
                   else _export_tensors(init_from, cfg, config, tok if extend_vocab else None, seed))
    params = build_params(cfg, tensors, lambda x: jnp.asarray(x, jnp.float32))
    n_params = sum(x.size for x in jax.tree.leaves(params))
    state, schedule = make_train_state(params, lr, steps, warmup, lr_scales)
    mngr = _checkpointer(out / "checkpoints", ckpt_every)
    start = 0
    if mngr.latest_step() is not None:
        start = mngr.latest_step()
        restored = mngr.restore(start, args=ocp.args.StandardRestore(state))
        state = jax.tree.map(lambda ref, x: jnp.asarray(np.asarray(x), ref.dtype), state, restored)
        log(f"resumed from {out / 'checkpoints'} step {start}")
    log(f"model {config['model_type']}: {n_params / 1e6:.2f}M params ({2 * n_params / 2**20:.1f} MiB as bf16), "
        f"backend {jax.default_backend()}, compute {cdtype.name}, steps {start}..{steps}")

    step_fn = _step_fn(cfg, cdtype, not smoke, delta_precision, attention)  # smoke: short sequences, no need to rematerialise
    bks = buckets(smoke, batch_tokens)
    if cycle is not None:
        check_cycle(cycle, bks, kinds)
    end = min(steps, stop_at) if stop_at is not None else steps
    batch = partial(batch_for_step, tokenizer_dir=str(export_dir), steps=steps, bks=bks, smoke=smoke,
                    curriculum=curriculum, kinds=kinds, seed=seed, cycle=cycle, arith_hard=arith_hard,
                    arith_mixed=arith_mixed, needle_shared=needle_shared)
    fetch = Prefetcher(batch, range(start, end), depth=16 if data_workers else 8, workers=data_workers)
    compiled: set = set()
    losses: list[float] = []
    timed_tokens, timed_s, wait_s = 0, 0.0, 0.0
    t_log = time.perf_counter()
    t_loop = time.perf_counter()
    timed_out = False
    for step in range(start, end):
        if time_limit is not None and time.perf_counter() - t_loop > time_limit:
            end, timed_out = step, True
            log(f"time limit {time_limit:.0f}s reached at step {step}/{steps}: checkpointing and exporting")
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
        if done % log_every == 0 or done == steps:
            tps = timed_tokens / timed_s if timed_s else float("nan")
            log(f"step {done}/{steps} {bucket['kind']}[{bucket['B']}x{bucket['T']}] loss {loss:.4f} "
                f"answer-acc {float(acc):.3f} first-token-acc {float(first_acc):.3f} lr {float(schedule(step)):.2e} tok/s {tps:,.0f} "
                f"(data wait {wait_s:.1f}s, wall {time.perf_counter() - t_log:.1f}s)")
        mngr.save(done, args=ocp.args.StandardSave(state))
    if mngr.latest_step() != end and end > start:
        mngr.save(end, args=ocp.args.StandardSave(state), force=True)
    mngr.wait_until_finished()
    mngr.close()
    profiled = profile_buckets(step_fn, state, batch, range(end, end + len(cycle or _CYCLE[smoke])), profile, log) if profile else None
    if end < steps and not timed_out:
        return {"stopped_at": end, "start": start, "first_loss": losses[0] if losses else None,
                "last_loss": losses[-1] if losses else None, "final_params": state.params}

    export(state.params, config, export_dir, export_dir)
    size = (export_dir / "model.safetensors").stat().st_size
    tps = timed_tokens / timed_s if timed_s else float("nan")
    summary = {"steps": end, "planned_steps": steps, "start": start, "first_loss": losses[0] if losses else None,
               "last_loss": losses[-1] if losses else None, "params": n_params,
               "export": str(export_dir), "safetensors_bytes": size, "tokens_per_s": tps,
               "padded_tokens_per_step": batch_tokens, "profile": profiled, "final_params": state.params}
    if size > MAX_EXPORT_BYTES and not smoke:
        log(f"WARNING: model.safetensors is {size} bytes, over the {MAX_EXPORT_BYTES} budget")
    return summary


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="run folder: checkpoints/ and export/ go here")
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--smoke", action="store_true", help="tiny model, short sequences (CPU / CI)")
    ap.add_argument("--moe", action="store_true", help="train the qwen3_5_moe variant")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--lr", type=float)
    ap.add_argument("--batch-tokens", type=int, help="padded tokens per step (default 16384; smoke 2048)")
    ap.add_argument("--warmup", type=int)
    ap.add_argument("--curriculum", type=float, default=0.25, help="fraction of steps before long needles join")
    ap.add_argument("--kinds", nargs="+", choices=tasks.TRAIN_KINDS,
                    help="train on these task kinds only (default: every probe kind; 'echo' is training-only, tasks.needle_echo)")
    ap.add_argument("--cycle", type=int, nargs="+", metavar="I",
                    help="bucket order (indices into buckets(); repeat one to weight it) instead of the default cycle")
    ap.add_argument("--arith-hard", type=float, default=0.0, metavar="F",
                    help="fraction of arithmetic problems with long carry/borrow chains (tasks._hard_operands)")
    ap.add_argument("--arith-mixed", type=float, default=1.0, metavar="F",
                    help="fraction of arithmetic problems with operands drawn by digit count; the rest "
                         "uniform over 0..9999 like the probes")
    ap.add_argument("--needle-shared", type=float, default=0.0, metavar="F",
                    help="fraction of needle contexts with distractor codes sharing the asked codes' "
                         "leading digits (tasks._share_prefixes)")
    ap.add_argument("--ckpt-every", type=int, default=200)
    ap.add_argument("--time-limit", type=float, help="seconds of training, then checkpoint + export (resume later)")
    ap.add_argument("--profile", type=int, default=0, metavar="N",
                    help="after training, N extra steps per bucket (on copies of the state) timed per GPU kernel")
    ap.add_argument("--delta-precision", choices=sorted(MATMUL_PRECISIONS), default="highest",
                    help="precision of the training delta rule's fp32 products (default: TF32 on a GPU)")
    ap.add_argument("--train-attention", choices=sorted(TRAIN_ATTENTION), default="dense",
                    help="full attention in training: dense softmax, fused (jax.nn.dot_product_attention's XLA "
                         "implementation: scores still in memory), or cudnn (flash attention; GPU and bf16 only)")
    ap.add_argument("--log-every", type=int, default=10)
    ap.add_argument("--init-from", metavar="EXPORT_DIR",
                    help="start from an earlier run's export instead of random weights (new optimiser state); "
                         "with --moe, a dense export of the same size is upcycled (same function at step 0)")
    ap.add_argument("--grow", action="store_true",
                    help="with --init-from and --config: add layers / attention heads to the export's model "
                         "(same function at step 0: weights/groundtruth/grow.py)")
    ap.add_argument("--grow-lr-scale", type=float, default=1.0, metavar="K",
                    help="with --grow: the new weights' updates are K times the rest's")
    ap.add_argument("--extend-vocab", action="store_true",
                    help="with --init-from: append one token per needle NAME to the export's tokenizer "
                         "(ids kept) and matching embedding rows (mean of the name's old pieces)")
    ap.add_argument("--data-workers", type=int, default=0,
                    help="processes building batches (0: one background thread); use 2-4 with large --batch-tokens")
    ap.add_argument("--config", action="append", metavar="KEY=VALUE", default=[],
                    help="override a model config key (VALUE as JSON; repeatable): HF config keys, "
                         "partial_rotary_factor, attention_every=N (every N-th layer full attention)")
    ap.add_argument("--compile-cache", metavar="DIR",
                    help="persistent XLA compilation cache (default: jax_cache beside --out, shared by sibling runs)")
    ap.add_argument("--dtype", choices=("bfloat16", "float32"), help="compute dtype (default bf16 on GPU)")
    ap.add_argument("--probes", type=int, default=100, help="held-out probes per task (0: no evaluation)")
    ap.add_argument("--probe-needle-tokens", type=int, nargs=2, default=(1000, 4000))
    ap.add_argument("--eval-mode", choices=("generate", "pieces"), default="generate",
                    help="pieces: same greedy tokens, far fewer compilations (see greedy_pieces)")
    args = ap.parse_args(argv)
    overrides = parse_config_overrides(args.config)
    model_config(gt_tokenizer.BASE_VOCAB, moe_variant=args.moe, smoke=args.smoke, overrides=overrides)  # bad keys fail before any work

    # Compiled steps persist across runs: a resumed run, and every run of the same model shape
    # under the same parent folder (side-by-side variants compiled 85-125 s each on a fresh H200).
    cache = args.compile_cache or str(Path(args.out).resolve().parent / "jax_cache")
    jax.config.update("jax_compilation_cache_dir", cache)
    t0 = time.perf_counter()
    summary = train(args.out, args.steps, smoke=args.smoke, moe_variant=args.moe, seed=args.seed, lr=args.lr,
                    batch_tokens=args.batch_tokens, ckpt_every=args.ckpt_every, warmup=args.warmup,
                    curriculum=args.curriculum, log_every=args.log_every, compute_dtype=args.dtype,
                    kinds=tuple(args.kinds) if args.kinds else None, time_limit=args.time_limit,
                    data_workers=args.data_workers, init_from=args.init_from, extend_vocab=args.extend_vocab,
                    config_overrides=overrides or None, profile=args.profile,
                    delta_precision=args.delta_precision, attention=args.train_attention,
                    cycle=tuple(args.cycle) if args.cycle else None, arith_hard=args.arith_hard, arith_mixed=args.arith_mixed,
                    grow=args.grow, grow_lr_scale=args.grow_lr_scale, needle_shared=args.needle_shared)
    summary.pop("final_params")
    summary["train_wall_s"] = time.perf_counter() - t0
    print(json.dumps({"train": summary}), flush=True)
    if args.probes:
        t1 = time.perf_counter()
        acc = evaluate(summary["export"], args.probes, tuple(args.probe_needle_tokens), mode=args.eval_mode)
        print(json.dumps({"eval": acc, "eval_wall_s": time.perf_counter() - t1}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
