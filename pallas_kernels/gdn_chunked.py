"""GDN / KDA chunked prefill (chunk 64) on a ragged batch: jnp intra-chunk prep + a Pallas Mosaic GPU
kernel for the sequential state recurrence (sm_90).

Same contract and results as ``gdn_reference.gdn_chunked`` / ``kda_reference.kda_chunked``: ragged
tokens (``cu_seqlens``), one initial state per sequence, chunks aligned to ABSOLUTE multiples of 64
(``start_pos``: a sequence resumed at position 37 has a first chunk of 27 tokens, so a prompt
prefilled in pieces computes the same chunks and its chunk ends are the radix cache's ×64 snapshot
boundaries, ARCHITECTURE.md invariant 1), the final state of every sequence and the states at the
requested ``(snapshot_seq, snapshot_len)`` boundaries.

Split of the work (first version):

* **jnp (XLA)**, parallel over every chunk and head: q/k normalisation, the chunk grid
  (``kda_reference.chunk_layout``) and the UT transform (``chunk_terms``: with
  ``A = strictly-lower(beta K Kᵀ ⊙ decay)`` and ``T = (I + A)⁻¹``, ``u = T (beta v)``,
  ``w = T (beta k exp G)``, the causal decayed scores ``qk``, ``q exp G``, ``k exp(G_last - G)``
  and ``exp G_last``). The reference's own helpers, except that ``T`` is formed by 16-row block
  inversion and applied by matmuls (``unit_lower_inverse``) instead of the reference's row-by-row
  solve against all right-hand sides.
* **Mosaic GPU**: one program per (sequence, value head, ``block_dv`` columns of the state) walks
  the sequence's chunks in order with the state in registers (fp32, WGMMA layout) and per chunk::

      v_new = u - w S                      # [64, dv]
      o     = (q exp G) S + qk v_new       # [64, dv]
      S     = exp(G_last) S + (k exp(G_last - G))ᵀ v_new

  every product on the tensor cores (WGMMA; the o and state-update products are issued together). The program holds the TRANSPOSED state
  ``Sᵀ [block_dv, dk]`` and computes ``v_newᵀ``, ``oᵀ`` and ``S_newᵀ``: fp32 (tf32) WGMMA needs
  both SMEM operands K-major, and in the transposed form every operand is K-major as stored
  (``Sᵀ`` and ``v_newᵀ`` are written row-major from registers; ``w``, ``q exp G``, ``qk`` and the
  pre-transposed ``(k exp(G_last - G))ᵀ`` come by TMA). The next chunk's copy into a buffer is
  issued as soon as every thread is done with the current chunk's use of that buffer (a
  warpgroup barrier after its last WGMMA or register load), so the copies of chunk c+1 overlap
  the rest of chunk c. One buffer per operand (no ring): fp32 operands fill ~192 KiB of SMEM.
  When a chunk end is a requested state (a snapshot boundary or the sequence's end), the program
  writes ``Sᵀ`` to that request's row of a compact ``[R, Hv, dv, dk]`` output (R = sequences +
  snapshot requests; requests for the same chunk share a row), so no per-chunk state is stored.

The KDA per-channel gate goes through the same kernel: only the final decay ``exp(G_last)`` of a
chunk touches the state directly, a ``[dk]`` vector per (chunk, head) instead of a scalar.

Precision: the state is carried and stored in fp32. The WGMMA operands are ``matmul_dtype``:
fp32 (default) runs as tf32 on the GPU (~3e-4 relative); bf16 halves SMEM and copy bytes at
bf16-operand accuracy (what fla's kernels do). Under interpretation (CPU) the products are fp32.

Contract: ``dk % 64 == 0``, ``dv % block_dv == 0`` with ``block_dv % 64 == 0`` (WGMMA M),
``chunk_size == 64``, SMEM within 227 KiB (``block_dv=64`` at ``dk=128``). Tokens past
``cu_seqlens[-1]`` are padding (output 0).

On the GPU, ``benchmarks/gpu_check.py --suites chunked`` checks it (GDN and KDA, ragged, every
boundary snapshotted, bf16 and fp32); it is the default GPU prefill path (``jaxserve.models.backends``).
Speed: ``benchmarks/RESULTS.md`` ("Chunked prefill"): faster than the XLA reference, slower than
fla's Triton kernel; the intra-chunk terms (XLA) are the part to move on chip.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.kda_reference import (
    ChunkTerms,
    _decayed_scores,
    _from_grid,
    _mm,
    _prepare,
    _snapshot_valid,
    _to_grid,
    _unit_lower_solve,
    chunk_layout,
    l2norm,
    prepare_chunked_args,
)

CHUNK = 64
_SWIZZLE = 128


def _transforms(dtype):
    elems = _SWIZZLE // jnp.dtype(dtype).itemsize
    return (plgpu.TilingTransform((8, elems)), plgpu.SwizzleTransform(_SWIZZLE))


def unit_lower_inverse(A, block=16, precision=lax.Precision.HIGHEST):
    """``(I + A)⁻¹`` for strictly lower ``A [..., C, C]``: forward substitution inside the 16-row
    diagonal blocks, then pairwise merges of block-triangular halves,
    ``[[T1, 0], [A21, T2]]⁻¹ = [[T1, 0], [-T2 A21 T1, T2]]`` (16 -> 32 -> 64), fla's ``solve_tril``
    scheme. The reference's row-by-row solve of ``[C, dk + dv]`` right-hand sides reads the whole
    right-hand side once per row (64 passes over ~2 GiB at 64k tokens, 32 heads); this reads
    ``[C, C]`` blocks 16 times and finishes with a few batched matmuls."""
    C = A.shape[-1]
    lead = A.shape[:-2]

    def blocks(s):  # [..., C/s, C/s, s, s]: block (r, c) of size s
        return jnp.moveaxis(A.reshape(*lead, C // s, s, C // s, s), -3, -2)

    n = C // block
    diag = blocks(block)[..., jnp.arange(n), jnp.arange(n), :, :]
    inv = _unit_lower_solve(diag, jnp.broadcast_to(jnp.eye(block, dtype=A.dtype), diag.shape), precision)
    s = block
    while s < C:
        m = C // s
        a21 = blocks(s)[..., jnp.arange(1, m, 2), jnp.arange(0, m, 2), :, :]
        t1, t2 = inv[..., 0::2, :, :], inv[..., 1::2, :, :]
        off = -_mm("...ij,...jk,...kl->...il", t2, a21, t1, precision=precision)
        inv = jnp.concatenate([jnp.concatenate([t1, jnp.zeros_like(t1)], -1),
                               jnp.concatenate([off, t2], -1)], -2)
        s *= 2
    return inv[..., 0, :, :]


def chunk_terms(q, k, v, g, beta, precision=lax.Precision.HIGHEST) -> ChunkTerms:
    """``kda_reference._chunk_terms`` (same quantities, same math) with ``T = (I + A)⁻¹`` formed by
    ``unit_lower_inverse`` and applied to ``beta v`` and ``beta k exp G`` as batched matmuls.
    ``precision`` of every product: HIGHEST (fp32, the reference's) or None (the configured default:
    TF32 tensor cores on the GPU unless the user set ``jax_default_matmul_precision``)."""
    G = jnp.cumsum(g, axis=-2)
    A = beta[..., :, None] * _decayed_scores(k, k, G, inclusive=False, precision=precision)
    t = unit_lower_inverse(A, precision=precision)
    G_last = G[..., -1:, :]
    return ChunkTerms(
        u=_mm("...ij,...jd->...id", t, beta[..., None] * v, precision=precision),
        w=_mm("...ij,...jd->...id", t, beta[..., None] * k * jnp.exp(G), precision=precision),
        qk=_decayed_scores(q, k, G, inclusive=True, precision=precision),
        q_decayed=q * jnp.exp(G),
        k_decayed=k * jnp.exp(G_last - G),
        decay_last=jnp.exp(G_last[..., 0, :]),
    )


def _products(*groups):
    """For each ``(pairs, shape)`` group, ``Σ a @ b`` over its ``pairs`` of SMEM operands on the
    tensor cores into a fresh fp32 accumulator. All groups' WGMMAs are issued before any result is
    read back (the read waits for them), so independent products overlap on the tensor cores.
    Always fresh accumulators, never accumulating into a carried value: the GPU interpreter has no
    rule for the discharged WGMMA that ``run_state`` produces."""
    def fn(*accs):
        for acc, (pairs, _) in zip(accs, groups):
            for a, b in pairs:
                plgpu.wgmma(acc, a, b)
        return tuple(acc[...] for acc in accs)

    return pl.run_scoped(fn, *(plgpu.ACC(shape, jnp.float32) for _, shape in groups))


def _kernel(first_ref, nchunks_ref, slot_ref, dl_ref, init_ref, w_ref, qd_ref, kdt_ref, ut_ref, qk_ref,
            ot_ref, st_ref,
            st_smem, s_smem, w_smem, qd_smem, kd_smem, u_smem, qk_smem, vn_smem, o_smem, g_smem, bars,
            *, block_dv, per_channel_gate, mm_dtype):
    """One (sequence, value head, dv tile): walk the sequence's chunks carrying ``Sᵀ`` in registers."""
    n = lax.axis_index("n")
    h = lax.axis_index("h")
    j = lax.axis_index("j")
    c0 = first_ref[n]
    nc = nchunks_ref[n]
    cols = pl.ds(j * block_dv, block_dv)
    init_bar, w_bar, qd_bar, kd_bar, u_bar, qk_bar, g_bar = (bars.at[i] for i in range(7))
    tile = plgpu.Layout.WGMMA
    C = w_smem.shape[0]
    dk = w_smem.shape[1]

    def issue_w(c):
        plgpu.copy_gmem_to_smem(w_ref.at[c, h], w_smem, w_bar)

    def issue_o_operands(c):
        plgpu.copy_gmem_to_smem(qd_ref.at[c, h], qd_smem, qd_bar)
        plgpu.copy_gmem_to_smem(qk_ref.at[c, h], qk_smem, qk_bar)

    def issue_u(c):
        plgpu.copy_gmem_to_smem(ut_ref.at[c, h, cols], u_smem, u_bar)

    def issue_state_operands(c):
        plgpu.copy_gmem_to_smem(kdt_ref.at[c, h], kd_smem, kd_bar)
        if per_channel_gate:
            plgpu.copy_gmem_to_smem(dl_ref.at[c, h], g_smem, g_bar)

    def first(c):
        issue_w(c)
        issue_u(c)

    def second(c):
        issue_o_operands(c)
        issue_state_operands(c)

    def chunk(c, more, s):
        if not per_channel_gate:
            decay = dl_ref[c, h]
        # The previous chunk's o / state stores must have read their SMEM before it is rewritten
        # (the wait ends with a warpgroup barrier).
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
        s_smem[...] = s.astype(mm_dtype)
        plgpu.commit_smem()

        # v_newᵀ = uᵀ - Sᵀ wᵀ
        plgpu.barrier_wait(w_bar)
        (ws,) = _products(([(s_smem, w_smem.T)], (block_dv, C)))
        plgpu.barrier_wait(u_bar)
        vn = plgpu.load(u_smem, layout=tile) - ws
        vn_smem[...] = vn.astype(mm_dtype)
        # Every next-chunk copy is issued (by one thread) only after a commit_smem, whose
        # warpgroup barrier guarantees all 128 threads are done reading the buffer it overwrites.
        plgpu.commit_smem()

        @pl.when(more)
        def _():
            first(c + 1)

        # oᵀ = Sᵀ (q exp G)ᵀ + v_newᵀ qkᵀ  and  v_newᵀ (k exp(G_last - G)), issued together
        plgpu.barrier_wait(qd_bar)
        plgpu.barrier_wait(qk_bar)
        plgpu.barrier_wait(kd_bar)
        o, kv = _products(([(s_smem, qd_smem.T), (vn_smem, qk_smem.T)], (block_dv, C)),
                          ([(vn_smem, kd_smem.T)], (block_dv, dk)))
        # S_newᵀ = exp(G_last) Sᵀ + v_newᵀ (k exp(G_last - G))
        if per_channel_gate:
            plgpu.barrier_wait(g_bar)
            decay = plgpu.load(g_smem, layout=tile.reduce(0))
            decay = lax.broadcast_in_dim(decay, (block_dv, dk), [1])
        return o, decay * s + kv

    _walk_chunks(c0, nc, slot_ref, st_ref.shape[0], init_src=init_ref.at[n, h, cols], st_smem=st_smem,
                 init_bar=init_bar, first=first, second=second, chunk=chunk, o_smem=o_smem,
                 o_dst=lambda c: ot_ref.at[c, h, cols], st_dst=lambda slot: st_ref.at[slot, h, cols])


def _walk_chunks(c0, nc, slot_ref, num_rows, *, init_src, st_smem, init_bar, first, second, chunk, o_smem, o_dst,
                 st_dst):
    """The recurrence kernels' walk over a sequence's ``nc`` chunks from ``c0`` (``_kernel``,
    ``_kernel_natural``): the initial state from ``init_src`` through ``st_smem`` into registers,
    the first chunk's copies (``first`` then ``second``), then per chunk ``chunk(c, more, s) -> (o,
    S_new)`` (which issues ``first(c + 1)`` once its first operands are read), ``o`` and (where the
    chunk's end is a requested state, ``slot_ref[c] < num_rows``) ``S_new`` staged and committed,
    the next chunk's ``second`` copies issued, and both stored to ``o_dst(c)`` / ``st_dst(slot)``,
    left in flight until the next chunk's first wait."""
    plgpu.copy_gmem_to_smem(init_src, st_smem, init_bar)

    @pl.when(nc > 0)
    def _():
        first(c0)
        second(c0)

    plgpu.barrier_wait(init_bar)
    s0 = plgpu.load(st_smem, layout=plgpu.Layout.WGMMA)

    def body(i, s):
        c = c0 + i
        more = i + 1 < nc
        slot = slot_ref[c]  # scalar GMEM loads first: their latency hides behind the WGMMAs
        snap = slot < num_rows
        o, s_new = chunk(c, more, s)
        o_smem[...] = o

        @pl.when(snap)
        def _():
            st_smem[...] = s_new

        plgpu.commit_smem()

        @pl.when(more)
        def _():
            second(c + 1)

        plgpu.copy_smem_to_gmem(o_smem, o_dst(c))

        @pl.when(snap)
        def _():
            plgpu.copy_smem_to_gmem(st_smem, st_dst(slot))

        return s_new

    lax.fori_loop(0, nc, body, s0)
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def _kernel_natural(first_ref, nchunks_ref, slot_ref, dl_ref, init_ref, w_ref, qd_ref, kd_ref, u_ref, qk_ref,
                    o_ref, st_ref,
                    st_smem, s_smem, w_smem, qd_smem, kd_smem, u_smem, qk_smem, vn_smem, o_smem, bars,
                    *, block_dv, mm_dtype):
    """``_kernel`` for ``gdn_chunk_prep``'s terms (GDN, 16-bit operands on the GPU), carrying the state
    as it is stored, ``S [dk, block_dv]``, instead of ``Sᵀ``: with 16-bit operands WGMMA takes
    N-major and transposed SMEM operands, so ``S`` itself can be the accumulator and the initial
    state, the requested states and ``o`` move in the contract's layouts (no transposes around the
    kernel). Per chunk::

        v_new = u - w S                               # [64, block_dv]
        o     = (q e^G) S + qk v_new                  # [64, block_dv]
        S     = e^(G_last) S + (k e^(G_last - G))ᵀ v_new  # [dk, block_dv]: kd read transposed
    """
    n, h, j = (lax.axis_index(axis) for axis in ("n", "h", "j"))
    c0 = first_ref[n]
    nc = nchunks_ref[n]
    cols = pl.ds(j * block_dv, block_dv)
    init_bar, w_bar, qd_bar, kd_bar, u_bar, qk_bar = (bars.at[i] for i in range(6))
    tile = plgpu.Layout.WGMMA
    C, dk = w_smem.shape

    def issue_w(c):
        plgpu.copy_gmem_to_smem(w_ref.at[c, h], w_smem, w_bar)

    def issue_u(c):
        plgpu.copy_gmem_to_smem(u_ref.at[c, h, :, cols], u_smem, u_bar)

    def issue_rest(c):
        plgpu.copy_gmem_to_smem(qd_ref.at[c, h], qd_smem, qd_bar)
        plgpu.copy_gmem_to_smem(qk_ref.at[c, h], qk_smem, qk_bar)
        plgpu.copy_gmem_to_smem(kd_ref.at[c, h], kd_smem, kd_bar)

    def first(c):
        issue_w(c)
        issue_u(c)

    def chunk(c, more, s):
        decay = dl_ref[c, h]
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the previous chunk's stores read o / st_smem
        s_smem[...] = s.astype(mm_dtype)
        plgpu.commit_smem()

        plgpu.barrier_wait(w_bar)
        (ws,) = _products(([(w_smem, s_smem)], (C, block_dv)))
        plgpu.barrier_wait(u_bar)
        vn_smem[...] = (plgpu.load(u_smem, layout=tile) - ws).astype(mm_dtype)
        plgpu.commit_smem()  # every thread is done with w and u: the next chunk's may land

        @pl.when(more)
        def _():
            first(c + 1)

        plgpu.barrier_wait(qd_bar)
        plgpu.barrier_wait(qk_bar)
        plgpu.barrier_wait(kd_bar)
        o, kv = _products(([(qd_smem, s_smem), (qk_smem, vn_smem)], (C, block_dv)),
                          ([(kd_smem.T, vn_smem)], (dk, block_dv)))
        return o, decay * s + kv

    _walk_chunks(c0, nc, slot_ref, st_ref.shape[0], init_src=init_ref.at[n, h, :, cols], st_smem=st_smem,
                 init_bar=init_bar, first=first, second=issue_rest, chunk=chunk, o_smem=o_smem,
                 o_dst=lambda c: o_ref.at[c, h, :, cols], st_dst=lambda slot: st_ref.at[slot, h, :, cols])


def _layout_requests(layout, cu_seqlens, snapshot_seq, snapshot_len, max_chunks, chunk_size):
    """Requested states (finals then snapshots) -> the chunk whose end holds each, and the output
    row each chunk writes (``R`` = none). Requests for the same chunk share the first one's row."""
    num_seqs = cu_seqlens.shape[0] - 1
    lens = jnp.diff(cu_seqlens)
    req_seq = jnp.concatenate([jnp.arange(num_seqs, dtype=jnp.int32), jnp.clip(snapshot_seq, 0, num_seqs - 1)])
    req_len = jnp.concatenate([lens, snapshot_len])
    num_rows = req_seq.shape[0]
    chunk = layout.first_chunk[req_seq] + (layout.offset[req_seq] + req_len - 1) // chunk_size
    has_chunk = (req_len > 0) & (chunk >= 0) & (chunk < max_chunks)
    chunk = jnp.where(has_chunk, chunk, max_chunks)
    slot_of_chunk = jnp.full((max_chunks,), num_rows, jnp.int32).at[chunk].min(
        jnp.arange(num_rows, dtype=jnp.int32), mode="drop")
    row = jnp.where(has_chunk, slot_of_chunk[jnp.minimum(chunk, max_chunks - 1)], num_rows)
    return req_seq, row, slot_of_chunk


PREP_PRECISIONS = {"highest": lax.Precision.HIGHEST, "default": None}
PREPS = ("xla", "kernel")  # who computes the intra-chunk terms: XLA (chunk_terms) or gdn_chunk_prep


def chunk_kernel(body, scratch, *, num_seqs, num_rows, max_chunks, Hv, dv, dk, block_dv, interpret, name="delta_chunk",
                 transposed=True):
    """The chunked kernels' launch (this module's and ``gdn_chunk_fused`` / ``kda_chunk_fused``): one
    program per (sequence ``n``, value head ``h``, ``block_dv`` state columns ``j``); outputs ``oᵀ``
    on the chunk grid ``[max_chunks, Hv, dv, 64]`` and the compact transposed requested states
    ``[num_rows, Hv, dv, dk]``, both fp32 (``gather_states`` turns them into the contract's results);
    with ``transposed=False`` (``_kernel_natural``) ``o [max_chunks, Hv, 64, dv]`` and states
    ``[num_rows, Hv, dk, dv]``, the contract's own layouts."""
    f32 = jnp.float32
    o_shape, st_shape = ((max_chunks, Hv, dv, CHUNK), (num_rows, Hv, dv, dk)) if transposed else \
        ((max_chunks, Hv, CHUNK, dv), (num_rows, Hv, dk, dv))
    return plgpu.kernel(
        body,
        kernel_name=name,
        out_type=(jax.ShapeDtypeStruct(o_shape, f32), jax.ShapeDtypeStruct(st_shape, f32)),
        grid=(num_seqs, Hv, dv // block_dv),
        grid_names=("n", "h", "j"),
        scratch_types=scratch,
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane),
        interpret=plgpu.InterpretGPUParams() if interpret else False,
    )


def gather_states(ot, states_t, layout, req_seq, row, initial_state, cu_seqlens, snapshot_seq, snapshot_len,
                  start_pos, transposed=True):
    """``chunk_kernel``'s ``oᵀ`` grid and compact transposed states (``transposed=False``: ``o`` and
    the states as they are) -> ``(o [T, Hv, dv] fp32, final, snapshots)``: requests without a chunk
    (length 0) take the initial state, unavailable ones NaN."""
    num_seqs = cu_seqlens.shape[0] - 1
    num_rows = req_seq.shape[0]
    flip = (lambda x: jnp.swapaxes(x, -1, -2)) if transposed else (lambda x: x)  # noqa: E731
    o = _from_grid(flip(ot), layout)
    states = flip(jnp.take(states_t, jnp.minimum(row, num_rows - 1), axis=0))
    states = jnp.where((row < num_rows)[:, None, None, None], states, initial_state[req_seq])
    final, snaps = states[:num_seqs], states[num_seqs:]
    valid = _snapshot_valid(cu_seqlens, snapshot_seq, snapshot_len, start_pos, CHUNK)
    return o, final, jnp.where(valid[:, None, None, None], snaps, jnp.nan)


def run_chunked(impl, q, k, v, g, beta, *, gate, cu_seqlens, initial_state, snapshot_seq, snapshot_len, start_pos,
                max_chunks, **static):
    """The chunked kernels' public entry after their own checks: the references' argument handling
    (``prepare_chunked_args``, given the gate in its ``[T, Hv, dk | 1]`` form ``gate``), then the
    jitted ``impl`` (which takes ``g`` in the kernel's own form) with ``static`` keywords; ``o`` back
    in ``v``'s dtype and no snapshots when none were asked for."""
    cu, snap_seq, snap_len, start, init, max_chunks = prepare_chunked_args(
        q, k, v, gate, beta, cu_seqlens, initial_state, snapshot_seq, snapshot_len, start_pos, CHUNK, max_chunks)
    o, final, snaps = impl(q, k, v, g, beta, cu, init, snap_seq, snap_len, start, max_chunks=max_chunks, **static)
    return o.astype(v.dtype), final, (None if snapshot_seq is None else snaps)


def normalized_qk(q, k, scale, use_qk_l2norm):
    """q and k in fp32, L2-normalised if asked, q then scaled (by ``dk ** -0.5`` unless ``scale``
    says), keeping their ``Hk`` heads: what the kernels that read q and k raw do to them first."""
    q, k = q.astype(jnp.float32), k.astype(jnp.float32)
    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    return q * (q.shape[-1] ** -0.5 if scale is None else scale), k


def _prep_and_natural_recurrence(q, k, v, g, beta, layout, grid, cu_seqlens, initial_state, snapshot_seq,
                                 snapshot_len, start_pos, *, scale, use_qk_l2norm, max_chunks, block_dv,
                                 matmul_dtype, interpret):
    """``prep="kernel"`` (GDN, ``g [T, Hv, 1]``): q and k normalised (q then scaled) in fp32 with their
    ``Hk`` heads, cast to the operand dtype and laid on the grid with v, g and beta; the terms by
    ``gdn_chunk_prep``, ``exp(G_last)`` of each chunk by XLA (one reduction); the recurrence by
    ``_kernel_natural``, whose states and outputs need no transposes."""
    from pallas_kernels.gdn_chunk_prep import chunk_terms_kernel  # it builds on this module

    T, Hv, dv = v.shape
    dk = q.shape[-1]
    f32, mm = jnp.float32, jnp.dtype(matmul_dtype)
    q, k = normalized_qk(q, k, scale, use_qk_l2norm)
    gb = jnp.swapaxes(grid(jnp.stack([g[..., 0].astype(f32), beta.astype(f32)], axis=-1)), -1, -2)  # [M, Hv, 2, C]
    w, qd, kd, u, qk = chunk_terms_kernel(grid(q.astype(mm)), grid(k.astype(mm)), grid(v.astype(mm)), gb,
                                          matmul_dtype=mm, interpret=interpret)
    decay_last = jnp.exp(jnp.sum(gb[:, :, 0], axis=-1))  # [M, Hv]

    req_seq, row, slot_of_chunk = _layout_requests(layout, cu_seqlens, snapshot_seq, snapshot_len,
                                                   max_chunks, CHUNK)
    scratch = [
        plgpu.SMEM((dk, block_dv), f32, transforms=_transforms(f32)),     # S fp32: initial / snapshot I/O
        plgpu.SMEM((dk, block_dv), mm, transforms=_transforms(mm)),       # S operand
        plgpu.SMEM((CHUNK, dk), mm, transforms=_transforms(mm)),          # w
        plgpu.SMEM((CHUNK, dk), mm, transforms=_transforms(mm)),          # q exp G
        plgpu.SMEM((CHUNK, dk), mm, transforms=_transforms(mm)),          # k exp(G_last - G)
        plgpu.SMEM((CHUNK, block_dv), f32, transforms=_transforms(f32)),  # u
        plgpu.SMEM((CHUNK, CHUNK), mm, transforms=_transforms(mm)),       # qk
        plgpu.SMEM((CHUNK, block_dv), mm, transforms=_transforms(mm)),    # v_new
        plgpu.SMEM((CHUNK, block_dv), f32, transforms=_transforms(f32)),  # o staging
        plgpu.Barrier(num_barriers=6),
    ]
    kernel = chunk_kernel(functools.partial(_kernel_natural, block_dv=block_dv, mm_dtype=mm), scratch,
                          num_seqs=cu_seqlens.shape[0] - 1, num_rows=req_seq.shape[0], max_chunks=max_chunks, Hv=Hv,
                          dv=dv, dk=dk, block_dv=block_dv, interpret=interpret, transposed=False,
                          name="delta_chunk_natural")
    o, states = kernel(layout.first_chunk.astype(jnp.int32), layout.num_chunks.astype(jnp.int32), slot_of_chunk,
                       decay_last, initial_state, w, qd, kd, u, qk)
    return gather_states(o, states, layout, req_seq, row, initial_state, cu_seqlens, snapshot_seq, snapshot_len,
                         start_pos, transposed=False)


@functools.partial(jax.jit, static_argnames=("scale", "use_qk_l2norm", "max_chunks", "block_dv",
                                             "matmul_dtype", "prep_precision", "prep", "interpret"))
def _chunked_pallas(q, k, v, g, beta, cu_seqlens, initial_state, snapshot_seq, snapshot_len, start_pos,
                    *, scale, use_qk_l2norm, max_chunks, block_dv, matmul_dtype, prep_precision, prep, interpret):
    T, Hv, dv = v.shape
    dk = q.shape[-1]
    num_seqs = cu_seqlens.shape[0] - 1
    per_channel_gate = g.shape[-1] != 1
    layout = chunk_layout(cu_seqlens, start_pos, T, CHUNK, max_chunks)
    grid = functools.partial(_to_grid, layout=layout, max_chunks=max_chunks, chunk_size=CHUNK)
    mm = jnp.dtype(matmul_dtype)
    if prep == "kernel":
        return _prep_and_natural_recurrence(q, k, v, g, beta, layout, grid, cu_seqlens, initial_state, snapshot_seq,
                                            snapshot_len, start_pos, scale=scale, use_qk_l2norm=use_qk_l2norm,
                                            max_chunks=max_chunks, block_dv=block_dv, matmul_dtype=mm,
                                            interpret=interpret)
    q, k, v, g, beta = _prepare(q, k, v, g, beta, scale, use_qk_l2norm)
    terms = chunk_terms(grid(q), grid(k), grid(v), grid(g), grid(beta[..., None])[..., 0],
                        precision=PREP_PRECISIONS[prep_precision])
    w = terms.w.astype(mm)                                   # [M, Hv, C, dk]
    qd = terms.q_decayed.astype(mm)                          # [M, Hv, C, dk]
    kdt = jnp.swapaxes(terms.k_decayed, -1, -2).astype(mm)  # [M, Hv, dk, C]
    ut = jnp.swapaxes(terms.u, -1, -2)                       # [M, Hv, dv, C] fp32
    qk = terms.qk.astype(mm)                                 # [M, Hv, C, C]
    decay_last = terms.decay_last if per_channel_gate else terms.decay_last[..., 0]  # [M, Hv, dk] | [M, Hv]
    init_t = jnp.swapaxes(initial_state, -1, -2)             # [N, Hv, dv, dk]

    req_seq, row, slot_of_chunk = _layout_requests(layout, cu_seqlens, snapshot_seq, snapshot_len,
                                                   max_chunks, CHUNK)
    num_rows = req_seq.shape[0]
    f32 = jnp.float32
    # With fp32 operands the WGMMA copy of Sᵀ IS the fp32 state staging buffer (one 32 KiB buffer
    # less: all of it is ~192 KiB at dk = 128); with bf16 operands it is a separate bf16 buffer.
    alias = mm == f32
    scratch = [
        plgpu.SMEM((block_dv, dk), f32, transforms=_transforms(f32)),  # Sᵀ fp32: initial / snapshot I/O
        *([] if alias else [plgpu.SMEM((block_dv, dk), mm, transforms=_transforms(mm))]),  # Sᵀ operand
        plgpu.SMEM((CHUNK, dk), mm, transforms=_transforms(mm)),      # w
        plgpu.SMEM((CHUNK, dk), mm, transforms=_transforms(mm)),      # q exp G
        plgpu.SMEM((dk, CHUNK), mm, transforms=_transforms(mm)),      # (k exp(G_last - G))ᵀ
        plgpu.SMEM((block_dv, CHUNK), f32, transforms=_transforms(f32)),  # uᵀ
        plgpu.SMEM((CHUNK, CHUNK), mm, transforms=_transforms(mm)),   # qk
        plgpu.SMEM((block_dv, CHUNK), mm, transforms=_transforms(mm)),    # v_newᵀ
        plgpu.SMEM((block_dv, CHUNK), f32, transforms=_transforms(f32)),  # oᵀ staging
        plgpu.SMEM((dk if per_channel_gate else 1,), f32),                  # KDA exp(G_last)
        plgpu.Barrier(num_barriers=7),
    ]

    def body(*refs):
        ins, outs, smem = refs[:10], refs[10:12], list(refs[12:])
        if alias:
            smem.insert(1, smem[0])
        _kernel(*ins, *outs, *smem, block_dv=block_dv, per_channel_gate=per_channel_gate, mm_dtype=mm)

    kernel = chunk_kernel(body, scratch, num_seqs=num_seqs, num_rows=num_rows, max_chunks=max_chunks, Hv=Hv, dv=dv,
                          dk=dk, block_dv=block_dv, interpret=interpret)
    ot, states_t = kernel(layout.first_chunk.astype(jnp.int32), layout.num_chunks.astype(jnp.int32),
                          slot_of_chunk, decay_last.astype(f32), init_t, w, qd, kdt, ut, qk)
    return gather_states(ot, states_t, layout, req_seq, row, initial_state, cu_seqlens, snapshot_seq,
                         snapshot_len, start_pos)


SMEM_BYTES = 227 * 1024  # per block on sm_90


def smem_bytes(dk, block_dv, matmul_dtype) -> int:
    """The kernel's SMEM: Sᵀ (fp32, plus an operand copy unless fp32), w, q e^G, kdᵀ, qk in the
    operand dtype, uᵀ and the oᵀ staging in fp32, v_newᵀ in the operand dtype, the KDA gate."""
    mm = jnp.dtype(matmul_dtype).itemsize
    state = block_dv * dk * (4 + (0 if mm == 4 else mm))
    operands = (3 * CHUNK * dk + CHUNK * CHUNK + block_dv * CHUNK) * mm
    return state + operands + 2 * block_dv * CHUNK * 4 + dk * 4 + 1024  # + barriers, alignment


def supports(dk: int, dv: int, block_dv: int = 64, matmul_dtype=jnp.float32) -> bool:
    """Whether ``gdn_chunked_pallas`` takes these head dims (``_check_tiling``'s rules)."""
    return (dk % 64 == 0 and dk <= 256 and block_dv % 64 == 0 and dv % block_dv == 0
            and smem_bytes(dk, block_dv, matmul_dtype) <= SMEM_BYTES)


def _check_tiling(q, v, block_dv, chunk_size, matmul_dtype):
    dk, dv = q.shape[-1], v.shape[-1]
    problems = []
    if smem_bytes(dk, block_dv, matmul_dtype) > SMEM_BYTES:
        problems.append(f"block_dv={block_dv}, dk={dk}, {jnp.dtype(matmul_dtype).name} operands need "
                        f"{smem_bytes(dk, block_dv, matmul_dtype)} bytes of SMEM (> {SMEM_BYTES}): use block_dv=64")
    if chunk_size != CHUNK:
        problems.append(f"chunk_size={chunk_size}: the kernel is built for {CHUNK}")
    if dk % 64 or dk > 256:
        problems.append(f"dk={dk} must be a multiple of 64 and at most 256 (WGMMA N)")
    if block_dv % 64 or dv % block_dv:
        problems.append(f"block_dv={block_dv} must be a multiple of 64 dividing dv={dv} (WGMMA M)")
    if problems:
        raise ValueError("gdn_chunked_pallas: " + "; ".join(problems))


def gdn_chunked_pallas(q, k, v, g, beta, *, cu_seqlens, initial_state=None, scale=None, use_qk_l2norm=True,
                       snapshot_seq=None, snapshot_len=None, chunk_size=64, start_pos=None, max_chunks=None,
                       block_dv=64, matmul_dtype=jnp.float32, prep_precision="highest", prep="xla",
                       interpret=False):
    """``gdn_chunked`` (``g [T, Hv]``) or ``kda_chunked`` (``g [T, Hv, dk]``) with the state recurrence
    on the Mosaic GPU kernel. Same arguments and results as the references::

        q, k [T, Hk, dk]; v [T, Hv, dv]; beta [T, Hv] (sigmoided); cu_seqlens int32 [N+1];
        initial_state [N, Hv, dk, dv] fp32 or None; start_pos [N] (default 0);
        snapshot_seq / snapshot_len int32 [S] or None
        -> (o [T, Hv, dv] in v.dtype, final [N, Hv, dk, dv] fp32, snapshots [S, Hv, dk, dv] or None)

    Snapshots exist at lengths 0, the whole sequence, or ``(start_pos + len) % 64 == 0``; others
    raise ``ValueError`` when concrete and come back NaN under ``jit`` (as in the reference).
    Extra static knobs: ``block_dv`` (state columns per program), ``matmul_dtype`` (WGMMA operand
    dtype: fp32 = tf32 on the GPU, or bf16), ``prep_precision`` (the XLA intra-chunk products:
    ``"highest"`` fp32, or ``"default"``, the configured matmul precision, i.e. TF32 on the GPU:
    an experiment, measured by ``benchmarks/kernels.py`` and checked by ``benchmarks/gpu_check.py``
    before any model path uses it), ``prep`` (``"xla"``: the intra-chunk terms by XLA, with
    ``prep_precision``; ``"kernel"``: by ``gdn_chunk_prep``, GDN only, its operands in
    ``matmul_dtype``: 16-bit on the GPU), ``interpret`` (Mosaic GPU's interpreter, CPU tests).
    """
    if prep_precision not in PREP_PRECISIONS:
        raise ValueError(f"prep_precision={prep_precision!r}; choose one of {sorted(PREP_PRECISIONS)}")
    if prep not in PREPS:
        raise ValueError(f"prep={prep!r}; choose one of {PREPS}")
    if prep == "kernel":
        from pallas_kernels.gdn_chunk_prep import tiling_problems

        problems = tiling_problems(q.shape[-1], v.shape[-1], matmul_dtype, interpret)
        if g.ndim != 2:
            problems.append("prep='kernel' takes GDN's gate [T, Hv] only (KDA's per-channel gate: prep='xla')")
        if problems:
            raise ValueError("gdn_chunked_pallas: " + "; ".join(problems))
    if g.ndim == 2:
        if g.shape != v.shape[:2]:
            raise ValueError(f"GDN gate g {g.shape} must be [T, Hv] = {v.shape[:2]}")
        g = g[..., None]
    _check_tiling(q, v, block_dv, chunk_size, matmul_dtype)
    return run_chunked(_chunked_pallas, q, k, v, g, beta, gate=g, cu_seqlens=cu_seqlens, initial_state=initial_state,
                       snapshot_seq=snapshot_seq, snapshot_len=snapshot_len, start_pos=start_pos,
                       max_chunks=max_chunks, scale=scale, use_qk_l2norm=use_qk_l2norm, block_dv=block_dv,
                       matmul_dtype=jnp.dtype(matmul_dtype).name, prep_precision=prep_precision,
                       prep=prep, interpret=interpret)


def main():
    """Small self-check: ``python -m pallas_kernels.gdn_chunked [--interpret]`` (ragged batch,
    random start positions, every snapshot boundary) against ``gdn_chunked``."""
    import sys

    import numpy as np

    from pallas_kernels.gdn_reference import gdn_chunked

    interpret = "--interpret" in sys.argv
    Hk, Hv, d, lens = (1, 2, 64, [90, 0, 120]) if interpret else (16, 32, 128, [3000, 0, 1500, 3500])
    rng = np.random.default_rng(0)
    T = sum(lens) + 5
    f = lambda *s: jnp.asarray(rng.normal(size=s).astype(np.float32), jnp.bfloat16)  # noqa: E731
    x = dict(q=f(T, Hk, d), k=f(T, Hk, d), v=f(T, Hv, d),
             g=jnp.asarray(-rng.uniform(0, 0.03, (T, Hv)).astype(np.float32)),
             beta=jnp.asarray(rng.uniform(0, 1, (T, Hv)), jnp.bfloat16))
    start = rng.integers(0, 1000, len(lens)).astype(np.int32)
    seq, length = zip(*[(n, t) for n, (L, s) in enumerate(zip(lens, start)) for t in range(L + 1)
                        if t in (0, L) or (s + t) % 64 == 0])
    idx = dict(cu_seqlens=jnp.asarray(np.concatenate([[0], np.cumsum(lens)]), jnp.int32),
               initial_state=jnp.asarray(rng.normal(size=(len(lens), Hv, d, d)).astype(np.float32)) * 0.1,
               start_pos=jnp.asarray(start), snapshot_seq=jnp.asarray(seq, jnp.int32),
               snapshot_len=jnp.asarray(length, jnp.int32))
    got = gdn_chunked_pallas(**x, **idx, interpret=interpret)
    want = gdn_chunked(**x, **idx)
    rel = lambda a, b: float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))  # noqa: E731
    errs = [rel(a.astype(jnp.float32), b.astype(jnp.float32)) for a, b in zip(got, want)]
    print(f"gdn_chunked_pallas lens={lens} Hk={Hk} Hv={Hv} d={d}: rel err o {errs[0]:.2e}, final {errs[1]:.2e}, "
          f"snapshots {errs[2]:.2e} ({len(seq)})")
    np.testing.assert_array_less(errs, [1e-2, 2e-3, 2e-3])


if __name__ == "__main__":
    main()
