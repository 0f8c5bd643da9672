"""The decoder stack every supported family shares: embed -> layers -> norm -> lm_head.

Families differ only in config flags (see jaxserve/config.py): which layers are Gated DeltaNet and
which full attention, gated attention output and zero-centered norms for the hybrids, routed experts
for the MoE variants. ``forward`` is pure: params and the explicit per-sequence state go in, logits
and the new state come out. State per layer:

- attention layer: ``{"k", "v"}`` each [B, max_len, kv_heads, head_dim], written at the positions
  of the new tokens;
- Gated DeltaNet layer: ``{"conv", "rec"}`` (see gated_deltanet.py).
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp

from jaxserve.config import LINEAR_ATTENTION, ModelConfig
from jaxserve.models import gated_deltanet
from jaxserve.models.layers import attention, mlp, moe, rms_norm


def init_state(cfg: ModelConfig, batch: int, max_len: int, dtype) -> list[dict]:
    """Empty state for ``batch`` sequences of at most ``max_len`` tokens each."""
    state = []
    for layer_type in cfg.layer_types:
        if layer_type == LINEAR_ATTENTION:
            state.append(gated_deltanet.init_state(cfg, batch, dtype))
        else:
            shape = (batch, max_len, cfg.num_kv_heads, cfg.head_dim)
            state.append({"k": jnp.zeros(shape, dtype), "v": jnp.zeros(shape, dtype)})
    return state


def _layer(p: dict, cfg: ModelConfig, i: int, x: jax.Array, positions: jax.Array, s: dict):
    layer_type = cfg.layer_types[i]
    h = rms_norm(x, p["input_layernorm"], cfg.rms_norm_eps, cfg.zero_centered_norm)
    if layer_type == LINEAR_ATTENTION:
        h, s = gated_deltanet.gated_deltanet(p["linear_attn"], cfg, h, positions, s)
    else:
        h, k, v = attention(p["self_attn"], cfg, layer_type, h, positions, s["k"], s["v"])
        s = {"k": k, "v": v}
    x = x + h
    h = rms_norm(x, p["post_attention_layernorm"], cfg.rms_norm_eps, cfg.zero_centered_norm)
    h = moe(p["mlp"], cfg, h) if cfg.moe_layers[i] else mlp(p["mlp"], h)
    return x + h, s


@partial(jax.jit, static_argnames=("cfg", "last_only"), donate_argnames=("state",))
def forward(params: dict, cfg: ModelConfig, tokens: jax.Array, positions: jax.Array, state: list[dict],
            last_only: bool = False):
    """Run ``tokens`` [B, T] at absolute ``positions`` [B, T] (consecutive per row, continuing
    where ``state`` left off). Returns fp32 logits [B, T, V] (or [B, V] with ``last_only``) and
    the new state. ``state`` is donated: the caller must use the returned one."""
    x = params["embed"][tokens]
    new_state = []
    for i, (p, s) in enumerate(zip(params["layers"], state)):
        x, s = _layer(p, cfg, i, x, positions, s)
        new_state.append(s)
    if last_only:
        x = x[:, -1]
    x = rms_norm(x, params["norm"], cfg.rms_norm_eps, cfg.zero_centered_norm)
    lm_head = params["embed"].T if cfg.tie_word_embeddings else params["lm_head"]
    return (x @ lm_head).astype(jnp.float32), new_state
