"""Building blocks shared by every family: norms, rotary embedding, attention, MLP, MoE.

Pure functions over arrays. Activations keep the parameter dtype between blocks; reductions
(norms, softmax, router) run in fp32, as the torch implementations do.

Every block works on a FLAT ragged batch of tokens ``[T, ...]`` (see ``Ragged``): the serving
step packs many sequences into one call, and the dense per-sequence forward of ``decoder`` is
the special case of equal-length rows. State is reached only through ``Ragged``'s indices into
pools (KV pages for attention, linear-state slots for Gated DeltaNet), so the layer math exists
once and only the mixer backends (``paged_attention`` here, the conv / delta-rule backends of
gated_deltanet.py) touch state. Kernels replace those backends, nothing else.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

from jaxserve.config import SLIDING_ATTENTION, SNAPSHOT_INTERVAL, ModelConfig
from jaxserve.models import backends
from jaxserve.parallel.layout import AXIS, shards, split_shards
from pallas_kernels import linear_small as linear_small_kernel
from pallas_kernels import moe as moe_kernel
from pallas_kernels import paged_attention as paged_attention_kernel

# Keys are visited in blocks of this many positions. It is the snapshot interval of ARCHITECTURE.md
# invariant 1, so a block is whole pages for every legal page size (64 % page_size == 0).
KEY_BLOCK = SNAPSHOT_INTERVAL


class Ragged(NamedTuple):
    """How the ``T`` flat tokens of one forward map onto ``B`` sequences and their pooled state.

    Token ``t`` belongs to row ``seq[t]`` (``B`` for bucket padding past ``cu_seqlens[-1]``) and
    sits at absolute position ``positions[t]``; row ``b`` owns tokens ``[cu_seqlens[b],
    cu_seqlens[b+1])`` at positions ``context_len[b]..``, consecutive.

    Attention layers: row ``b``'s position ``p`` lives in page ``page_table[b, p // page_size]`` at
    offset ``p % page_size``. Entries past the row's pages are 0, the null page, never read
    unmasked: a decode batch's padding rows write there, a prefill's padding tokens nowhere.

    Gated DeltaNet layers: row ``b`` starts from slot ``read_slot[b]`` (its own slot, or the tree
    snapshot it restores from; ignored, zero state, when ``context_len[b] == 0``) and leaves its
    final state in ``write_slot[b]``. Snapshot ``s`` stores the state after ``snap_len[s]`` tokens
    of row ``snap_seq[s]`` in slot ``snap_dst[s]`` (ARCHITECTURE.md invariants 1 and 2). Padding rows and
    padding snapshot entries name slot 0, the null slot. Under ``ModelConfig.chunked_rows`` the entries
    of rows of more than one token come first (``runner.make_batch`` orders them so; at most T // 64
    + chunked_rows of them, the ×64 boundaries such rows can cross).
    """

    positions: jax.Array    # [T] int32
    cu_seqlens: jax.Array   # [B+1] int32
    seq: jax.Array          # [T] int32, row of each token (B = padding)
    context_len: jax.Array  # [B] int32
    page_table: jax.Array   # [B, W] int32, W a multiple of KEY_BLOCK // page_size
    read_slot: jax.Array    # [B] int32
    write_slot: jax.Array   # [B] int32
    snap_seq: jax.Array     # [S] int32
    snap_len: jax.Array     # [S] int32
    snap_dst: jax.Array     # [S] int32
    # Multimodal rotary positions (t, h, w) of each token [T, 3] (``ModelConfig.mrope_section``);
    # None: ``positions`` on every axis. Pages and the causal mask always use ``positions``.
    rope_pos: jax.Array | None = None

    @property
    def num_rows(self) -> int:
        return self.cu_seqlens.shape[0] - 1


def rms_norm(x: jax.Array, weight: jax.Array, eps: float, zero_centered: bool) -> jax.Array:
    """RMSNorm in fp32. Zero-centered (Qwen3.5/Next) scales by ``1 + w`` before the cast back;
    the plain form (Qwen3) casts back first, then scales by ``w``: the two families round differently
    in bf16 and we follow each."""
    xf = x.astype(jnp.float32)
    normed = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    if zero_centered:
        return (normed * (1.0 + weight.astype(jnp.float32))).astype(x.dtype)
    return weight * normed.astype(x.dtype)


def gated_rms_norm(x: jax.Array, gate: jax.Array, weight: jax.Array, eps: float, kda: bool = False) -> jax.Array:
    """The GDN output norm: RMSNorm(x) * w, then * silu(gate) in fp32 (norm before gate). KDA's
    (Kimi-Linear's ``RMSNormGated``): no cast back between norm and weight, a sigmoid gate."""
    xf = x.astype(jnp.float32)
    normed = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    if kda:
        return (weight.astype(jnp.float32) * normed * jax.nn.sigmoid(gate.astype(jnp.float32))).astype(x.dtype)
    out = (weight * normed.astype(x.dtype)).astype(jnp.float32) * jax.nn.silu(gate.astype(jnp.float32))
    return out.astype(x.dtype)


def rotary(x: jax.Array, positions: jax.Array, rotary_dim: int, theta: float,
           mrope_section: tuple[int, ...] = ()) -> jax.Array:
    """Rotate-half RoPE on the first ``rotary_dim`` channels of each head; the rest pass through.

    x: [..., heads, head_dim]; positions: [...], or [..., 3] multimodal (t, h, w) positions, each
    frequency turning by the axis ``mrope_section`` gives it (``ModelConfig.mrope_section``). Text
    tokens have t = h = w, where the multimodal form reduces exactly to the plain one.
    """
    half = rotary_dim // 2
    inv_freq = 1.0 / (theta ** (jnp.arange(0, rotary_dim, 2, dtype=jnp.float32) / rotary_dim))
    if positions.ndim == x.ndim - 1:  # [..., 3]
        freq = np.arange(half)
        axis = np.where((freq % 3 == 1) & (freq < 3 * mrope_section[1]), 1,
                        np.where((freq % 3 == 2) & (freq < 3 * mrope_section[2]), 2, 0))
        freqs = positions.astype(jnp.float32)[..., axis] * inv_freq  # [..., half], axis chosen per frequency
    else:
        freqs = positions.astype(jnp.float32)[..., None] * inv_freq  # [..., half]
    cos = jnp.cos(freqs).astype(x.dtype)[..., None, :]
    sin = jnp.sin(freqs).astype(x.dtype)[..., None, :]
    x1, x2, rest = x[..., :half], x[..., half:rotary_dim], x[..., rotary_dim:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], axis=-1)


class SmallLinear(NamedTuple):
    """Marks a projection for the decode-step kernel (``pallas_kernels.linear_small``): set by the
    decoder (``small_linears``) on a decode step's weights dicts whose ``w`` it tiles. ``layer``:
    with ``w`` the whole stack ``[L, K, N]`` of the decoder's scan, the row to multiply by (the
    kernel reads it in place; a sliced row would be copied out)."""

    interpret: bool
    layer: jax.Array | None = None


def linear(x: jax.Array, p: dict) -> jax.Array:
    """``x @ w (+ b)``; weights are stored [in, out] (transposed from HF at load time). A dict
    marked ``small`` (``SmallLinear``) runs the decode-step kernel for up to its row limit."""
    small = p.get("small")
    if small is None:
        y = x @ p["w"]
    elif x.ndim == 2 and x.shape[0] <= linear_small_kernel.MAX_ROWS:
        y = linear_small_kernel.linear_small(x, p["w"], small.layer, interpret=small.interpret)
    else:
        y = x @ (p["w"] if small.layer is None else lax.dynamic_index_in_dim(p["w"], small.layer, keepdims=False))
    return y + p["b"] if "b" in p else y


def small_linears(p, cfg: ModelConfig, act_dtype, stack=None, layer: jax.Array | None = None):
    """``p`` (a layer's weights, or any tree of weights dicts) with every projection the decode-step
    kernel tiles marked ``small`` (``SmallLinear``): on decode steps where the ``linear`` kernel is
    chosen (``backends``), one device. ``stack``/``layer``: the decoder's scan, ``p`` being row
    ``layer`` of ``stack`` (same structure): a marked dict gets the stack's ``w`` and the row."""
    if not use_small_linear(cfg, act_dtype):
        return p
    interpret = backends.interpret(cfg)

    def mark(d, s):
        if isinstance(d, dict) and "w" in d and getattr(d["w"], "ndim", 0) == 2:
            K, N = d["w"].shape
            if d["w"].dtype == act_dtype and linear_small_kernel.fits(K, N, act_dtype):
                if s is None:
                    return {**d, "small": SmallLinear(interpret)}
                return {**d, "w": s["w"], "small": SmallLinear(interpret, layer)}
            return d
        if isinstance(d, dict):
            return {k: mark(v, None if s is None else s[k]) for k, v in d.items()}
        return d

    return mark(p, stack)


def use_small_linear(cfg: ModelConfig, act_dtype) -> bool:
    """Static: decode steps' projections through ``pallas_kernels.linear_small`` (backend name
    ``linear``)? bf16 / fp16 on the GPU (any dtype under interpretation); one device only (under a
    tensor-parallel mesh the weights are split and XLA partitions the dot)."""
    if shards() > 1:
        return False
    gpu_dtype = jnp.dtype(act_dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
    return backends.use_kernel(cfg, "linear", gpu_dtype or backends.interpret(cfg),
                               f"{jnp.dtype(act_dtype).name} activations")


# ----------------------------------------------------------------------------------------------
# Attention: projections + rope (in), the paged mixer backend, output gate + projection (out).
# ----------------------------------------------------------------------------------------------


MLA_NORM_EPS = 1e-6  # Kimi-Linear's q_a / kv_a layernorms keep RMSNorm's default eps, not the config's


def mla_in(p: dict, cfg: ModelConfig, x: jax.Array):
    """Multi-head latent attention's q, k, v (Kimi-Linear: no rotary anywhere). x [T, H] -> q, k
    [T, nh, nope + rope] and v [T, nh, v_dim]: the latent ``kv_a_proj_with_mqa(x)`` is a normed
    [kv_lora] part, expanded per head by ``kv_b_proj`` into k_nope and v, and a [rope] part shared
    by every head as the rest of its key."""
    T, nh = x.shape[0], cfg.num_heads
    nope, rope, lora = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.kv_lora_rank
    if cfg.q_lora_rank:
        q = linear(rms_norm(linear(x, p["q_a_proj"]), p["q_a_layernorm"], MLA_NORM_EPS, False), p["q_b_proj"])
    else:
        q = linear(x, p["q_proj"])
    latent = linear(x, p["kv_a_proj_with_mqa"])
    kv = linear(rms_norm(latent[:, :lora], p["kv_a_layernorm"], MLA_NORM_EPS, False), p["kv_b_proj"])
    kv = kv.reshape(T, nh, nope + cfg.v_head_dim)
    k = jnp.concatenate([kv[..., :nope], jnp.broadcast_to(latent[:, None, lora:], (T, nh, rope))], axis=-1)
    return q.reshape(T, nh, nope + rope), k, kv[..., nope:]


def attention_in(p: dict, cfg: ModelConfig, x: jax.Array, positions: jax.Array):
    """q/k/v projections, q/k norm, partial RoPE. x [T, H] -> q [T, nh, hd], k/v [T, kvh, hd],
    and the sigmoid output gate's pre-activation [T, nh*hd] (None when the family has none).
    Under MLA (``mla_in``) v's last dim is ``v_head_dim``."""
    if cfg.is_mla:
        return (*mla_in(p, cfg, x), None)
    T = x.shape[0]
    nh, nkv, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    q = linear(x, p["q_proj"])
    gate = None
    if cfg.attn_output_gate:
        q = q.reshape(T, nh, 2 * hd)
        q, gate = q[..., :hd], q[..., hd:].reshape(T, nh * hd)
    q = q.reshape(T, nh, hd)
    k = linear(x, p["k_proj"]).reshape(T, nkv, hd)
    v = linear(x, p["v_proj"]).reshape(T, nkv, hd)
    q = rms_norm(q, p["q_norm"], cfg.rms_norm_eps, cfg.zero_centered_norm)
    k = rms_norm(k, p["k_norm"], cfg.rms_norm_eps, cfg.zero_centered_norm)
    q = rotary(q, positions, cfg.rotary_dim, cfg.rope_theta, cfg.mrope_section)
    k = rotary(k, positions, cfg.rotary_dim, cfg.rope_theta, cfg.mrope_section)
    return q, k, v, gate


def attention_out(p: dict, cfg: ModelConfig, out: jax.Array, gate: jax.Array | None) -> jax.Array:
    """Output gate (hybrid families) and o_proj. out [T, nh*hd] -> [T, H]."""
    if gate is not None:
        out = out * jax.nn.sigmoid(gate)
    return linear(out, p["o_proj"])


def paged_attention(q, k, v, k_pool, v_pool, layer: int, r: Ragged, window: int | None, blocked_rows: int = 0):
    """The attention mixer backend: write the new keys/values into their pages, then causal GQA of
    every token over its row's pages. Returns (out [T, nh*hd], k_pool, v_pool).

    q [T, nh, hd]; k, v [T, kvh, hd]; pools [layers, num_pages, page_size, kvh, hd].

    Write first, read second: a token sees the cached context and the new tokens of its own row
    through the same page table, so a prompt prefilled in chunks (at any offsets) sees exactly
    what one prefill would. Padding tokens write nothing or the null page (``write_kv``); pages that no new
    token maps to are untouched (the scatter names only the written (page, offset) pairs).

    Keys are visited ``KEY_BLOCK`` positions at a time, only up to the batch's furthest position,
    with an online (flash-style) fp32 softmax, so memory is O(T · KEY_BLOCK), not O(T · context).
    A key is visible iff ``key_pos <= query_pos`` (and within ``window`` for sliding layers);
    masked values are zeroed before use so whatever the null page holds never reaches a real row.

    Each query gathers the key blocks it reads, so a prefill of T tokens moved T copies of its
    context. ``blocked_rows`` (static; the engine's ``ModelConfig.chunked_rows`` promise that at
    most that many rows hold more than one token): such rows' tokens go in query blocks of
    ``KEY_BLOCK`` tokens of one row, which gather each key block once for the 64; one-token rows
    stay one query each. Same results (the same fp32 online softmax per query).
    """
    T, nh, hd = q.shape
    nkv, vd = k.shape[1], v.shape[-1]  # vd != hd under MLA
    n_rows = r.num_rows
    row = jnp.minimum(r.seq, n_rows - 1)
    real = r.seq < n_rows
    # Page ids are gathered per token only where needed (the written page; one key block's pages
    # in the loop), never each token's whole row, [T, W]: 512 MiB at T = 8192 and a 256k-token
    # page table (benchmarks/RESULTS.md "Step memory").
    k_pool, v_pool = paged_attention_kernel.write_kv(k, v, k_pool, v_pool, layer, r)

    groups = nh // nkv
    n_blocks = jnp.max(r.positions) // KEY_BLOCK + 1
    if not blocked_rows:  # every token its own query unit
        out, k_pool, v_pool = _attend(q.reshape(T, 1, nkv, groups, hd), r.positions[:, None], row, real, r.page_table,
                                      k_pool, v_pool, layer, n_blocks, window, vd)
        return out.astype(q.dtype).reshape(T, nh * vd), k_pool, v_pool
    # rows of several tokens in query blocks of KEY_BLOCK tokens of one row (at most T // 64 + rows
    # of them), each block gathering a key block once; one-token rows one query each
    lens = jnp.diff(r.cu_seqlens)
    multi = lens > 1
    per_row = jnp.where(multi, (lens + KEY_BLOCK - 1) // KEY_BLOCK, 0)
    blk_end = jnp.cumsum(per_row)
    NQ = T // KEY_BLOCK + min(blocked_rows, n_rows)
    blk = jnp.arange(NQ, dtype=jnp.int32)
    blk_row = jnp.minimum(jnp.searchsorted(blk_end, blk, side="right"), n_rows - 1).astype(jnp.int32)
    local = (blk - (blk_end - per_row)[blk_row])[:, None] * KEY_BLOCK + jnp.arange(KEY_BLOCK, dtype=jnp.int32)
    used = (blk < blk_end[-1])[:, None] & (local < lens[blk_row][:, None])  # [NQ, KB]
    tok = jnp.where(used, r.cu_seqlens[blk_row][:, None] + local, 0)
    q_blk = q[tok].reshape(NQ, KEY_BLOCK, nkv, groups, hd)
    out_blk, k_pool, v_pool = _attend(q_blk, jnp.where(used, r.positions[tok], -1), blk_row, used.any(axis=1),
                                      r.page_table, k_pool, v_pool, layer, n_blocks, window, vd)
    first = jnp.minimum(r.cu_seqlens[:-1], T - 1)
    out_one, k_pool, v_pool = _attend(q[first].reshape(n_rows, 1, nkv, groups, hd), r.positions[first][:, None],
                                      jnp.arange(n_rows, dtype=jnp.int32), lens == 1, r.page_table, k_pool, v_pool,
                                      layer, n_blocks, window, vd)
    mine = r.seq < n_rows
    at = jnp.arange(T, dtype=jnp.int32) - r.cu_seqlens[row]  # a token's index in its row
    tok_blk = jnp.clip((blk_end - per_row)[row] + at // KEY_BLOCK, 0, NQ - 1)
    from_blk = out_blk[tok_blk, at % KEY_BLOCK]
    out = jnp.where((mine & multi[row])[:, None, None], from_blk, out_one[row, 0])
    return out.astype(q.dtype).reshape(T, nh * vd), k_pool, v_pool


def _attend(qg, q_pos, unit_row, unit_valid, page_table, k_pool, v_pool, layer, n_blocks, window, vd):
    """Online-softmax attention of ``N`` query units of ``L`` queries each (``qg [N, L, kvh, g, d]``
    at positions ``q_pos [N, L]``; a query at position -1 sees nothing) over the pages of row
    ``unit_row[n]`` (the null page where ``unit_valid`` is False), ``KEY_BLOCK`` keys at a time: each
    unit gathers a key block once for its L queries. Returns (fp32 out [N, L, kvh * g, vd], pools)."""
    N, L, nkv, groups, hd = qg.shape
    page_size = k_pool.shape[2]
    block_pages = KEY_BLOCK // page_size
    neg = jnp.float32(-1e30)  # finite: a fully masked block must not make exp(-inf - -inf) = nan

    def block(j, carry):
        m, l, acc, k_pool, v_pool = carry
        ids = lax.dynamic_slice_in_dim(page_table, j * block_pages, block_pages, axis=1)  # [B, bp]
        ids = jnp.where(unit_valid[:, None], ids[unit_row], 0)  # [N, bp]; padding -> null page
        kb = k_pool[layer, ids].reshape(N, KEY_BLOCK, nkv, hd)
        vb = v_pool[layer, ids].reshape(N, KEY_BLOCK, nkv, vd)
        k_pos = j * KEY_BLOCK + jnp.arange(KEY_BLOCK)
        visible = k_pos[None, None, :] <= q_pos[:, :, None]  # [N, L, KB]
        if window is not None:
            visible &= k_pos[None, None, :] > q_pos[:, :, None] - window
        # values no query of the unit sees are zeroed: whatever the null page holds never reaches a real row
        vb = jnp.where(visible.any(axis=1)[:, :, None, None], vb, 0).astype(qg.dtype)
        s = jnp.einsum("nqkgd,nlkd->nqkgl", qg, kb.astype(qg.dtype), preferred_element_type=jnp.float32)
        s = jnp.where(visible[:, :, None, None, :], s * (hd**-0.5), neg)
        m_new = jnp.maximum(m, jnp.max(s, axis=-1))
        p = jnp.exp(s - m_new[..., None])
        scale = jnp.exp(m - m_new)
        l = l * scale + jnp.sum(p, axis=-1)
        pv = jnp.einsum("nqkgl,nlkd->nqkgd", p.astype(qg.dtype), vb, preferred_element_type=jnp.float32)
        return m_new, l, acc * scale[..., None] + pv, k_pool, v_pool

    # The pools ride in the loop carry, unchanged, and the loop's outputs are used afterwards: a
    # pool merely closed over would stay live beside the loop's own copy, and XLA would copy the
    # whole pool (every layer's KV) per layer per step.
    init = (jnp.full((N, L, nkv, groups), neg), jnp.zeros((N, L, nkv, groups), jnp.float32),
            jnp.zeros((N, L, nkv, groups, vd), jnp.float32), k_pool, v_pool)
    _, l, acc, k_pool, v_pool = lax.fori_loop(0, n_blocks, block, init)
    return (acc / l[..., None]).reshape(N, L, nkv * groups, vd), k_pool, v_pool


def attention(p: dict, cfg: ModelConfig, layer_type: str, x: jax.Array, r: Ragged, k_pool: jax.Array,
              v_pool: jax.Array, layer: int, decode: bool = False):
    """Causal GQA with q/k norm, partial RoPE and (hybrid families) a sigmoid output gate, over
    paged KV. x [T, H]; ``layer`` indexes this layer in the pools. Returns (y, k_pool, v_pool)."""
    q, k, v, gate = attention_in(p, cfg, x, r.positions if r.rope_pos is None else r.rope_pos)
    window = cfg.sliding_window if layer_type == SLIDING_ATTENTION else None
    if use_attention_kernel(cfg, q.dtype, k_pool.shape[2]):
        out, k_pool, v_pool = paged_attention_kernel.paged_attention(
            q, k, v, k_pool, v_pool, layer, r, window, interpret=backends.interpret(cfg))
    else:
        out, k_pool, v_pool = paged_attention(q, k, v, k_pool, v_pool, layer, r, window,
                                              blocked_rows=0 if decode else cfg.chunked_rows)
    return attention_out(p, cfg, out, gate), k_pool, v_pool


def use_attention_kernel(cfg: ModelConfig, act_dtype, page_size: int) -> bool:
    """Static: the Mosaic GPU paged kernel (``pallas_kernels.paged_attention``) or ``paged_attention``
    above (``backends``)."""
    gpu = not backends.interpret(cfg)
    fits = (cfg.value_head_dim == cfg.head_dim
            and paged_attention_kernel.supports(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, page_size, act_dtype, gpu=gpu))
    return backends.use_kernel(cfg, "paged_attention", fits, f"{cfg.num_heads} q / {cfg.num_kv_heads} kv heads of "
                               f"dim {cfg.head_dim}, page size {page_size}, {jnp.dtype(act_dtype).name}",
                               auto_ok=cfg.head_dim in paged_attention_kernel.AUTO_HEAD_DIMS)


# ----------------------------------------------------------------------------------------------
# Channel mixers.
# ----------------------------------------------------------------------------------------------


def mlp(p: dict, x: jax.Array) -> jax.Array:
    """SwiGLU: down(silu(gate(x)) * up(x)). ``gate_up_proj`` [in, 2I] holds gate's columns, then
    up's (shard-major under TP), so both come from one product, cut apart here."""
    gate_up = linear(x, p["gate_up_proj"])
    inter = gate_up.shape[-1] // 2
    gate, up = split_shards(gate_up, (inter, inter))
    return linear(jax.nn.silu(gate) * up, p["down_proj"])


def route(p: dict, cfg: ModelConfig, xt: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array | None]:
    """(weights [n, k] fp32, expert ids [n, k], the shared expert's gate logit [n, 1] or None) of
    each token. ``router`` is [H, E], or [H, E + 1] with ``shared_expert_gate`` (Qwen): the gate's
    column last, so one product gives both (params.py). Qwen: softmax over the experts, top-k,
    optionally renormalised. Kimi-Linear (``router_scoring == "sigmoid"``, DeepSeek-V3's scheme):
    sigmoid scores in fp32; the choice adds the per-expert bias and keeps only the ``topk_groups``
    groups whose two best biased scores sum highest; the weights are the unbiased scores of the
    chosen experts, renormalised (``norm_topk_prob``) and scaled."""
    k, e = cfg.num_experts_per_tok, cfg.num_experts
    sigmoid = cfg.router_scoring == "sigmoid"
    logits = xt.astype(jnp.float32) @ p["router"].astype(jnp.float32) if sigmoid else xt @ p["router"]
    logits, gate = logits[:, :e], (logits[:, e:] if cfg.shared_expert_gate else None)
    if not sigmoid:
        # the top-k of softmax(logits) are those of the logits (softmax is monotonic), and renormalised
        # they are the softmax of the k chosen logits: no softmax over every expert (a decode step's
        # MoE layer ran two softmax kernels, over E and over k, where this runs one over k)
        logits = logits.astype(jnp.float32)
        top_l, top_i = jax.lax.top_k(logits, k)
        if cfg.norm_topk_prob:
            return jax.nn.softmax(top_l, axis=-1), top_i, gate
        return jnp.exp(top_l - jax.nn.logsumexp(logits, axis=-1, keepdims=True)), top_i, gate
    n, G = xt.shape[0], cfg.num_expert_groups
    scores = jax.nn.sigmoid(logits)
    choice = scores + p["router_bias"].astype(jnp.float32)
    group_best = jax.lax.top_k(choice.reshape(n, G, e // G), 2)[0].sum(-1)  # [n, G]
    _, groups = jax.lax.top_k(group_best, cfg.topk_groups)
    kept = jnp.zeros((n, G), bool).at[jnp.arange(n)[:, None], groups].set(True)
    choice = jnp.where(jnp.repeat(kept, e // G, axis=1), choice, -jnp.inf)
    _, top_i = jax.lax.top_k(choice, k)
    top_w = jnp.take_along_axis(scores, top_i, axis=1)
    if cfg.norm_topk_prob:
        top_w = top_w / (jnp.sum(top_w, axis=-1, keepdims=True) + 1e-20)
    return top_w * cfg.routed_scaling_factor, top_i, gate


def moe(p: dict, cfg: ModelConfig, x: jax.Array) -> jax.Array:
    """Top-k routed experts (``route``) plus a shared expert: sigmoid-gated (Qwen3-Next /
    Qwen3.5-MoE) or not (Kimi-Linear).

    The routed experts run through ``routed_experts`` (``lax.ragged_dot``, the reference; a block
    of tokens at a time, ``routed_experts_blocked``), on each device's own experts under expert
    parallelism (``expert_parallel``), or the Mosaic GPU grouped GEMM
    (``pallas_kernels.moe.moe_experts``, ``use_moe_kernel``), which reads only the experts the
    tokens use. Expert weights: gate_up [E, H, 2I], down [E, I, H].
    """
    shape = x.shape
    xt = x.reshape(-1, shape[-1])
    with jax.named_scope("route"):
        top_w, top_i, gate = route(p, cfg, xt)
    if cfg.expert_parallel:
        routed = expert_parallel(xt, top_w.astype(x.dtype), top_i, p["gate_up"], p["down"])
    elif use_moe_kernel(cfg, x.dtype):
        stacked = "stack_row" in p  # the decoder's scan: the stack of layers' experts, this layer's rows
        routed = moe_kernel.moe_experts(xt, top_w, top_i, p["gate_up"], p["down"],
                                        num_experts=cfg.num_experts if stacked else None,
                                        stack_row=p.get("stack_row"), interpret=backends.interpret(cfg))
    else:
        routed = routed_experts_blocked(xt, top_w.astype(x.dtype), top_i, p["gate_up"], p["down"])

    with jax.named_scope("shared_expert"):
        shared = mlp(p["shared_expert"], xt)
        if gate is not None:
            shared = shared * jax.nn.sigmoid(gate)
    return (routed + shared).astype(x.dtype).reshape(shape)


def expert_parallel(xt: jax.Array, top_w: jax.Array, top_i: jax.Array, gate_up: jax.Array,
                    down: jax.Array) -> jax.Array:
    """``routed_experts_blocked`` with the experts split by id over the ambient mesh's ``"tp"`` axis
    (device ``d`` holds experts ``[d * E/n, (d+1) * E/n)``, ``jaxserve.parallel.tensor``), under
    ``shard_map``.

    The tokens and their routing are replicated (every device routes every token); each device
    renames its own experts' ids to ``0 .. E/n - 1`` and every other id to ``E/n``, which
    ``routed_experts`` drops (only the device's own pairs are counted in the group sizes and
    multiplied; the dropped pairs' weights are zeroed as well), runs ``routed_experts_blocked`` on
    its shard of the weights, and a ``psum`` adds the devices' partial sums. No device reads
    another's expert weights; the one collective is the all-reduce of the ``[n, H]`` result, as a
    row-parallel projection's. A token's slots are summed in another order than on one device (per
    device, then across), so results agree with one device's to rounding.

    The jnp path only: the Pallas kernels do not run under tensor parallelism
    (``TensorParallel.configure``)."""
    def local(xt, top_w, top_i, gate_up, down):
        held = gate_up.shape[0]
        first = lax.axis_index(AXIS) * held
        mine = (top_i >= first) & (top_i < first + held)
        part = routed_experts_blocked(xt, jnp.where(mine, top_w, 0), jnp.where(mine, top_i - first, held),
                                      gate_up, down)
        return lax.psum(part, AXIS)

    return jax.shard_map(local, in_specs=(P(), P(), P(), P(AXIS), P(AXIS)), out_specs=P())(
        xt, top_w, top_i, gate_up, down)


def routed_experts(xt: jax.Array, top_w: jax.Array, top_i: jax.Array, gate_up: jax.Array,
                   down: jax.Array) -> jax.Array:
    """``Σ_s top_w[t, s] * expert_{top_i[t, s]}(xt[t])`` with ``lax.ragged_dot``: the (token, expert)
    pairs are sorted by expert (stable) so each expert's weights apply only to its rows; the
    results are weighted and summed back per token (``segment_sum``). In ``xt.dtype``, rounded after
    every op (the reference the kernel is tested against).

    Ids ``>= E`` are dropped: ``bincount`` leaves them out of the group sizes and the sort puts
    them last, past every group, where ``ragged_dot`` gives zero rows."""
    n, k, e = xt.shape[0], top_i.shape[1], gate_up.shape[0]
    flat_expert = top_i.reshape(-1)
    order = jnp.argsort(flat_expert, stable=True)
    token_of = (jnp.arange(n * k) // k)[order]
    group_sizes = jnp.bincount(flat_expert, length=e).astype(jnp.int32)
    xs = xt[token_of]
    inter = down.shape[1]
    gate, up = split_shards(jax.lax.ragged_dot(xs, gate_up, group_sizes), (inter, inter))  # shard-major under TP
    hs = jax.lax.ragged_dot(jax.nn.silu(gate) * up, down, group_sizes)
    hs = hs * top_w.reshape(-1)[order][:, None]
    return jax.ops.segment_sum(hs, token_of, num_segments=n)


# XLA lowers ``lax.ragged_dot`` to dense work over every expert (pallas_kernels/moe.py says so of the
# GPU); on the CPU it is one dense dot whose operand is the rows expanded over every expert,
# [rows, E * K] (masked), beside a copy of the weights as [E * K, N]. At the real-size qwen3_5_moe
# (E = 64, H = 2048, top-8) that is 2 MiB per token for the gate/up product: 16 GiB for an
# 8192-token prefill. ``routed_experts_blocked`` runs the tokens through ``routed_experts`` a block
# at a time, so at most this many bytes of the expansion exist at once (benchmarks/step_memory.py).
MOE_EXPANSION_BYTES = 256 << 20


def moe_token_block(num_experts: int, top_k: int, hidden: int, intermediate: int, itemsize: int) -> int:
    """Tokens per block of ``routed_experts_blocked``: the largest power of two whose dense
    ``ragged_dot`` expansion (top_k rows per token, each over all experts' contracted dims) fits
    ``MOE_EXPANSION_BYTES``; at least 16."""
    per_token = max(1, top_k * num_experts * max(hidden, intermediate) * itemsize)  # >= 1: the loop ends
    block = 16
    while 2 * block * per_token <= MOE_EXPANSION_BYTES:
        block *= 2
    return block


def routed_experts_blocked(xt: jax.Array, top_w: jax.Array, top_i: jax.Array, gate_up: jax.Array,
                           down: jax.Array, block: int | None = None) -> jax.Array:
    """``routed_experts`` over blocks of ``block`` tokens (default ``moe_token_block``), one block
    at a time (``lax.map``), so the memory of ``ragged_dot``'s dense expansion is bounded by the
    block, not the step. The same numbers: each token's result depends only on its own row and its
    experts. A batch of at most ``block`` tokens (every decode step) is one plain call."""
    n, k = top_i.shape
    if block is None:
        block = moe_token_block(gate_up.shape[0], k, xt.shape[1], down.shape[1], jnp.dtype(xt.dtype).itemsize)
    if n <= block:
        return routed_experts(xt, top_w, top_i, gate_up, down)
    nb = -(-n // block)
    pad = nb * block - n  # padding tokens: zero rows, weight 0, expert 0; their results are dropped

    def blocks(a):
        return jnp.pad(a, ((0, pad), (0, 0))).reshape(nb, block, a.shape[1])

    out = lax.map(lambda a: routed_experts(*a, gate_up, down), (blocks(xt), blocks(top_w), blocks(top_i)))
    return out.reshape(nb * block, -1)[:n]


def use_moe_kernel(cfg: ModelConfig, act_dtype) -> bool:
    """Static: the Mosaic GPU grouped GEMM (``pallas_kernels.moe``) or ``routed_experts`` above
    (``backends``). The kernel takes bf16 / fp16 on the GPU (fp32 under interpretation) and hidden /
    expert intermediate sizes its tiles divide (``moe_kernel.supports``)."""
    fits = moe_kernel.supports(cfg.hidden_size, cfg.moe_intermediate_size, act_dtype,
                               gpu=not backends.interpret(cfg))
    return backends.use_kernel(cfg, "moe", fits, f"hidden {cfg.hidden_size}, expert intermediate "
                               f"{cfg.moe_intermediate_size}, {jnp.dtype(act_dtype).name}")
