"""Building blocks shared by every family: norms, rotary embedding, attention, MLP, MoE.

Pure functions over arrays. Activations keep the parameter dtype between blocks; reductions
(norms, softmax, router) run in fp32, as the torch implementations do.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxserve.config import SLIDING_ATTENTION, ModelConfig


def rms_norm(x: jax.Array, weight: jax.Array, eps: float, zero_centered: bool) -> jax.Array:
    """RMSNorm in fp32. Zero-centered (Qwen3.5/Next) scales by ``1 + w`` before the cast back;
    the plain form (Qwen3) casts back first, then scales by ``w``: the two families round differently
    in bf16 and we follow each."""
    xf = x.astype(jnp.float32)
    normed = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    if zero_centered:
        return (normed * (1.0 + weight.astype(jnp.float32))).astype(x.dtype)
    return weight * normed.astype(x.dtype)


def gated_rms_norm(x: jax.Array, gate: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """The GDN output norm: RMSNorm(x) * w, then * silu(gate) in fp32 (norm before gate)."""
    xf = x.astype(jnp.float32)
    normed = (xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)).astype(x.dtype)
    out = (weight * normed).astype(jnp.float32) * jax.nn.silu(gate.astype(jnp.float32))
    return out.astype(x.dtype)


def rotary(x: jax.Array, positions: jax.Array, rotary_dim: int, theta: float) -> jax.Array:
    """Rotate-half RoPE on the first ``rotary_dim`` channels of each head; the rest pass through.

    x: [B, T, heads, head_dim]; positions: [B, T]. For text-only prompts Qwen3.5's multimodal
    RoPE gives every axis the same position, which reduces exactly to this.
    """
    half = rotary_dim // 2
    inv_freq = 1.0 / (theta ** (jnp.arange(0, rotary_dim, 2, dtype=jnp.float32) / rotary_dim))
    freqs = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, half]
    cos = jnp.cos(freqs).astype(x.dtype)[:, :, None, :]
    sin = jnp.sin(freqs).astype(x.dtype)[:, :, None, :]
    x1, x2, rest = x[..., :half], x[..., half:rotary_dim], x[..., rotary_dim:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], axis=-1)


def linear(x: jax.Array, p: dict) -> jax.Array:
    """``x @ w (+ b)``; weights are stored [in, out] (transposed from HF at load time)."""
    y = x @ p["w"]
    return y + p["b"] if "b" in p else y


def attention(
    p: dict,
    cfg: ModelConfig,
    layer_type: str,
    x: jax.Array,
    positions: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Causal GQA over a dense per-sequence KV cache, with q/k norm, partial RoPE and (hybrid
    families) a sigmoid output gate.

    x: [B, T, H]; positions: [B, T], consecutive per row, the absolute position of each token;
    k_cache/v_cache: [B, L, kv_heads, head_dim]. The new keys/values are written at their
    positions and every query attends to cache slots 0..its own position, so a prompt prefilled
    in pieces sees exactly what one prefill would.
    """
    B, T, _ = x.shape
    nh, nkv, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    q = linear(x, p["q_proj"])
    if cfg.attn_output_gate:
        q = q.reshape(B, T, nh, 2 * hd)
        q, gate = q[..., :hd], q[..., hd:].reshape(B, T, nh * hd)
    q = q.reshape(B, T, nh, hd)
    k = linear(x, p["k_proj"]).reshape(B, T, nkv, hd)
    v = linear(x, p["v_proj"]).reshape(B, T, nkv, hd)
    q = rms_norm(q, p["q_norm"], cfg.rms_norm_eps, cfg.zero_centered_norm)
    k = rms_norm(k, p["k_norm"], cfg.rms_norm_eps, cfg.zero_centered_norm)
    q = rotary(q, positions, cfg.rotary_dim, cfg.rope_theta)
    k = rotary(k, positions, cfg.rotary_dim, cfg.rope_theta)

    write = jax.vmap(lambda cache, new, start: jax.lax.dynamic_update_slice_in_dim(cache, new, start, axis=0))
    k_cache = write(k_cache, k.astype(k_cache.dtype), positions[:, 0])
    v_cache = write(v_cache, v.astype(v_cache.dtype), positions[:, 0])

    L = k_cache.shape[1]
    key_pos = jnp.arange(L)[None, None, :]
    visible = key_pos <= positions[:, :, None]  # [B, T, L]
    if layer_type == SLIDING_ATTENTION:
        visible &= key_pos > positions[:, :, None] - cfg.sliding_window
    groups = nh // nkv
    qg = q.reshape(B, T, nkv, groups, hd)
    scores = jnp.einsum("btkgd,blkd->bkgtl", qg, k_cache.astype(q.dtype)).astype(jnp.float32)
    scores = scores * (hd**-0.5)
    scores = jnp.where(visible[:, None, None], scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1).astype(q.dtype)
    out = jnp.einsum("bkgtl,blkd->btkgd", probs, v_cache.astype(q.dtype)).reshape(B, T, nh * hd)
    if cfg.attn_output_gate:
        out = out * jax.nn.sigmoid(gate)
    return linear(out, p["o_proj"]), k_cache, v_cache


def mlp(p: dict, x: jax.Array) -> jax.Array:
    """SwiGLU: down(silu(gate(x)) * up(x))."""
    return linear(jax.nn.silu(linear(x, p["gate_proj"])) * linear(x, p["up_proj"]), p["down_proj"])


def moe(p: dict, cfg: ModelConfig, x: jax.Array) -> jax.Array:
    """Top-k routed experts plus a sigmoid-gated shared expert (Qwen3-Next / Qwen3.5-MoE).

    Tokens are sorted by expert and run through ``lax.ragged_dot`` so each expert's weights are
    applied only to the tokens routed to it; the results are weighted and summed back per token.
    Expert weights: gate_up [E, H, 2I], down [E, I, H].
    """
    shape = x.shape
    xt = x.reshape(-1, shape[-1])
    n, k, e = xt.shape[0], cfg.num_experts_per_tok, cfg.num_experts
    router_logits = (xt @ p["router"]).astype(jnp.float32)
    probs = jax.nn.softmax(router_logits, axis=-1)
    top_w, top_i = jax.lax.top_k(probs, k)
    if cfg.norm_topk_prob:
        top_w = top_w / jnp.sum(top_w, axis=-1, keepdims=True)
    top_w = top_w.astype(x.dtype)

    flat_expert = top_i.reshape(-1)
    order = jnp.argsort(flat_expert, stable=True)
    token_of = (jnp.arange(n * k) // k)[order]
    group_sizes = jnp.bincount(flat_expert, length=e).astype(jnp.int32)
    xs = xt[token_of]
    gate_up = jax.lax.ragged_dot(xs, p["gate_up"], group_sizes)
    gate, up = jnp.split(gate_up, 2, axis=-1)
    hs = jax.lax.ragged_dot(jax.nn.silu(gate) * up, p["down"], group_sizes)
    hs = hs * top_w.reshape(-1)[order][:, None]
    routed = jax.ops.segment_sum(hs, token_of, num_segments=n)

    shared = mlp(p["shared_expert"], xt) * jax.nn.sigmoid(xt @ p["shared_expert_gate"])
    return (routed + shared).astype(x.dtype).reshape(shape)
