"""The training forward: the decoder stack of ``jaxserve.models.decoder`` over a dense [B, T]
batch, and the loss.

Built from the serving layer functions (``rms_norm``, ``attention_in``/``attention_out``, ``mlp``,
``moe``, the GDN projections / conv / gated norm), with two training backends where the serving
ones do not differentiate well: full attention is a causal softmax over the whole [B, T] batch
(the paged backend's key-block loop has a data-dependent trip count, which reverse-mode autodiff
rejects), and the delta rule is a per-sequence chunked form (``delta_rule``; the serving
reference's ragged grid needs O(T^2) memory in its gradient). Each row of a batch is one fresh
sequence at positions 0..T-1. Tests check ``train_logits`` against ``decoder.forward``.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp

from jaxserve.config import LINEAR_ATTENTION, ModelConfig
from jaxserve.models import gated_deltanet
from jaxserve.models.layers import attention_in, attention_out, mlp, moe, rms_norm

def causal_attention_weights(q, k, cfg: ModelConfig, B: int, T: int):
    """Causal GQA softmax weights ``[B, kv_heads, group, T (query), T (key)]`` of q ``[B*T, nh, hd]``
    and k ``[B*T, kv_heads, hd]`` (head h reads kv head h // group, as transformers' repeat_kv)."""
    nh, nkv, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    qg = q.reshape(B, T, nkv, nh // nkv, hd)
    s = jnp.einsum("bqkgd,bskd->bkgqs", qg, k.reshape(B, T, nkv, hd), preferred_element_type=jnp.float32) * (hd ** -0.5)
    s = jnp.where(jnp.tril(jnp.ones((T, T), bool)), s, -1e30)
    return jax.nn.softmax(s, axis=-1).astype(q.dtype)


def dense_causal_attention(p, cfg: ModelConfig, x, positions, B: int, T: int):
    """Causal GQA attention of x [B*T, H] (``attention_in`` -> softmax weights -> ``attention_out``)."""
    q, k, v, gate = attention_in(p, cfg, x, positions)
    w = causal_attention_weights(q, k, cfg, B, T)
    v = v.reshape(B, T, cfg.num_kv_heads, cfg.head_dim)
    out = jnp.einsum("bkgqs,bskd->bqkgd", w, v, preferred_element_type=jnp.float32).astype(q.dtype)
    return attention_out(p, cfg, out.reshape(B * T, cfg.num_heads * cfg.head_dim), gate)


def sdpa_causal_attention(p, cfg: ModelConfig, x, positions, B: int, T: int, *, implementation: str):
    """``dense_causal_attention`` through ``jax.nn.dot_product_attention`` with ``implementation``.
    "cudnn" (``--train-attention cudnn``) is cuDNN's flash attention, forward and backward, with no
    [B, heads, T, T] scores in memory: GPU and bf16/fp16 only (``TrainConfig`` refuses it
    elsewhere). "xla" computes the same on any backend (scores in memory, as ``dense``): the tests
    check this wrapper with it on the CPU. (Without ``implementation``, jax 0.11.2 picks "xla" on
    every backend, whatever its docs promise.)"""
    q, k, v, gate = attention_in(p, cfg, x, positions)
    nh, nkv, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    out = jax.nn.dot_product_attention(q.reshape(B, T, nh, hd), k.reshape(B, T, nkv, hd), v.reshape(B, T, nkv, hd),
                                       scale=hd ** -0.5, is_causal=True, implementation=implementation)
    return attention_out(p, cfg, out.reshape(B * T, nh * hd), gate)


# --train-attention: the full-attention backends of training, by name.
TRAIN_ATTENTION = {"dense": dense_causal_attention,
                   "cudnn": partial(sdpa_causal_attention, implementation="cudnn")}
GPU_ONLY_ATTENTION = ("cudnn",)


# --delta-precision: the precision of the training delta rule's fp32 products, by name.
MATMUL_PRECISIONS = {"highest": jax.lax.Precision.HIGHEST, "default": None}


def delta_rule(q, k, v, g, beta, C: int = 64, precision: str = "highest"):
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


def causal_conv(x: jax.Array, weight: jax.Array) -> jax.Array:
    """SiLU(causal depthwise conv) of one fresh sequence x [T, C] with weight [C, K] (tap K-1 on the
    current token, tap 0 on the oldest), in fp32, returned in x.dtype: what the serving
    reference ``causal_conv1d_prefill`` computes for a single sequence from a zero state, as K
    shifted multiply-adds. That reference gathers each token's window (a scatter in the backward
    pass, which profiled as one of the costliest kernels of a training step on the H200)."""
    T, K = x.shape[0], weight.shape[1]
    xp = jnp.pad(x.astype(jnp.float32), ((K - 1, 0), (0, 0)))
    w = weight.astype(jnp.float32)
    return jax.nn.silu(sum(xp[i:i + T] * w[:, i] for i in range(K))).astype(x.dtype)


def gdn(p: dict, cfg: ModelConfig, x: jax.Array, precision: str = "highest") -> jax.Array:
    """``gated_deltanet.gated_deltanet`` for one fresh sequence x [T, H] (the same projections, conv
    and gated norm), with ``delta_rule`` as the delta-rule backend."""
    mixed, z, beta, g = gated_deltanet.project(p, cfg, x)
    mixed = causal_conv(mixed, p["conv_w"])
    q, k, v = gated_deltanet.split_qkv(cfg, mixed)
    return gated_deltanet.output(p, cfg, delta_rule(q, k, v, g, beta, precision=precision), z)


def train_logits(params: dict, cfg: ModelConfig, tokens: jax.Array, remat: bool = True,
                 delta_precision: str = "highest", attention: str = "dense") -> jax.Array:
    """fp32 logits [B, T, V] of ``tokens`` [B, T], each row a fresh sequence at positions 0..T-1.
    ``delta_precision`` (``MATMUL_PRECISIONS``) and ``attention`` (a ``TRAIN_ATTENTION`` name, or a
    function with their signature: ``needle_attention`` records weights with one) pick the training
    backends."""
    B, T = tokens.shape
    positions = jnp.tile(jnp.arange(T, dtype=jnp.int32), B)

    def gdn_row(p, h):  # h [T, H], one sequence from position 0
        return gdn(p, cfg, h, delta_precision)

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
