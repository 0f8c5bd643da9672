"""The linear-attention token mixer of the hybrid families: Gated DeltaNet (Qwen3.5, Qwen3.5-MoE,
Qwen3-Next) and Kimi Delta Attention (Kimi-Linear, ``cfg.kda``).

in_proj_qkv -> short causal conv (SiLU) -> split q, k, v -> gated delta rule -> gated RMSNorm with
in_proj_z -> out_proj. Qwen3-Next's fused ``in_proj_qkvz`` / ``in_proj_ba`` are permuted into this
split layout when the checkpoint is loaded (weights/), so there is one forward for both. KDA is the
same pipeline with Kimi's projections (``project``: separate q/k/v projections and convs, loaded as
one; a per-channel decay ``g`` [T, Hv, dk] from a low-rank projection; a low-rank output gate) and a
sigmoid-gated output norm (``output``); the state, the pools, the backends and the kernels are shared.

State lives in a slot pool shared by all GDN layers (``layers.Ragged`` says how rows name slots):
``conv`` [layers, slots, conv_dim, K-1] (the last K-1 conv inputs, oldest first, model dtype) and
``rec`` [layers, slots, Hv, dk, dv] fp32. Two backends touch it, each called from one place:
``_short_conv`` and ``_delta_rule``. Prefill uses the chunked rule aligned to absolute ×64
positions (so a prompt prefilled in pieces computes exactly the chunks one prefill would; in a
mixed step under the scheduler's ``chunked_rows`` promise only the rows of several tokens take it,
``_mixed_rule``), in jnp or on a Mosaic GPU kernel (``prefill_kernel``: ``gdn_chunked``'s recurrence kernel, or the fused
whole-chunk kernels ``gdn_chunk_fused`` / ``kda_chunk_fused`` where named); a decode batch (every
row exactly one token) uses the one-step recurrent form — on a GPU the fused Mosaic GPU kernel
(``pallas_kernels.gdn_decode``), which reads and writes the pool in place (``_decode_in_pool``;
``cfg.kernels`` chooses), elsewhere jnp. The short conv runs on the Mosaic
GPU conv1d kernels (``pallas_kernels.conv1d``, prefill and decode) where ``cfg.kernels`` picks
them (``use_conv_kernel``: under ``auto`` on a GPU since they passed the GPU check).

Invariant 1 lives here: the layer itself writes every snapshot the step asks for, conv AND
recurrent state, in the same scatter as the rows' final states; no caller can forget a layer.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxserve.config import ModelConfig
from jaxserve.models import backends
from jaxserve.models.layers import Ragged, gated_rms_norm, linear
from jaxserve.parallel.layout import split_shards
from pallas_kernels import (conv1d, first_of_each, gdn_chunk_fused, gdn_chunk_prep, gdn_chunked, gdn_decode, gdn_reference,
                            kda_chunk_fused)
from pallas_kernels.conv1d_reference import causal_conv1d_prefill, causal_conv1d_update
from pallas_kernels.gdn_reference import gdn_recurrent
from pallas_kernels.kda_reference import kda_chunked, kda_recurrent


def state_shapes(cfg: ModelConfig, num_layers: int, num_slots: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(conv, rec) pool shapes for ``num_layers`` GDN layers of ``num_slots`` slots each."""
    conv = (num_layers, num_slots, cfg.linear_conv_dim, max(cfg.linear_conv_kernel - 1, 0))
    rec = (num_layers, num_slots, cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim)
    return conv, rec


def _initial(pool: jax.Array, layer: int, r: Ragged) -> jax.Array:
    """Per-row starting state in fp32: zeros for a fresh sequence (``context_len == 0``: a reused
    slot still holds its previous owner's state), else the read slot.

    The gather is materialised behind an optimization barrier: were it fused into a consumer that
    runs after ``_store``'s first scatter (the decode snapshots read ``init``), XLA could not update
    the donated pool in place and would copy the whole pool every layer of every step."""
    init = jax.lax.optimization_barrier(pool[layer, r.read_slot]).astype(jnp.float32)
    fresh = (r.context_len == 0).reshape(-1, *([1] * (init.ndim - 1)))
    return jnp.where(fresh, 0.0, init)


def _decode_snapshots(init, final, r: Ragged):
    """In a decode batch a row has one token, so a snapshot is its state after 0 or 1 tokens."""
    seq = jnp.clip(r.snap_seq, 0, r.num_rows - 1)
    after = (r.snap_len > 0).reshape(-1, *([1] * (init.ndim - 1)))
    return jnp.where(after, final[seq], init[seq])


def _short_conv(cfg: ModelConfig, mixed, weight, init, r: Ragged, decode: bool):
    """Conv backend: mixed [T, C] -> (y [T, C], final [B, C, K-1], snapshots [S, C, K-1])."""
    update, prefill = causal_conv1d_update, causal_conv1d_prefill
    if use_conv_kernel(cfg):
        update = functools.partial(conv1d.causal_conv1d_update_pallas, interpret=backends.interpret(cfg))
        prefill = functools.partial(conv1d.causal_conv1d_prefill_pallas, interpret=backends.interpret(cfg))
    if decode:
        y, final = update(mixed, init, weight)
        return y, final, _decode_snapshots(init, final, r)
    return prefill(mixed, weight, cu_seqlens=r.cu_seqlens, initial_state=init,
                   snapshot_seq=r.snap_seq, snapshot_len=r.snap_len)


def use_conv_kernel(cfg: ModelConfig) -> bool:
    """Static: the short conv (prefill and decode) on Mosaic GPU (``backends``; not yet under auto)."""
    C, K = cfg.linear_conv_dim, cfg.linear_conv_kernel
    return backends.use_kernel(cfg, "conv1d", conv1d.supports(C, K), f"conv_dim={C}, kernel={K}")


def _one_token_rule(q, k, v, g, beta, state):
    """One token of one sequence (vmapped over the decode batch); ``g`` [Hv] (GDN) or [Hv, dk] (KDA)."""
    recurrent = kda_recurrent if g.ndim == 2 else gdn_recurrent
    o, final, _ = recurrent(q[None], k[None], v[None], g[None], beta[None],
                            cu_seqlens=jnp.array([0, 1], jnp.int32), initial_state=state[None])
    return o[0], final[0]


def _delta_rule(cfg: ModelConfig, q, k, v, g, beta, init, r: Ragged, decode: bool):
    """Delta-rule backend: -> (o [T, Hv, dv], final [B, Hv, dk, dv], snapshots [S, Hv, dk, dv])."""
    if decode:
        o, final = jax.vmap(_one_token_rule)(q, k, v, g, beta, init)
        return o, final, _decode_snapshots(init, final, r)
    if cfg.chunked_rows:
        return _mixed_rule(cfg, q, k, v, g, beta, init, r)
    return _chunked_rule(cfg)(q, k, v, g, beta, cu_seqlens=r.cu_seqlens, initial_state=init,
                              start_pos=r.context_len, snapshot_seq=r.snap_seq, snapshot_len=r.snap_len)


def _mixed_rule(cfg: ModelConfig, q, k, v, g, beta, init, r: Ragged):
    """``_delta_rule`` of a mixed / prefill step whose rows of more than one token are at most
    ``cfg.chunked_rows`` (the scheduler's promise): those rows through the chunked rule on a grid of
    ``T // 64 + 2 * chunked_rows`` chunks, the one-token rows (decodes riding along, a prompt's last
    token) by the recurrent rule, as a decode step runs them.

    Why: the chunked rule's grid must hold the worst raggedness its rows can have, each row up to
    two partial chunks (``default_max_chunks``), and its intra-chunk work is paid for every chunk
    of the grid, used or not: with every row a candidate, a 512-token prompt in the 64-row program
    paid for 136 chunks (8,704 token slots) where it uses 8. The results are the unsplit rule's: a
    one-token row's chunk is that token alone, so both forms compute the same recurrence step.

    How: the multi-token rows' tokens are packed to the front in row order and the chunked rule
    sees the one-token rows as empty (their snapshot requests as length 0, so none falls outside
    its row); finals, snapshots and outputs of the one-token rows are then taken from the
    recurrent step. The chunked rule computes only the snapshot entries rows of several tokens can
    ask for (T // 64 + chunked_rows, first in ``Ragged``'s order), not all T // 64 + B."""
    T, B = q.shape[0], r.num_rows
    lens = jnp.diff(r.cu_seqlens)
    one = lens == 1
    lens_m = jnp.where(one, 0, lens)
    cu_m = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(lens_m).astype(jnp.int32)])
    row = jnp.minimum(r.seq, B - 1)
    multi_tok = (r.seq < B) & ~one[row]
    t = jnp.arange(T, dtype=jnp.int32)
    dst = jnp.where(multi_tok, cu_m[row] + t - r.cu_seqlens[row], T + t)  # >= T: dropped, each its own
    # unique destinations, declared: XLA's GPU scatter then stores instead of an atomic per element
    # (a compare-and-swap loop for bf16)
    pack = lambda x: jnp.zeros_like(x).at[dst].set(x, mode="drop", unique_indices=True)  # noqa: E731
    snap_row = jnp.clip(r.snap_seq, 0, B - 1)
    snap_one = one[snap_row]
    rows_m = min(cfg.chunked_rows, B)
    max_chunks = min(T // gdn_chunked.CHUNK + 2 * rows_m, T)
    S, S_m = r.snap_seq.shape[0], min(r.snap_seq.shape[0], T // gdn_chunked.CHUNK + rows_m)  # Ragged: those first
    o_m, final_m, snaps_m = _chunked_rule(cfg)(
        pack(q), pack(k), pack(v), pack(g), pack(beta), cu_seqlens=cu_m, initial_state=init,
        start_pos=r.context_len, snapshot_seq=r.snap_seq[:S_m],
        snapshot_len=jnp.where(snap_one, 0, r.snap_len)[:S_m], max_chunks=max_chunks)
    snaps_m = jnp.concatenate([snaps_m, jnp.zeros((S - S_m, *snaps_m.shape[1:]), snaps_m.dtype)])
    first = jnp.minimum(r.cu_seqlens[:-1], T - 1)  # a one-token row's token
    o_1, final_1 = jax.vmap(_one_token_rule)(q[first], k[first], v[first], g[first], beta[first], init)
    expand = lambda m, x: m.reshape(-1, *([1] * (x.ndim - 1)))  # noqa: E731
    final = jnp.where(expand(one, final_1), final_1, final_m)
    snap_1 = jnp.where(expand(r.snap_len > 0, init), final_1[snap_row], init[snap_row])
    snaps = jnp.where(expand(snap_one, snap_1), snap_1, snaps_m)
    o = jnp.where(expand(multi_tok, o_m), o_m[jnp.minimum(dst, T - 1)], o_1[row].astype(o_m.dtype))
    return o, final, snaps


def _chunked_rule(cfg: ModelConfig):
    """The chunked delta rule ``prefill_kernel`` picks. Every choice has the references' interface:
    g [T, Hv] (GDN) or [T, Hv, dk] (KDA), ragged ``cu_seqlens``, per-row initial states, chunks
    aligned to absolute positions from ``start_pos``, snapshots at ``(snapshot_seq, snapshot_len)``."""
    interpret = backends.interpret(cfg)
    kernel = prefill_kernel(cfg)
    if kernel == "prefill_fused":
        fused = kda_chunk_fused.kda_chunk_fused if cfg.kda else gdn_chunk_fused.gdn_chunk_fused
        return functools.partial(fused, matmul_dtype=FUSED_MATMUL_DTYPE[interpret], interpret=interpret)
    if kernel == "gdn_prefill":
        return functools.partial(gdn_chunked.gdn_chunked_pallas, interpret=interpret)
    if kernel == "prefill_prep":
        return functools.partial(gdn_chunked.gdn_chunked_pallas, prep="kernel", matmul_dtype=FUSED_MATMUL_DTYPE[interpret],
                                 interpret=interpret)
    return kda_chunked if cfg.kda else gdn_reference.gdn_chunked


def use_decode_kernel(cfg: ModelConfig, act_dtype) -> bool:
    """Static: the fused Mosaic GPU decode step (``backends``)."""
    dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
    return backends.use_kernel(cfg, "gdn_decode", gdn_decode.supports(dk, dv, act_dtype),
                               f"dk={dk}, dv={dv} in {jnp.dtype(act_dtype).name}")


# The fused prefill kernels' operand dtype, by interpret mode: bf16 on the GPU (the only one both
# take there; fla's choice), fp32 in the interpreter (which takes it), where the kernels then match
# the jnp path to fp32 rounding.
FUSED_MATMUL_DTYPE = {False: jnp.bfloat16, True: jnp.float32}


def prefill_kernel(cfg: ModelConfig) -> str | None:
    """Static: the kernel of the chunked delta rule of prefill steps (``backends``): ``"prefill_fused"``
    or ``"prefill_prep"`` (only where named; the latter GDN only), ``"gdn_prefill"`` or None (jnp). An explicit choice whose kernel cannot take
    the layer's head dims raises here. ``gdn_prefill``'s fp32 products run as tf32, so ``auto`` leaves
    it out under full-fp32 matmul precision. The fused KDA kernel keeps its accuracy for log-decays
    down to -10 per token and channel (``kda_chunk_fused``); naming it accepts that."""
    dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
    interpret = backends.interpret(cfg)
    fused, mm = (kda_chunk_fused if cfg.kda else gdn_chunk_fused), FUSED_MATMUL_DTYPE[interpret]
    if backends.use_kernel(cfg, "prefill_fused", fused.supports(dk, dv, mm, interpret),
                           f"dk={dk}, dv={dv} with {jnp.dtype(mm).name} operands"):
        return "prefill_fused"
    if backends.use_kernel(cfg, "prefill_prep", not cfg.kda and not gdn_chunk_prep.tiling_problems(dk, dv, mm, interpret),
                           f"{'KDA' if cfg.kda else 'GDN'} dk={dk}, dv={dv} with {jnp.dtype(mm).name} operands"):
        return "prefill_prep"
    full_fp32 = str(jax.config.jax_default_matmul_precision).lower() in ("highest", "float32")
    if backends.use_kernel(cfg, "gdn_prefill", gdn_chunked.supports(dk, dv), f"dk={dk}, dv={dv}",
                           auto_ok=not full_fp32):
        return "gdn_prefill"
    return None


def use_prefill_kernel(cfg: ModelConfig) -> bool:
    """Static: a Mosaic GPU kernel runs prefill's chunked delta rule (``prefill_kernel``). The engine
    calls it at start-up, so an explicit choice that cannot take the layer's shapes fails there."""
    return prefill_kernel(cfg) is not None


def _decode_in_pool(cfg: ModelConfig, q, k, v, g, beta, pool: jax.Array, layer: int, r: Ragged):
    """The decode step by the fused kernel, in place in ``pool`` (its ``_delta_rule`` + ``_store``).

    Rows read ``read_slot`` (zero state when fresh) and write ``write_slot``; the snapshots a
    one-token row can ask for are its state after the token (``snap_len == 1``: read back from
    the write slot) or before it (``snap_len == 0``: gathered from the read slot before the kernel
    runs; the optimization barrier ties that gather ahead of the in-place update). Returns
    (o [B, Hv, dv], pool)."""
    fresh = r.context_len == 0
    S = r.snap_seq.shape[0]
    if S:
        seq = jnp.clip(r.snap_seq, 0, r.num_rows - 1)
        before = jnp.where(fresh[seq].reshape(-1, 1, 1, 1), 0.0, pool[layer, r.read_slot[seq]])
        before, pool = jax.lax.optimization_barrier((before, pool))
    o, pool = gdn_decode.gdn_decode_pool(q, k, v, g, beta, pool, r.read_slot, layer=layer,
                                         write_slots=r.write_slot, fresh=fresh,
                                         interpret=backends.interpret(cfg))
    if S:
        # materialised before the snapshot scatter: a gather from the pool fused into the scatter
        # that updates it made XLA copy the whole pool first (three 3.6 GB copies per scanned
        # period of the real-size model's 2-snapshot decode step on the H100: ~53 ms of its ~62)
        after, pool = jax.lax.optimization_barrier((pool[layer, r.write_slot[seq]], pool))
        snaps = jnp.where((r.snap_len > 0).reshape(-1, 1, 1, 1), after, before)
        pool = _write_slots(pool, layer, r.snap_dst, r.snap_dst > 0, snaps)
    return o, pool


def _write_slots(pool: jax.Array, layer: int, slots: jax.Array, keep: jax.Array, states: jax.Array) -> jax.Array:
    """``pool[layer, slots[i]] = states[i]`` where ``keep[i]``, the first entry only where kept
    entries repeat a slot (a decode batch's padding rows all name the null slot); the others write
    nothing.

    The written slots are then distinct and each dropped entry gets a slot of its own past the
    pool, so the scatter declares ``unique_indices``: XLA's GPU scatter then stores, where with
    possibly repeated slots it updates every element atomically (a compare-and-swap loop for the
    bf16 conv pool)."""
    past = pool.shape[1] + jnp.arange(slots.shape[0], dtype=jnp.int32)  # out of range: skipped
    dst = jnp.where(first_of_each(slots, keep), slots, past)
    return pool.at[layer, dst].set(states.astype(pool.dtype), mode="drop", unique_indices=True)


def _store(pool: jax.Array, layer: int, r: Ragged, final: jax.Array, snaps: jax.Array) -> jax.Array:
    """Final states into the rows' write slots, snapshots into their destinations; nothing else.

    Real rows and snapshots name distinct slots (the host's contract, invariant 2), so the order of
    the writes does not matter. Empty rows (the engine's are a mixed step's padding rows) and
    padding snapshot entries (destination: the null slot 0, which no real row reads) write nothing:
    those are most of a mixed step's B rows and T // 64 + B entries, each write a whole state (2 MiB
    a GDN layer at 32 heads of 128 x 128). Slot 0 stays a real slot where a caller gives it to a
    non-empty row (``decoder.forward``'s rows are slots 0 .. B-1).

    One row (a one-row program, a decode step of one sequence): its state is written in the
    snapshots' scatter. Alone it would be a scatter of one entry, which XLA turns into a
    dynamic-update-slice, whose update and pool must share a layout; the GPU compiler gave the pool
    the layout of the chunk kernel's transposed states: the real-size qwen3_5_moe's one-row
    512-token step transposed the whole recurrent pool (3.6 GB) into that layout before its layers
    and back after, 4.8 of its 24 ms of kernels (H100, 2026-12-07). A scatter keeps the pool's
    layout and moves the transpose onto the states it writes. With more rows the two scatters stay
    apart (joining them would copy the snapshots into one update array)."""
    rows = jnp.diff(r.cu_seqlens) > 0
    if final.shape[0] == 1:
        return _write_slots(pool, layer, jnp.concatenate([r.write_slot, r.snap_dst]),
                            jnp.concatenate([rows, r.snap_dst > 0]),
                            jnp.concatenate([final, snaps.astype(final.dtype)]))
    pool = _write_slots(pool, layer, r.write_slot, rows, final)
    return _write_slots(pool, layer, r.snap_dst, r.snap_dst > 0, snaps)


def project(p: dict, cfg: ModelConfig, x: jax.Array):
    """The input projections of x [T, H]: ``mixed`` [T, conv_dim] (q, k, v before the short conv),
    ``z`` [T, Hv, dv] (the output gate), ``beta`` [T, Hv] and the log-decay ``g``, both fp32:
    [T, Hv] for GDN, per channel [T, Hv, dk] for KDA (low-rank ``f_b(f_a(x))`` plus ``dt_bias``)."""
    T = x.shape[0]
    if cfg.kda:
        h, d = cfg.linear_num_value_heads, cfg.linear_value_head_dim
        mixed = linear(x, p["in_proj_qkv"])
        z = linear(linear(x, p["g_a"]), p["g_b"]).reshape(T, h, d)
        beta = jax.nn.sigmoid(linear(x, p["b"]).astype(jnp.float32))
        f = linear(linear(x, p["f_a"]), p["f_b"]).astype(jnp.float32).reshape(T, h, d)
        a = f + p["dt_bias"].astype(jnp.float32)
        g = -jnp.exp(p["A_log"].astype(jnp.float32))[:, None] * jax.nn.softplus(a)
        return mixed, z, beta, g
    hv = cfg.linear_num_value_heads
    # one product; the pieces cut back out (shard-major under TP: ``mixed`` stays shard-major over q k v)
    mixed, z, b, a = split_shards(linear(x, p["in_proj"]), (cfg.linear_conv_dim, cfg.linear_value_dim, hv, hv))
    z = z.reshape(T, hv, cfg.linear_value_head_dim)
    beta = jax.nn.sigmoid(b.astype(jnp.float32))
    a = a.astype(jnp.float32)
    g = -jnp.exp(p["A_log"].astype(jnp.float32)) * jax.nn.softplus(a + p["dt_bias"].astype(jnp.float32))
    return mixed, z, beta, g


def split_qkv(cfg: ModelConfig, mixed: jax.Array):
    """Split the conv output [T, conv_dim] into q, k [T, Hk, dk] and v [T, Hv, dv]. Under tensor
    parallelism the channels are shard-major (``jaxserve.parallel.layout``)."""
    T, kd = mixed.shape[0], cfg.linear_key_dim
    q, k, v = split_shards(mixed, (kd, kd, cfg.linear_value_dim))
    q = q.reshape(T, cfg.linear_num_key_heads, cfg.linear_key_head_dim)
    k = k.reshape(T, cfg.linear_num_key_heads, cfg.linear_key_head_dim)
    v = v.reshape(T, cfg.linear_num_value_heads, cfg.linear_value_head_dim)
    return q, k, v


def output(p: dict, cfg: ModelConfig, o: jax.Array, z: jax.Array) -> jax.Array:
    """Gated RMSNorm of the delta-rule output o [T, Hv, dv] with z, then out_proj -> [T, H]
    (GDN: norm, weight, silu gate; KDA: the same in fp32 throughout with a sigmoid gate)."""
    o = gated_rms_norm(o, z, p["norm"], cfg.rms_norm_eps, kda=cfg.kda)
    return linear(o.reshape(o.shape[0], -1), p["out_proj"])


def gated_deltanet(p: dict, cfg: ModelConfig, x: jax.Array, r: Ragged, conv_pool: jax.Array, rec_pool: jax.Array,
                   layer: int, decode: bool):
    """x [T, H] ragged (see ``Ragged``); ``layer`` indexes this layer in the slot pools; ``decode``
    (static) means every row has exactly one token, in row order. Returns (y, conv_pool, rec_pool)."""
    with jax.named_scope("project"):
        mixed, z, beta, g = project(p, cfg, x)
    with jax.named_scope("conv"):
        mixed, conv_final, conv_snaps = _short_conv(cfg, mixed, p["conv_w"], _initial(conv_pool, layer, r), r, decode)
    q, k, v = split_qkv(cfg, mixed)
    if decode and use_decode_kernel(cfg, q.dtype):
        o, rec_pool = _decode_in_pool(cfg, q, k, v, g, beta, rec_pool, layer, r)
    else:
        o, rec_final, rec_snaps = _delta_rule(cfg, q, k, v, g, beta, _initial(rec_pool, layer, r), r, decode)
        rec_pool = _store(rec_pool, layer, r, rec_final, rec_snaps)
    conv_pool = _store(conv_pool, layer, r, conv_final, conv_snaps)
    with jax.named_scope("output"):
        return output(p, cfg, o, z), conv_pool, rec_pool
