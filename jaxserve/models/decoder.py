"""The decoder stack every supported family shares: embed -> layers -> norm -> lm_head.

Families differ only in config flags (see jaxserve/config.py): which layers are Gated DeltaNet and
which full attention, gated attention output and zero-centered norms for the hybrids, routed experts
for the MoE variants.

One stack, two ways to reach state:

- ``forward_ragged`` is the stack itself: a flat ragged batch of tokens whose state lives in pools
  (KV pages, linear-state slots) named by a ``layers.Ragged``. The serving runner calls it inside
  its jitted step.
- ``forward`` is the dense per-sequence API (tests, ``jaxserve generate``): ``tokens [B, T]`` with a
  state made by ``init_state`` where row ``b`` owns KV ``[b, 0:max_len]`` and slot ``b``. It views
  that state as pools (a reshape, no copy) and calls ``forward_ragged``, so the tested dense path
  and the serving path are the same code.

State (``Pools``) holds one array per kind, stacked over the layers of that kind (``layer_index``):
attention ``k``/``v`` [n_attn, pages, page_size, kv_heads, head_dim] (dense: [n_attn, B, max_len,
...]), GDN ``conv`` [n_linear, slots, conv_dim, K-1] and ``rec`` [n_linear, slots, Hv, dk, dv] fp32.
Stacking lets one scatter/gather address every layer (restore, snapshot checks) and lets the step
update pools in place when they are donated.
"""

from __future__ import annotations

import math
from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from jaxserve.config import LINEAR_ATTENTION, ModelConfig
from jaxserve.models import gated_deltanet
from jaxserve.models.layers import KEY_BLOCK, Ragged, attention, mlp, moe, rms_norm
from pallas_kernels import token_segments


class Pools(NamedTuple):
    """Model state: KV for attention layers, conv + recurrent state for GDN layers (see module doc).
    A plain-attention model has zero GDN layers, so ``conv``/``rec`` are empty arrays."""

    k: jax.Array
    v: jax.Array
    conv: jax.Array
    rec: jax.Array


class Images(NamedTuple):
    """The image rows one forward scatters into its tokens (issue 25's windowed scatter).

    ``row[t]``: token t's row in ``embeds`` (-1: a text token, which keeps its embedding); the host
    picks the rows of the placeholders inside this forward's window, so a prompt's image embeddings
    reach the model chunk by chunk. ``embeds`` [N >= 1, H] (padding rows are never named);
    ``deepstack`` [k, N, H] is added at the image tokens after text layers 0..k-1 (Qwen3-VL; k may be
    0). ``rope_pos`` [T, 3]: every token's multimodal rotary position (t, h, w)."""

    row: jax.Array
    embeds: jax.Array
    deepstack: jax.Array
    rope_pos: jax.Array


def layer_index(cfg: ModelConfig) -> list[int]:
    """For each layer, its index among the layers of its kind (attention or GDN) in ``Pools``."""
    counts = {True: 0, False: 0}
    out = []
    for layer_type in cfg.layer_types:
        linear = layer_type == LINEAR_ATTENTION
        out.append(counts[linear])
        counts[linear] += 1
    return out


def num_layers_of_kind(cfg: ModelConfig) -> tuple[int, int]:
    """(attention layers, GDN layers)."""
    n_linear = sum(t == LINEAR_ATTENTION for t in cfg.layer_types)
    return cfg.num_layers - n_linear, n_linear


def pool_shapes(cfg: ModelConfig, dtype, kv_lead: tuple[int, int], num_slots: int) -> Pools:
    """``jax.ShapeDtypeStruct`` of every pool. ``kv_lead`` is (pages, page_size) for paged KV or
    (batch, max_len) for the dense state. The conv state keeps the model dtype (its inputs are
    model-dtype activations, so nothing is lost); the recurrent state is fp32 (it accumulates)."""
    n_attn, n_linear = num_layers_of_kind(cfg)
    k = jax.ShapeDtypeStruct((n_attn, *kv_lead, cfg.num_kv_heads, cfg.head_dim), dtype)
    v = jax.ShapeDtypeStruct((n_attn, *kv_lead, cfg.num_kv_heads, cfg.value_head_dim), dtype)  # MLA: != k's
    conv, rec = gated_deltanet.state_shapes(cfg, n_linear, num_slots if n_linear else 0)
    return Pools(k, v, jax.ShapeDtypeStruct(conv, dtype), jax.ShapeDtypeStruct(rec, jnp.float32))


def zeros(shapes: Pools) -> Pools:
    return Pools(*(jnp.zeros(s.shape, s.dtype) for s in shapes))


def init_state(cfg: ModelConfig, batch: int, max_len: int, dtype) -> Pools:
    """Empty dense state for ``batch`` sequences of at most ``max_len`` tokens each."""
    return zeros(pool_shapes(cfg, dtype, (batch, max_len), batch))


def _layer(p: dict, cfg: ModelConfig, i: int, j: int, x: jax.Array, r: Ragged, pools: Pools, decode: bool):
    layer_type = cfg.layer_types[i]
    # The layer's weights pass one barrier with its input, so nothing computed from weights alone
    # (ragged_dot's relaid-out expert weights, 384 MiB a layer at the real size) can be scheduled
    # before the previous layer is done and sit beside every other layer's: the real-size
    # qwen3_5_moe's 32-row decode step on the jnp MoE path needed 9.3 GiB of temporaries, 0.7 with it.
    p, x = jax.lax.optimization_barrier((p, x))
    h = rms_norm(x, p["input_layernorm"], cfg.rms_norm_eps, cfg.zero_centered_norm)
    if layer_type == LINEAR_ATTENTION:
        with jax.named_scope("linear_attn"):  # names the ops in profiles (jaxserve.profiling.hlo_sources)
            h, conv, rec = gated_deltanet.gated_deltanet(p["linear_attn"], cfg, h, r, pools.conv, pools.rec, j, decode)
        pools = pools._replace(conv=conv, rec=rec)
    else:
        with jax.named_scope("self_attn"):
            h, k, v = attention(p["self_attn"], cfg, layer_type, h, r, pools.k, pools.v, j)
        pools = pools._replace(k=k, v=v)
    x = x + h
    h = rms_norm(x, p["post_attention_layernorm"], cfg.rms_norm_eps, cfg.zero_centered_norm)
    with jax.named_scope("moe" if cfg.moe_layers[i] else "mlp"):
        h = moe(p["mlp"], cfg, h) if cfg.moe_layers[i] else mlp(p["mlp"], h)
    return x + h, pools


def _scoped(layer, once: jax.Array, x: jax.Array, pools: Pools):
    """``layer(x, pools=pools)`` as the body of a loop that runs ``once`` (1, hidden from XLA
    behind an optimization barrier, so the loop is not inlined), for the steps with prefill tokens.

    Why: a loop body is a computation of its own, so nothing in one layer is merged with or
    scheduled beside another layer's work, and the step's temporaries are those of one layer at a
    time. Without it, XLA merges the identical constant buffers every layer's mixer starts from
    (the chunked delta rule's zero-filled chunk grids, its scan outputs) into one, gives each layer
    a private copy to write in place, and schedules all those copies before the first layer: in the
    real-size qwen3_5_moe (18 GDN layers) 27 of the 30 GiB an 8192-token step still needed on the
    CPU with the MoE and page-table fixes, growing with depth (benchmarks/RESULTS.md "Step memory";
    tests/engine/test_step_memory.py).
    ``x`` and the pools ride in the carry (the pools stay in place, as in ``paged_attention``).
    The cost: a loop with a runtime trip count (on a GPU, the host reads its predicate per layer).
    Decode steps, whose mixers start from no such constants, run the layers inline."""
    return lax.fori_loop(0, once, lambda _, carry: layer(carry[0], pools=carry[1]), (x, pools))


def forward_ragged(params: dict, cfg: ModelConfig, tokens: jax.Array, r: Ragged, pools: Pools, *, decode: bool,
                   last_only: bool = True, images: Images | None = None):
    """The stack over a flat ragged batch: ``tokens [T]`` laid out as ``r`` says. Not jitted: it is
    traced inside the caller's jit. ``decode`` (static): every row has exactly one token, in row
    order (T == B), which selects the one-step recurrent GDN backend. ``images``: image rows to
    scatter and multimodal rotary positions (``Images``). Returns fp32 logits of each row's last
    token [B, V] (``last_only``; rows without tokens give garbage) or of every token [T, V], and
    the updated pools."""
    x = params["embed"][tokens]
    if images is not None:
        is_image = (images.row >= 0)[:, None]
        rows = jnp.maximum(images.row, 0)
        x = jnp.where(is_image, images.embeds[rows].astype(x.dtype), x)
        r = r._replace(rope_pos=images.rope_pos)
    once = None if decode else lax.optimization_barrier(jnp.int32(1))  # opaque to XLA: see _scoped
    for i, (p, j) in enumerate(zip(params["layers"], layer_index(cfg))):
        layer = partial(_layer, p, cfg, i, j, r=r, decode=decode)
        x, pools = layer(x, pools=pools) if decode else _scoped(layer, once, x, pools)
        if images is not None and i < images.deepstack.shape[0]:
            x = x + jnp.where(is_image, images.deepstack[i][rows].astype(x.dtype), 0)
    if last_only:
        x = x[jnp.maximum(r.cu_seqlens[1:] - 1, 0)]
    x = rms_norm(x, params["norm"], cfg.rms_norm_eps, cfg.zero_centered_norm)
    lm_head = params["embed"].T if cfg.tie_word_embeddings else params["lm_head"]
    with jax.named_scope("lm_head"):
        return (x @ lm_head).astype(jnp.float32), pools


def make_ragged(positions, cu_seqlens, context_len, page_table, read_slot, write_slot,
                snap_seq=None, snap_len=None, snap_dst=None) -> Ragged:
    """A ``Ragged`` with each token's row derived from ``cu_seqlens`` (no snapshots if None)."""
    seq, _ = token_segments(cu_seqlens, positions.shape[0])
    if snap_seq is None:
        snap_seq = snap_len = snap_dst = jnp.zeros((0,), jnp.int32)
    return Ragged(positions, cu_seqlens, seq, context_len, page_table, read_slot, write_slot,
                  snap_seq, snap_len, snap_dst)


@partial(jax.jit, static_argnames=("cfg", "last_only"), donate_argnames=("state",))
def forward(params: dict, cfg: ModelConfig, tokens: jax.Array, positions: jax.Array, state: Pools,
            last_only: bool = False, images: Images | None = None):
    """Run ``tokens`` [B, T] at absolute ``positions`` [B, T] (consecutive per row, continuing
    where ``state`` left off). ``images``: as ``forward_ragged`` takes them, with ``row`` [B, T] and
    ``rope_pos`` [B, T, 3]. Returns fp32 logits [B, T, V] (or [B, V] with ``last_only``) and
    the new state. ``state`` is donated: the caller must use the returned one.

    The dense state viewed as pools: row ``b``'s KV ``[b, 0:max_len]`` is pages
    ``b * max_len / ps + [0, max_len / ps)`` with ``ps = gcd(max_len, 64)`` (so key blocks are
    whole pages); its GDN state is slot ``b``, read and written in place.
    """
    B, T = tokens.shape
    n_attn, _ = num_layers_of_kind(cfg)
    _, _, max_len, kvh, hd = state.k.shape
    ps = math.gcd(max_len, KEY_BLOCK)
    per_row = max_len // ps
    width = -(-per_row // (KEY_BLOCK // ps)) * (KEY_BLOCK // ps)
    cols = jnp.arange(width, dtype=jnp.int32)
    page_table = jnp.where(cols < per_row, jnp.arange(B, dtype=jnp.int32)[:, None] * per_row + cols, 0)
    rows = jnp.arange(B, dtype=jnp.int32)
    r = make_ragged(positions.reshape(-1).astype(jnp.int32), jnp.arange(B + 1, dtype=jnp.int32) * T,
                    positions[:, 0].astype(jnp.int32), page_table, rows, rows)
    paged = state._replace(k=state.k.reshape(n_attn, B * per_row, ps, kvh, hd),
                           v=state.v.reshape(n_attn, B * per_row, ps, kvh, state.v.shape[-1]))
    if images is not None:
        images = images._replace(row=images.row.reshape(-1), rope_pos=images.rope_pos.reshape(-1, 3))
    logits, paged = forward_ragged(params, cfg, tokens.reshape(-1), r, paged, decode=T == 1, last_only=last_only,
                                   images=images)
    new_state = paged._replace(k=paged.k.reshape(state.k.shape), v=paged.v.reshape(state.v.shape))
    return (logits if last_only else logits.reshape(B, T, -1)), new_state
