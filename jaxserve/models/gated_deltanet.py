"""The Gated DeltaNet token mixer of the hybrid families (Qwen3.5, Qwen3.5-MoE, Qwen3-Next).

in_proj_qkv -> short causal conv (SiLU) -> split q, k, v -> gated delta rule -> gated RMSNorm with
in_proj_z -> out_proj. Qwen3-Next's fused ``in_proj_qkvz`` / ``in_proj_ba`` are permuted into this
split layout when the checkpoint is loaded (weights/), so there is one forward for both.

The state of a sequence in this layer is explicit: ``conv`` [B, conv_dim, K-1] (the last K-1
conv inputs, oldest first) and ``rec`` [B, Hv, dk, dv] fp32. Prefill uses the chunked form
aligned to absolute ×64 positions (so a prompt prefilled in pieces computes exactly the chunks
one prefill would); a single-token step uses the recurrent form.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxserve.config import ModelConfig
from jaxserve.models.layers import gated_rms_norm, linear
from pallas_kernels.conv1d_reference import causal_conv1d_prefill, causal_conv1d_update
from pallas_kernels.gdn_reference import gdn_chunked, gdn_recurrent


def init_state(cfg: ModelConfig, batch: int, dtype) -> dict:
    return {
        "conv": jnp.zeros((batch, cfg.linear_conv_dim, cfg.linear_conv_kernel - 1), dtype),
        "rec": jnp.zeros(
            (batch, cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim), jnp.float32
        ),
    }


def gated_deltanet(p: dict, cfg: ModelConfig, x: jax.Array, positions: jax.Array, state: dict):
    """x: [B, T, H]; positions: [B, T] absolute, consecutive per row. Returns (y, new_state)."""
    B, T, _ = x.shape
    hk, hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
    mixed = linear(x, p["in_proj_qkv"])
    z = linear(x, p["in_proj_z"]).reshape(B, T, hv, dv)
    beta = jax.nn.sigmoid(linear(x, p["in_proj_b"]).astype(jnp.float32))
    a = linear(x, p["in_proj_a"]).astype(jnp.float32)
    g = -jnp.exp(p["A_log"].astype(jnp.float32)) * jax.nn.softplus(a + p["dt_bias"].astype(jnp.float32))

    if T == 1:
        mixed, conv_state = causal_conv1d_update(mixed[:, 0], state["conv"], p["conv_w"])
        mixed = mixed[:, None]
    else:
        cu = jnp.arange(B + 1, dtype=jnp.int32) * T
        flat, conv_state, _ = causal_conv1d_prefill(
            mixed.reshape(B * T, -1), p["conv_w"], cu_seqlens=cu, initial_state=state["conv"]
        )
        mixed = flat.reshape(B, T, -1)

    kd = cfg.linear_key_dim
    q = mixed[..., :kd].reshape(B * T, hk, dk)
    k = mixed[..., kd : 2 * kd].reshape(B * T, hk, dk)
    v = mixed[..., 2 * kd :].reshape(B * T, hv, dv)
    g, beta = g.reshape(B * T, hv), beta.reshape(B * T, hv)
    cu = jnp.arange(B + 1, dtype=jnp.int32) * T
    if T == 1:
        o, rec, _ = gdn_recurrent(q, k, v, g, beta, cu_seqlens=cu, initial_state=state["rec"])
    else:
        o, rec, _ = gdn_chunked(
            q, k, v, g, beta, cu_seqlens=cu, initial_state=state["rec"], start_pos=positions[:, 0].astype(jnp.int32)
        )
    o = gated_rms_norm(o.reshape(B, T, hv, dv), z, p["norm"], cfg.rms_norm_eps)
    y = linear(o.reshape(B, T, hv * dv), p["out_proj"])
    return y, {"conv": conv_state.astype(state["conv"].dtype), "rec": rec}
