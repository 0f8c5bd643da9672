"""KDA chunked prefill (chunk 64) on a ragged batch as ONE Mosaic GPU kernel (sm_90): the sibling of
``gdn_chunk_fused`` for Kimi Delta Attention's per-channel gate ``g [T, Hv, dk]``.

Same contract and results as ``kda_reference.kda_chunked`` and the KDA path of
``gdn_chunked.gdn_chunked_pallas``: ragged tokens (``cu_seqlens``), one initial state per sequence,
chunks aligned to ABSOLUTE multiples of 64 (``start_pos``, so chunk ends are the radix cache's ×64
snapshot boundaries, ARCHITECTURE.md invariant 1), the final state of every sequence and the states
at the requested ``(snapshot_seq, snapshot_len)`` boundaries; padding tokens output 0.

The pipeline is ``gdn_chunk_fused``'s (one program per (sequence, value head, 64 state columns)
with ``Sᵀ [64, dk]`` in fp32 registers, TMA chunk loads, the blocked UT inverse ``T = (I + A)⁻¹``
and its helpers, ``w`` / ``u``, the recurrence, the compact state output) with three changes the
per-channel decay forces:

* **The gate arrives as G.** With ``dk`` decays per token, the in-register masked cumsum of the GDN
  kernel would be 64×64×dk adds per chunk; XLA computes ``G = cumsum(g)`` within each chunk (fp32)
  in the same pass that lays g on the chunk grid (fla's ``chunk_local_cumsum``), so HBM sees the
  bytes of g either way. Every exponential stays on chip.
* **Decayed scores through sub-block reference points.** ``A_ij = beta_i Σ_d k_id k_jd
  e^(G_id - G_jd)`` (j < i) and ``qk_ij = Σ_d q_id k_jd e^(G_id - G_jd)`` (j <= i) are no longer a
  product times a [64, 64] decay. Rows fall in four 16-row sub-blocks ``b``, each with a reference
  row ``r_b = 16 b + 8`` (its middle), and::

      score_ij = Σ_d (x_id e^(G_id - G_{r_b},d)) (k_jd e^(G_{r_b},d - G_jd))   for i in sub-block b

  one WGMMA pair per sub-block (``[k | q] e^(G - G_ref(row))`` against ``k e^(G_{r_b} - G)``, the
  latter zeroed past sub-block b), of which the rows of sub-block b are kept. Every exponent that
  reaches a kept entry is at most ``8 |g|`` in size, so a log-decay down to -10 per token and channel
  neither overflows nor loses a kept entry larger than ``e^-7`` to underflow (fp32 and bf16 share
  the exponent range); splitting as ``e^G_i · e^-G_j`` would overflow past a chunk-wide sum of -88.
  Discarded entries may overflow for gates below about -5.9; they are dropped by a select, never
  multiplied by zero.
* **Aᵀ by the tensor cores.** The inverse needs ``Aᵀ`` in registers (tf32 WGMMA takes only K-major
  operands); ``K Kᵀ`` is no longer symmetric after the decay, so ``Aᵀ = I (hi + lo)ᵀ`` with
  ``A = hi + lo`` split into two bf16 parts (~16 mantissa bits; fp32 operands take ``hi = A``).

Per chunk, in order: G, beta, q, k arrive; ``q e^G``, ``beta k e^G`` and ``k e^(G_last - G)`` are
written; the four score rounds; the next chunk's q, k, G and beta copies are issued (their buffers
are read for the last time), so they overlap the rest; ``Aᵀ``, ``T``; ``beta v`` in place;
``w``, ``uᵀ`` (then the next v is issued); ``v_newᵀ``, ``oᵀ``, ``Sᵀ = e^(G_last) ⊙ Sᵀ + v_newᵀ (k
e^(G_last - G))`` with ``e^(G_last)`` a per-column ``[dk]`` vector.

SMEM (``smem_bytes``): one buffer per input (q, k, 64 columns of v in the operand dtype, G and beta
fp32), seven persistent operand buffers, and one scoped region that the score operands, the
transposition, the inverse's four fp32 tiles and the output staging take in turn: 230,448 bytes at
dk = 128 with bf16 operands as Mosaic GPU lowers it (227 KiB = 232,448 per block on sm_90).

Precision: the state, G, the exponentials and every accumulator are fp32; ``A`` and the inverse as
in ``gdn_chunk_fused``; the score operands and the other products take ``matmul_dtype`` (bf16 on the
GPU, fp32 in the interpreter only; not float16, whose exponent range the scaled score operands
leave).

Costs to know: the scores take four WGMMA pairs of which a quarter of the rows are kept (4x the
``K Kᵀ`` / ``q Kᵀ`` tensor-core work of GDN), and the ``dv / 64`` programs of a head each recompute
the chunk's A, T and w, as in ``gdn_chunk_fused``.

Contract: ``g [T, Hv, dk]`` (per-channel log-decay; one below ``MIN_LOG_DECAY`` = -10 per token counts
as -10, which changes what survives of the old state by less than 4.6e-5 of it),
``dk`` in {64, 128}, ``dv % 64 == 0``, ``chunk_size == 64``.

Status: correct on an H100 (``benchmarks/gpu_check.py --suites kda_fused``, 2026-12-07) but 5-6x
slower than ``gdn_chunked_pallas`` at 8k tokens (10.4-11.9 ms against 1.9-2.1 ms; the kernel
alone 42x the split path's recurrence kernel: the 16-row sub-block references of the per-channel
decay dominate; benchmarks/RESULTS.md), so it is not in ``jaxserve.models.backends.AUTO_ON_GPU``. The engine runs it for KDA layers where ``--kernels`` names
``prefill_fused`` (``gated_deltanet.prefill_kernel``).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.gdn_chunk_fused import (
    BLOCK_DV,
    CHUNK,
    _col,
    _row,
    _unit_lower_inverse,
    apply_inverse,
    check_tiling,
    launch_fused,
    load_initial_state,
    program,
    recurrence,
    tiling_problems,
    write_chunk_outputs,
)
from pallas_kernels.gdn_chunked import _products, _transforms, run_chunked
from pallas_kernels.kda_reference import _check_kda_gate

SUB = 16  # rows per score sub-block: one decay reference point each
# bf16 only on the GPU: the score operands carry factors up to e^(8 |g|), past float16's range
# (e^11) for gates below about -1.4 per token; bf16 has fp32's exponent range.
GPU_MATMUL_DTYPES = ("bfloat16",)


def _transposed(x, row, col, eye_smem, hi_smem, lo_smem=None):
    """``xᵀ`` of an fp32 ``[64, 64]`` register tile on the tensor cores: ``I (hi + lo)ᵀ`` with
    ``hi = x`` rounded to the buffers' dtype and ``lo`` the remainder (``lo_smem=None``: ``hi``
    holds x exactly, fp32 operands)."""
    f32 = jnp.float32
    eye_smem[...] = jnp.where(row == col, 1.0, 0.0).astype(eye_smem.dtype)
    hi = x.astype(hi_smem.dtype)
    hi_smem[...] = hi
    pairs = [(eye_smem, hi_smem.T)]
    if lo_smem is not None:
        lo_smem[...] = (x - hi.astype(f32)).astype(lo_smem.dtype)
        pairs.append((eye_smem, lo_smem.T))
    plgpu.commit_smem()
    (xt,) = _products((pairs, x.shape))
    return xt


def _kernel(first_ref, nchunks_ref, slot_ref, init_ref, q_ref, k_ref, v_ref, G_ref, beta_ref,
            ot_ref, st_ref,
            q_smem, k_smem, v_smem, G_smem, beta_smem, qk_smem, t_smem, w_smem, qe_smem, ke_smem, s_smem,
            vn_smem, bars, *, group, mm_dtype):
    """One (sequence, value head, 64 state columns): walk the sequence's chunks with ``Sᵀ`` in registers."""
    n, h, hk, c0, nc, cols = program(first_ref, nchunks_ref, group)
    dk = q_smem.shape[-1]
    f32, mm = jnp.float32, mm_dtype
    tile = plgpu.Layout.WGMMA
    C = CHUNK
    sq, wide = (C, C), (C, dk)
    q_bar, k_bar, v_bar, G_bar, beta_bar, init_bar = (bars.at[i] for i in range(6))
    split = jnp.dtype(f32) if mm == f32 else jnp.dtype(jnp.bfloat16)  # Aᵀ's transposition parts

    def issue_qkg(c):
        plgpu.copy_gmem_to_smem(q_ref.at[c, hk], q_smem, q_bar)
        plgpu.copy_gmem_to_smem(k_ref.at[c, hk], k_smem, k_bar)
        plgpu.copy_gmem_to_smem(G_ref.at[c, h], G_smem, G_bar)
        plgpu.copy_gmem_to_smem(beta_ref.at[c, h], beta_smem, beta_bar)

    def issue_v(c):
        plgpu.copy_gmem_to_smem(v_ref.at[c, h, :, cols], v_smem, v_bar)

    @pl.when(nc > 0)
    def _():
        issue_qkg(c0)
        issue_v(c0)

    s0 = load_initial_state(init_ref.at[n, h, cols], init_bar)

    def body(i, s):
        c = c0 + i
        more = i + 1 < nc
        out_row = slot_ref[c]  # scalar GMEM load first: its latency hides behind the work below
        row = plgpu.broadcasted_iota(jnp.int32, sq, 0, layout=tile)
        col = plgpu.broadcasted_iota(jnp.int32, sq, 1, layout=tile)
        row_w = plgpu.broadcasted_iota(jnp.int32, wide, 0, layout=tile)
        # The previous chunk's output / state copies read the scoped region the scores reuse.
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

        # G's rows as per-column [dk] vectors: the chunk's total and each sub-block's reference.
        plgpu.barrier_wait(G_bar)
        plgpu.barrier_wait(beta_bar)
        G = plgpu.load(G_smem, layout=tile)
        at_row = lambda r: jnp.sum(jnp.where(row_w == r, G, 0.0), axis=0)  # noqa: E731 (exact: one term)
        G_last = at_row(C - 1)
        refs = [at_row(SUB * b + SUB // 2) for b in range(C // SUB)]
        G_ref = _col(refs[0], wide)
        for b in range(1, C // SUB):
            G_ref = jnp.where(row_w >= SUB * b, _col(refs[b], wide), G_ref)
        beta_r = plgpu.load(beta_smem, layout=tile.reduce(1))

        # The operands of the later products, while q, k and G are at hand.
        plgpu.barrier_wait(q_bar)
        plgpu.barrier_wait(k_bar)
        kr = plgpu.load(k_smem, layout=tile).astype(f32)
        qr = plgpu.load(q_smem, layout=tile).astype(f32)
        eG = jnp.exp(G)
        qe_smem[...] = (qr * eG).astype(mm)
        w_smem[...] = (kr * _row(beta_r, wide) * eG).astype(mm)
        ke_smem[...] = (kr * jnp.exp(_col(G_last, wide) - G)).astype(mm)
        rel = jnp.exp(G - G_ref)

        def scores(ak_smem, aq_smem, b_smem):
            """K Kᵀ and q Kᵀ decayed per channel, one sub-block of rows per round (module docstring)."""
            ak_smem[...] = (kr * rel).astype(mm)
            aq_smem[...] = (qr * rel).astype(mm)
            kk = qk = jnp.zeros(sq, f32)
            for b in range(C // SUB):
                # k and G are re-read per round rather than held in registers beside the state.
                kb = plgpu.load(k_smem, layout=tile).astype(f32)
                Gb = plgpu.load(G_smem, layout=tile)
                b_smem[...] = (kb * jnp.exp(jnp.where(row_w < SUB * (b + 1), _col(refs[b], wide) - Gb,
                                                      -jnp.inf))).astype(mm)
                plgpu.commit_smem()
                kk_b, qk_b = _products(([(ak_smem, b_smem.T)], sq), ([(aq_smem, b_smem.T)], sq))
                mine = jnp.right_shift(row, SUB.bit_length() - 1) == b
                kk, qk = jnp.where(mine, kk_b, kk), jnp.where(mine, qk_b, qk)
            return kk, qk

        kk, qk = pl.run_scoped(scores, *(plgpu.SMEM(wide, mm, transforms=_transforms(mm)) for _ in range(3)))

        # q, k, G and beta were last read before the final round's commit_smem (a warpgroup
        # barrier): the next chunk's copies may overwrite them now and overlap everything below.
        @pl.when(more)
        def _():
            issue_qkg(c + 1)

        A = jnp.where(col < row, _row(beta_r, sq) * kk, 0.0)
        qk_smem[...] = jnp.where(col <= row, qk, 0.0).astype(mm)
        At = pl.run_scoped(functools.partial(_transposed, A, row, col),
                           *(plgpu.SMEM(sq, split, transforms=_transforms(split))
                             for _ in range(2 if split == f32 else 3)))
        T = pl.run_scoped(functools.partial(_unit_lower_inverse, A, At, row, col),
                          *(plgpu.SMEM(sq, f32, transforms=_transforms(f32)) for _ in range(4)))
        t_smem[...] = T.astype(mm)

        plgpu.barrier_wait(v_bar)
        v_smem[...] = (plgpu.load(v_smem, layout=tile) * _row(beta_r, (C, BLOCK_DV))).astype(mm)
        s_smem[...] = s.astype(mm)
        plgpu.commit_smem()

        ut = apply_inverse(t_smem, w_smem, v_smem)  # beta v was last read here: the next v may come

        @pl.when(more)
        def _():
            issue_v(c + 1)

        decay = _col(jnp.exp(G_last), (BLOCK_DV, dk))
        o, s_new = recurrence(s, ut, decay, s_smem, w_smem, vn_smem, qe_smem, qk_smem, ke_smem)
        write_chunk_outputs(o, s_new, out_row, ot_ref.at[c, h, cols], st_ref, h, cols)
        return s_new

    lax.fori_loop(0, nc, body, s0)
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def smem_bytes(dk: int, matmul_dtype) -> int:
    """The kernel's SMEM: one buffer of q, k, v columns (operand dtype), G and beta (fp32); qk, T, w,
    q e^G, k e^(G_last-G), Sᵀ and v_newᵀ in the operand dtype; one scoped region for the largest of
    the score operands, the transposition, the inverse's four fp32 tiles, the output staging and the
    initial state."""
    mm = jnp.dtype(matmul_dtype).itemsize
    split = 4 if mm == 4 else 2
    inputs = (2 * CHUNK * dk + CHUNK * BLOCK_DV) * mm + (CHUNK * dk + CHUNK) * 4
    persistent = (2 * CHUNK * CHUNK + 3 * CHUNK * dk + BLOCK_DV * dk + BLOCK_DV * CHUNK) * mm
    scoped = max(3 * CHUNK * dk * mm, 3 * CHUNK * CHUNK * split, 4 * CHUNK * CHUNK * 4,
                 (BLOCK_DV * CHUNK + BLOCK_DV * dk) * 4)
    return inputs + persistent + scoped + 1024  # + barriers, alignment


def _tiling_problems(dk: int, dv: int, chunk_size: int, matmul_dtype, interpret: bool) -> list[str]:
    """``gdn_chunk_fused.tiling_problems`` with this kernel's GPU operand dtypes and SMEM."""
    return tiling_problems(dk, dv, chunk_size, matmul_dtype, interpret, gpu_dtypes=GPU_MATMUL_DTYPES, smem=smem_bytes)


def supports(dk: int, dv: int, matmul_dtype=jnp.bfloat16, interpret: bool = False) -> bool:
    """Whether the fused KDA kernel takes these head dims (``gdn_chunk_fused.tiling_problems`` states
    the rules, with this kernel's operand dtypes and SMEM)."""
    return not _tiling_problems(dk, dv, CHUNK, matmul_dtype, interpret)


# The strongest per-token, per-channel log-decay the kernel takes as given; stronger ones count as
# this. The sub-block scores keep exponents up to 8 |g| (module docstring), finite in fp32 up to
# |g| = 11, and a decay below e^-10 leaves less than 4.6e-5 of the old state in that channel where the
# exact decay leaves less still: a difference under bf16's resolution (2^-8), where without the
# clamp the scores overflow and the outputs come back NaN (Kimi-Linear's gates, -exp(A_log) *
# softplus(...), reach such values).
MIN_LOG_DECAY = -10.0


@functools.partial(jax.jit, static_argnames=("scale", "use_qk_l2norm", "max_chunks", "matmul_dtype", "interpret"))
def _fused(q, k, v, g, beta, cu_seqlens, initial_state, snapshot_seq, snapshot_len, start_pos,
           *, scale, use_qk_l2norm, max_chunks, matmul_dtype, interpret):
    Hv, Hk, dk = v.shape[1], q.shape[1], q.shape[-1]
    f32, mm = jnp.float32, jnp.dtype(matmul_dtype)
    operand = lambda shape: plgpu.SMEM(shape, mm, transforms=_transforms(mm))  # noqa: E731
    scratch = [
        operand((CHUNK, dk)),                                     # q
        operand((CHUNK, dk)),                                     # k
        operand((CHUNK, BLOCK_DV)),                               # v columns, then beta v
        plgpu.SMEM((CHUNK, dk), f32, transforms=_transforms(f32)),  # G
        plgpu.SMEM((CHUNK,), f32),                                # beta
        operand((CHUNK, CHUNK)),                                  # qk
        operand((CHUNK, CHUNK)),                                  # T
        operand((CHUNK, dk)),                                     # beta k e^G, then w
        operand((CHUNK, dk)),                                     # q e^G
        operand((CHUNK, dk)),                                     # k e^(G_last - G)
        operand((BLOCK_DV, dk)),                                  # Sᵀ operand
        operand((BLOCK_DV, CHUNK)),                               # v_newᵀ
        plgpu.Barrier(num_barriers=6),                            # q, k, v, G, beta, initial state
    ]

    def gate_inputs(grid):  # G = within-chunk cumsum of max(g, MIN_LOG_DECAY) [M, Hv, C, dk]; beta [M, Hv, C]
        return (jnp.cumsum(grid(jnp.maximum(g.astype(f32), MIN_LOG_DECAY)), axis=-2),
                grid(beta.astype(f32)[..., None])[..., 0])

    return launch_fused(functools.partial(_kernel, group=Hv // Hk, mm_dtype=mm), scratch, gate_inputs, q, k, v,
                        cu_seqlens, initial_state, snapshot_seq, snapshot_len, start_pos, scale=scale,
                        use_qk_l2norm=use_qk_l2norm, max_chunks=max_chunks, matmul_dtype=mm, interpret=interpret)


def kda_chunk_fused(q, k, v, g, beta, *, cu_seqlens, initial_state=None, scale=None, use_qk_l2norm=True,
                    snapshot_seq=None, snapshot_len=None, chunk_size=64, start_pos=None, max_chunks=None,
                    matmul_dtype=jnp.bfloat16, interpret=False):
    """``kda_chunked`` with the whole chunk on the fused Mosaic GPU kernel. Same arguments and results::

        q, k [T, Hk, dk]; v [T, Hv, dv]; g [T, Hv, dk] per-channel log-decay; beta [T, Hv] (sigmoided);
        cu_seqlens int32 [N+1]; initial_state [N, Hv, dk, dv] fp32 or None; start_pos [N] (default 0);
        snapshot_seq / snapshot_len int32 [S] or None
        -> (o [T, Hv, dv] in v.dtype, final [N, Hv, dk, dv] fp32, snapshots [S, Hv, dk, dv] or None)

    Snapshots exist at lengths 0, the whole sequence, or ``(start_pos + len) % 64 == 0``; others
    raise ``ValueError`` when concrete and come back NaN under ``jit`` (as in the reference).
    ``matmul_dtype`` (static): operand dtype of the products outside the inverse (bf16 on the GPU;
    fp32 with ``interpret`` only). ``interpret``: Mosaic GPU's interpreter (CPU tests).
    """
    _check_kda_gate(q, v, g)
    check_tiling("kda_chunk_fused", _tiling_problems(q.shape[-1], v.shape[-1], chunk_size, matmul_dtype, interpret))
    return run_chunked(_fused, q, k, v, g, beta, gate=g, cu_seqlens=cu_seqlens, initial_state=initial_state,
                       snapshot_seq=snapshot_seq, snapshot_len=snapshot_len, start_pos=start_pos,
                       max_chunks=max_chunks, scale=scale, use_qk_l2norm=use_qk_l2norm,
                       matmul_dtype=jnp.dtype(matmul_dtype).name, interpret=interpret)
