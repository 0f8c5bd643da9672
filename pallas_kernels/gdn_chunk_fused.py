"""GDN chunked prefill (chunk 64) on a ragged batch as ONE Mosaic GPU kernel (sm_90): the intra-chunk
UT transform and the state recurrence on chip. No intermediate goes to HBM: the only chunk-shaped
arrays there are the inputs laid on the chunk grid, the output before it is gathered back to token
order, and the requested states.

Same contract and results as ``gdn_reference.gdn_chunked`` and the GDN path of
``gdn_chunked.gdn_chunked_pallas``: ragged tokens (``cu_seqlens``), one initial state per sequence,
chunks aligned to ABSOLUTE multiples of 64 (``start_pos``), so a prompt prefilled in pieces computes
the same chunks and its chunk ends are the radix cache's ×64 snapshot boundaries (ARCHITECTURE.md
invariant 1); the final state of every sequence and the states at the requested ``(snapshot_seq,
snapshot_len)`` boundaries; padding tokens (index ``>= cu_seqlens[-1]``) output 0.

Split of the work:

* **XLA, one pass over the activations**: q and k are L2-normalised (q then scaled) in fp32, cast to
  the WGMMA operand dtype and, with v, g and beta, scattered onto the absolute chunk grid
  (``kda_reference.chunk_layout``; slots no token maps to are zeros, which leave the state
  untouched). q and k keep their ``Hk`` heads (value head ``h`` reads ``h // (Hv // Hk)``). No
  product, cumulative sum or exponential happens outside the kernel.
* **Mosaic GPU**: one program per (sequence, value head, 64 state columns) walks the sequence's
  chunks in order with the transposed state ``Sᵀ [64, dk]`` in registers (fp32, WGMMA layout). Per
  chunk it TMA-loads q, k ``[64, dk]``, its 64 columns of v and the chunk's g and beta (two
  buffers: chunk c+1's copies are issued when chunk c starts and overlap all of its work), and::

      G      = cumsum(g)                                   # masked reductions in registers
      A      = strictly-lower(beta_i k_i·k_j e^(G_i-G_j))  # K Kᵀ on the tensor cores
      T      = (I + A)⁻¹                                   # blocked inverse, below
      w      = T (beta k e^G);  uᵀ = (beta v)ᵀ Tᵀ           # WGMMA
      qk     = causal(q Kᵀ ⊙ e^(G_i-G_j))                   # WGMMA
      v_newᵀ = uᵀ - Sᵀ wᵀ
      oᵀ     = Sᵀ (q e^G)ᵀ + v_newᵀ qkᵀ
      Sᵀ     = e^(G_last) Sᵀ + v_newᵀ (k e^(G_last-G))

  ``T`` is built by exact block merges (the merge step of fla's ``solve_tril``, from 1×1 blocks up,
  at full tile size): ``D_1 = I`` and, for block sizes s = 1, 2, ..., 32, ``D_2s = D_s - D_s (M_s ⊙
  A) D_s``, where ``M_s`` selects the lower-left s-block of each diagonal 2s-block:
  ``[[T1, 0], [A21, T2]]⁻¹ = [[T1, 0], [-T2 A21 T1, T2]]``. No power series (whose partial sums grow like binomials and cancel), three 64×64×64
  products per level. The merges run on fp32 operands (tf32 on the GPU), whatever the operand dtype
  of the rest: fp32 (tf32) WGMMA needs both SMEM operands K-major, so each level keeps ``D`` and
  ``Dᵀ`` (and ``Aᵀ``, formed from the same ``K Kᵀ`` registers) and every product reads its
  operands as stored. The other products take the operand dtype (``matmul_dtype``).

  q, k and v are rescaled in place in their SMEM buffers (q e^G, k e^(G_last-G), beta v) once the
  products that read them raw are done; the inverse's fp32 buffers and the output / state staging
  buffers share one scoped region. When a chunk end is a requested state, the program writes
  ``Sᵀ`` to that request's row of a compact ``[R, Hv, dv, dk]`` output (R = sequences + snapshot
  requests; requests of the same chunk share a row), as ``gdn_chunked`` does.

Precision: the state, G and every accumulator are fp32; ``A`` and the inverse are fp32 in registers
with tf32 products on the GPU. ``matmul_dtype`` is the operand dtype of the other products: bf16 on
the GPU (fla's choice: bf16 operands, fp32 accumulation; ~201 KiB of SMEM at dk = 128). fp32
operands are for the CPU interpreter only: they need ~337 KiB of SMEM at dk = 128, and fp32 (tf32)
WGMMA takes only K-major SMEM operands while this kernel reads ``beta k e^G``, ``k e^(G_last-G)``
and ``beta v`` token-major.

Costs to know: the chunk's A, T and w are recomputed by each of a head's ``dv / 64`` programs, and a
program's chunks are strictly sequential, so one long sequence fills ``Hv · dv / 64`` SMs (64 of an
H200's 132 at Qwen3-Next shapes); a chunk-parallel pass over the states is the next step for long
prompts.

Contract: ``g [T, Hv]`` (GDN's scalar gate per head), ``dk`` in {64, 128}, ``dv % 64 == 0``,
``chunk_size == 64``; SMEM within 227 KiB (``smem_bytes``).

Status: correct on an H100 (``benchmarks/gpu_check.py --suites gdn_fused``; the engine hammer in fp32
with it: hits equal cold exactly; 2026-12-07), and slower than the split path (``gdn_chunked``:
XLA's intra-chunk work + the recurrence kernel) except on a ragged 64k-token batch: 0.46x at 8k
tokens of one sequence, 0.88x at 64k, 1.29x at 64k over 16 sequences (benchmarks/RESULTS.md;
``benchmarks/kernels.py --only gdn_fused``). The sequential chunk walk on ``Hv · dv / 64`` programs
and the recomputed ``A`` / inverse / ``w`` are the costs above; so it is not in
``jaxserve.models.backends.AUTO_ON_GPU``. The engine
runs it for GDN layers where ``--kernels`` names ``prefill_fused`` (``gated_deltanet.prefill_kernel``).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.gdn_chunked import (
    _layout_requests,
    _products,
    _transforms,
    chunk_kernel,
    gather_states,
    normalized_qk,
    run_chunked,
)
from pallas_kernels.gdn_reference import _per_head_gate
from pallas_kernels.kda_reference import _to_grid, chunk_layout

CHUNK = 64
BLOCK_DV = 64  # state columns per program: one WGMMA row group, and the chunk's row count
SMEM_BYTES = 227 * 1024  # per block on sm_90
GPU_MATMUL_DTYPES = ("bfloat16", "float16")


def _row(v, shape):
    """A per-row vector (``WGMMA.reduce(1)``) broadcast along the columns of ``shape``."""
    return lax.broadcast_in_dim(v, shape, [0])


def _col(v, shape):
    """A per-column vector (``WGMMA.reduce(0)``) broadcast along the rows of ``shape``."""
    return lax.broadcast_in_dim(v, shape, [1])


def _merge_masks(row, col, s):
    """``M_s`` and ``M_sᵀ``: entry (i, j) in the same 2s-block, in a later s-block than j."""
    same = jnp.right_shift(row, s.bit_length()) == jnp.right_shift(col, s.bit_length())
    r, c = jnp.right_shift(row, s.bit_length() - 1), jnp.right_shift(col, s.bit_length() - 1)
    return same & (r > c), same & (c > r)


def _unit_lower_inverse(A, At, row, col, d_smem, dt_smem, x_smem, p_smem):
    """``(I + A)⁻¹`` of a strictly lower fp32 ``A [64, 64]`` in registers (``At = Aᵀ``), by block
    merges (module docstring). The four fp32 SMEM buffers hold ``D``, ``Dᵀ``, ``(M_s ⊙ A)ᵀ`` and
    ``P = D (M_s ⊙ A)``; each is written only after the products that read it have been read back."""
    eye = jnp.where(row == col, 1.0, 0.0).astype(jnp.float32)
    m, mt = _merge_masks(row, col, 1)
    D, Dt = eye - jnp.where(m, A, 0.0), eye - jnp.where(mt, At, 0.0)
    s = 2
    while s < CHUNK:
        m, mt = _merge_masks(row, col, s)
        d_smem[...] = D
        dt_smem[...] = Dt
        x_smem[...] = jnp.where(mt, At, 0.0)
        plgpu.commit_smem()
        (P,) = _products(([(d_smem, x_smem.T)], (CHUNK, CHUNK)))        # D (M ⊙ A)
        p_smem[...] = P
        plgpu.commit_smem()
        Q, Qt = _products(([(p_smem, dt_smem.T)], (CHUNK, CHUNK)),      # P D
                          ([(dt_smem, p_smem.T)], (CHUNK, CHUNK)))      # Dᵀ Pᵀ
        D, Dt = D - Q, Dt - Qt
        s *= 2
    return D


def load_initial_state(src, bar):
    """``Sᵀ`` (fp32, ``src`` a ``[64, dk]`` GMEM view) into WGMMA-layout registers through a scoped
    SMEM buffer, waiting on ``bar``."""
    def load(st_smem):
        plgpu.copy_gmem_to_smem(src, st_smem, bar)
        plgpu.barrier_wait(bar)
        return plgpu.load(st_smem, layout=plgpu.Layout.WGMMA)

    return pl.run_scoped(load, plgpu.SMEM(src.shape, jnp.float32, transforms=_transforms(jnp.float32)))


def apply_inverse(t_smem, w_smem, v_smem, transposed=True):
    """``w = T (beta k e^G)`` and ``uᵀ = (beta v)ᵀ Tᵀ`` from ``T``, ``beta k e^G`` (in ``w_smem``) and
    ``beta v`` in SMEM: ``w`` overwrites its operand once read back (committed); returns ``uᵀ``
    [64, 64] fp32 in registers (``transposed=False``: ``u = T (beta v)``, an N-major operand that
    only 16-bit WGMMA takes on the GPU)."""
    u_product = ([(v_smem.T, t_smem.T)], (BLOCK_DV, CHUNK)) if transposed else ([(t_smem, v_smem)], (CHUNK, BLOCK_DV))
    w, u = _products(([(t_smem, w_smem)], w_smem.shape), u_product)
    w_smem[...] = w.astype(w_smem.dtype)
    plgpu.commit_smem()
    return u


def ut_transform(q_s, k_s, v_s, gb_s, t_smem, w_smem, qk_smem, bars, mm_dtype, *, transposed=True,
                 before_inverse=lambda: None, before_commit=lambda: None):
    """One chunk's UT transform on chip, from its q, k ``[64, dk]``, v columns ``[64, 64]`` and
    (g, beta) ``[2, 64]`` in SMEM as TMA delivers them (``bars``: their barriers, in the order gb, q,
    k, v): the decay cumsum ``G``, ``A`` and its blocked inverse ``T`` (into ``t_smem``), the
    causal decayed scores ``qk`` (into ``qk_smem``), ``w = T (beta k e^G)`` (into ``w_smem``), and q,
    k, v rescaled in place to ``q e^G``, ``k e^(G_last - G)`` and ``beta v``. Returns ``uᵀ`` [64, 64]
    fp32 (``transposed=False``: ``u``) and ``G_last`` (per row) in registers. ``before_inverse`` runs before the inverse takes its
    scoped SMEM, ``before_commit`` before the last writes are committed (the caller's hooks: the
    fused kernel waits for its previous chunk's copies and stages its state there)."""
    dk = q_s.shape[-1]
    f32 = jnp.float32
    tile = plgpu.Layout.WGMMA
    C = CHUNK
    sq = (C, C)
    gb_bar, q_bar, k_bar, v_bar = bars
    # Gates: G_i = Σ_{t<=i} g_t as per-row and per-column vectors, G_last broadcast per row.
    # (The index grids are rebuilt per chunk rather than held in 64 registers across a loop.)
    row = plgpu.broadcasted_iota(jnp.int32, sq, 0, layout=tile)
    col = plgpu.broadcasted_iota(jnp.int32, sq, 1, layout=tile)
    plgpu.barrier_wait(gb_bar)
    g_r = plgpu.load(gb_s.at[0], layout=tile.reduce(1))
    g_c = plgpu.load(gb_s.at[0], layout=tile.reduce(0))
    beta_r = plgpu.load(gb_s.at[1], layout=tile.reduce(1))
    beta_c = plgpu.load(gb_s.at[1], layout=tile.reduce(0))
    G_r = jnp.sum(jnp.where(col <= row, _col(g_c, sq), 0.0), axis=1)
    G_c = jnp.sum(jnp.where(row <= col, _row(g_r, sq), 0.0), axis=0)
    G_last = jnp.sum(_col(g_c, sq), axis=1)  # every entry the chunk's total log-decay

    # K Kᵀ and q Kᵀ, then the decayed, masked A, Aᵀ and qk in registers.
    plgpu.barrier_wait(q_bar)
    plgpu.barrier_wait(k_bar)
    kk, qk = _products(([(k_s, k_s.T)], sq), ([(q_s, k_s.T)], sq))
    diff = _row(G_r, sq) - _col(G_c, sq)                     # G_i - G_j
    A = _row(beta_r, sq) * kk * jnp.exp(jnp.where(col < row, diff, -jnp.inf))
    At = _col(beta_c, sq) * kk * jnp.exp(jnp.where(row < col, -diff, -jnp.inf))
    qk_smem[...] = (qk * jnp.exp(jnp.where(col <= row, diff, -jnp.inf))).astype(mm_dtype)

    before_inverse()
    T = pl.run_scoped(functools.partial(_unit_lower_inverse, A, At, row, col),
                      *(plgpu.SMEM(sq, f32, transforms=_transforms(f32)) for _ in range(4)))
    t_smem[...] = T.astype(mm_dtype)

    # beta k e^G into w's buffer; then q, k, v rescaled in place (their raw reads are done).
    kr = plgpu.load(k_s, layout=tile)
    w_smem[...] = (kr * _row(beta_r * jnp.exp(G_r), (C, dk))).astype(mm_dtype)
    k_s[...] = (kr * _row(jnp.exp(G_last - G_r), (C, dk))).astype(mm_dtype)
    q_s[...] = (plgpu.load(q_s, layout=tile) * _row(jnp.exp(G_r), (C, dk))).astype(mm_dtype)
    plgpu.barrier_wait(v_bar)
    v_s[...] = (plgpu.load(v_s, layout=tile) * _row(beta_r, (C, BLOCK_DV))).astype(mm_dtype)
    before_commit()
    plgpu.commit_smem()
    return apply_inverse(t_smem, w_smem, v_s, transposed), G_last


def recurrence(s, ut, decay, s_smem, w_smem, vn_smem, q_smem, qk_smem, k_smem):
    """One chunk of the state recurrence on the transposed state ``s = Sᵀ`` [64, dk] (fp32 registers;
    its operand copy already in ``s_smem``): ``v_newᵀ = uᵀ - Sᵀ wᵀ``, then ``oᵀ = Sᵀ (q e^G)ᵀ +
    v_newᵀ qkᵀ`` and ``Sᵀ ← decay ⊙ Sᵀ + v_newᵀ (k e^(G_last - G))`` with their products issued
    together. ``q_smem`` / ``k_smem`` hold ``q e^G`` / ``k e^(G_last - G)``; ``decay`` is ``e^G_last``
    broadcast to ``s``'s shape. Returns ``(oᵀ, S_newᵀ)``."""
    (ws,) = _products(([(s_smem, w_smem.T)], (BLOCK_DV, CHUNK)))
    vn_smem[...] = (ut - ws).astype(vn_smem.dtype)
    plgpu.commit_smem()
    o, kv = _products(([(s_smem, q_smem.T), (vn_smem, qk_smem.T)], (BLOCK_DV, CHUNK)),
                      ([(vn_smem, k_smem)], s.shape))
    return o, decay * s + kv


def write_chunk_outputs(o, s_new, out_row, o_dst, st_ref, h, cols):
    """A chunk's ``oᵀ`` to ``o_dst`` and, when its end is a requested state (``out_row`` below the
    rows of the compact ``st_ref [R, Hv, dv, dk]``), ``Sᵀ`` to that row, staged through one scoped
    fp32 SMEM region. The copies are left in flight: the next chunk waits for their reads
    (``wait_smem_to_gmem``) before it reuses the scoped region."""
    num_rows = st_ref.shape[0]
    f32 = jnp.float32

    def write(o_smem, st_smem):
        o_smem[...] = o

        @pl.when(out_row < num_rows)
        def _():
            st_smem[...] = s_new

        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem, o_dst)

        @pl.when(out_row < num_rows)
        def _():
            plgpu.copy_smem_to_gmem(st_smem, st_ref.at[out_row, h, cols])

    pl.run_scoped(write, plgpu.SMEM(o.shape, f32, transforms=_transforms(f32)),
                  plgpu.SMEM(s_new.shape, f32, transforms=_transforms(f32)))


def program(first_ref, nchunks_ref, group):
    """This program's sequence ``n``, value head ``h``, key head (``h // group``), first chunk, chunk
    count and state columns (``BLOCK_DV`` of them) on the fused kernels' ``("n", "h", "j")`` grid."""
    n, h, j = (lax.axis_index(axis) for axis in ("n", "h", "j"))
    return n, h, h // group, first_ref[n], nchunks_ref[n], pl.ds(j * BLOCK_DV, BLOCK_DV)


def _kernel(first_ref, nchunks_ref, slot_ref, init_ref, q_ref, k_ref, v_ref, gb_ref,
            ot_ref, st_ref,
            q_smem, k_smem, v_smem, gb_smem, t_smem, w_smem, qk_smem, s_smem, vn_smem, bars,
            *, group, mm_dtype):
    """One (sequence, value head, 64 state columns): walk the sequence's chunks with ``Sᵀ`` in registers."""
    n, h, hk, c0, nc, cols = program(first_ref, nchunks_ref, group)
    dk = q_smem.shape[-1]

    def issue(c, slot):
        """The chunk's four copies into buffer ``slot``, each on its own barrier."""
        plgpu.copy_gmem_to_smem(q_ref.at[c, hk], q_smem.at[slot], bars.at[4 * slot])
        plgpu.copy_gmem_to_smem(k_ref.at[c, hk], k_smem.at[slot], bars.at[4 * slot + 1])
        plgpu.copy_gmem_to_smem(v_ref.at[c, h, :, cols], v_smem.at[slot], bars.at[4 * slot + 2])
        plgpu.copy_gmem_to_smem(gb_ref.at[c, h], gb_smem.at[slot], bars.at[4 * slot + 3])

    @pl.when(nc > 0)
    def _():
        issue(c0, 0)

    s0 = load_initial_state(init_ref.at[n, h, cols], bars.at[8])

    def body(i, s):
        c = c0 + i
        slot = lax.rem(i, 2)
        q_s, k_s, v_s, gb_s = q_smem.at[slot], k_smem.at[slot], v_smem.at[slot], gb_smem.at[slot]
        out_row = slot_ref[c]  # scalar GMEM load first: its latency hides behind the work below

        # The other buffer was last read by chunk c-1, finished before the previous iteration's
        # final commit_smem (a warpgroup barrier): chunk c+1's copies may overwrite it now.
        @pl.when(i + 1 < nc)
        def _():
            issue(c + 1, 1 - slot)

        def previous_copies_done():  # they read the scoped region the inverse reuses
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)

        def stage_state():  # the state's operand copy, committed with the chunk's other writes
            s_smem[...] = s.astype(mm_dtype)

        ut, G_last = ut_transform(q_s, k_s, v_s, gb_s, t_smem, w_smem, qk_smem,
                                  [bars.at[4 * slot + i] for i in (3, 0, 1, 2)], mm_dtype,
                                  before_inverse=previous_copies_done, before_commit=stage_state)
        o, s_new = recurrence(s, ut, _row(jnp.exp(G_last), (BLOCK_DV, dk)), s_smem, w_smem, vn_smem, q_s, qk_smem, k_s)
        write_chunk_outputs(o, s_new, out_row, ot_ref.at[c, h, cols], st_ref, h, cols)
        return s_new

    lax.fori_loop(0, nc, body, s0)
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def smem_bytes(dk: int, matmul_dtype) -> int:
    """The kernel's SMEM: two buffers of q, k, v columns, g and beta; T, w, qk, Sᵀ and v_newᵀ in the
    operand dtype; one scoped region for the larger of the inverse's four fp32 [64, 64] buffers and
    the fp32 output / state staging."""
    mm = jnp.dtype(matmul_dtype).itemsize
    inputs = 2 * ((2 * CHUNK * dk + CHUNK * BLOCK_DV) * mm + 2 * CHUNK * 4)
    persistent = (CHUNK * CHUNK + CHUNK * dk + CHUNK * CHUNK + BLOCK_DV * dk + BLOCK_DV * CHUNK) * mm
    scoped = max(4 * CHUNK * CHUNK * 4, (BLOCK_DV * CHUNK + BLOCK_DV * dk) * 4)
    return inputs + persistent + scoped + 1024  # + barriers, alignment


def tiling_problems(dk: int, dv: int, chunk_size: int, matmul_dtype, interpret: bool, *,
                    gpu_dtypes=GPU_MATMUL_DTYPES, smem=smem_bytes) -> list[str]:
    """What the fused kernels (this one and ``kda_chunk_fused``, which passes its own ``gpu_dtypes``
    and ``smem``) cannot take; empty when they can. 64-token chunks, ``dk`` in {64, 128}, 64 state
    columns per program; on the GPU operands in ``gpu_dtypes`` within the SMEM budget, while the
    interpreter also takes fp32 operands and has no SMEM limit."""
    problems = []
    if chunk_size != CHUNK:
        problems.append(f"chunk_size={chunk_size}: the kernel is built for {CHUNK}")
    if dk not in (64, 128):
        problems.append(f"dk={dk} must be 64 or 128")
    if dv % BLOCK_DV:
        problems.append(f"dv={dv} must be a multiple of {BLOCK_DV}")
    name = jnp.dtype(matmul_dtype).name
    if name not in gpu_dtypes and not (interpret and name == "float32"):
        problems.append(f"matmul_dtype={name}: {gpu_dtypes} on the GPU (float32 in interpret mode only)")
    elif smem(dk, matmul_dtype) > SMEM_BYTES and not interpret:
        problems.append(f"dk={dk} with {name} operands needs {smem(dk, matmul_dtype)} bytes of SMEM")
    return problems


def check_tiling(kernel: str, problems: list[str]) -> None:
    """ValueError naming ``kernel`` and every one of ``problems``, if any."""
    if problems:
        raise ValueError(f"{kernel}: " + "; ".join(problems))


def supports(dk: int, dv: int, matmul_dtype=jnp.bfloat16, interpret: bool = False) -> bool:
    """Whether the fused kernel takes these head dims (``tiling_problems`` states the rules)."""
    return not tiling_problems(dk, dv, CHUNK, matmul_dtype, interpret)


def launch_fused(body, scratch, gate_inputs, q, k, v, cu_seqlens, initial_state, snapshot_seq, snapshot_len,
                 start_pos, *, scale, use_qk_l2norm, max_chunks, matmul_dtype, interpret):
    """The fused kernels' XLA pass around their kernel (this one's and ``kda_chunk_fused``'s; module
    docstring): q and k L2-normalised (q then scaled) in fp32, q, k and v in the operand dtype on
    the absolute chunk grid beside the gate arrays ``gate_inputs(grid)`` lays there, the chunks that
    hold requested states, one launch of ``body`` over ``scratch``, the results back in token order.
    The kernel's inputs are, in order: first chunk and chunk count per sequence, each chunk's state
    row, the transposed initial states, q, k, v, then the gate arrays."""
    T, Hv, dv = v.shape
    dk = q.shape[-1]
    mm = jnp.dtype(matmul_dtype)
    q, k = normalized_qk(q, k, scale, use_qk_l2norm)
    layout = chunk_layout(cu_seqlens, start_pos, T, CHUNK, max_chunks)
    grid = functools.partial(_to_grid, layout=layout, max_chunks=max_chunks, chunk_size=CHUNK)
    req_seq, row, slot_of_chunk = _layout_requests(layout, cu_seqlens, snapshot_seq, snapshot_len,
                                                   max_chunks, CHUNK)
    kernel = chunk_kernel(body, scratch, num_seqs=cu_seqlens.shape[0] - 1, num_rows=req_seq.shape[0],
                          max_chunks=max_chunks, Hv=Hv, dv=dv, dk=dk, block_dv=BLOCK_DV, interpret=interpret,
                          name="delta_chunk_fused")
    ot, states_t = kernel(layout.first_chunk.astype(jnp.int32), layout.num_chunks.astype(jnp.int32),
                          slot_of_chunk, jnp.swapaxes(initial_state, -1, -2),
                          grid(q.astype(mm)), grid(k.astype(mm)), grid(v.astype(mm)), *gate_inputs(grid))
    return gather_states(ot, states_t, layout, req_seq, row, initial_state, cu_seqlens, snapshot_seq,
                         snapshot_len, start_pos)


@functools.partial(jax.jit, static_argnames=("scale", "use_qk_l2norm", "max_chunks", "matmul_dtype", "interpret"))
def _fused(q, k, v, g, beta, cu_seqlens, initial_state, snapshot_seq, snapshot_len, start_pos,
           *, scale, use_qk_l2norm, max_chunks, matmul_dtype, interpret):
    Hv, Hk, dk = v.shape[1], q.shape[1], q.shape[-1]
    f32, mm = jnp.float32, jnp.dtype(matmul_dtype)
    scratch = [
        plgpu.SMEM((2, CHUNK, dk), mm, transforms=_transforms(mm)),        # q, then q e^G
        plgpu.SMEM((2, CHUNK, dk), mm, transforms=_transforms(mm)),        # k, then k e^(G_last - G)
        plgpu.SMEM((2, CHUNK, BLOCK_DV), mm, transforms=_transforms(mm)),  # v columns, then beta v
        plgpu.SMEM((2, 2, CHUNK), f32),                                    # g, beta
        plgpu.SMEM((CHUNK, CHUNK), mm, transforms=_transforms(mm)),        # T
        plgpu.SMEM((CHUNK, dk), mm, transforms=_transforms(mm)),           # beta k e^G, then w
        plgpu.SMEM((CHUNK, CHUNK), mm, transforms=_transforms(mm)),        # qk
        plgpu.SMEM((BLOCK_DV, dk), mm, transforms=_transforms(mm)),        # Sᵀ operand
        plgpu.SMEM((BLOCK_DV, CHUNK), mm, transforms=_transforms(mm)),     # v_newᵀ
        plgpu.Barrier(num_barriers=9),                                     # 2 x (q, k, v, gb), initial state
    ]

    def gate_inputs(grid):  # g and beta side by side: [M, Hv, 2, C]
        return (jnp.swapaxes(grid(jnp.stack([g.astype(f32), beta.astype(f32)], axis=-1)), -1, -2),)

    return launch_fused(functools.partial(_kernel, group=Hv // Hk, mm_dtype=mm), scratch, gate_inputs, q, k, v,
                        cu_seqlens, initial_state, snapshot_seq, snapshot_len, start_pos, scale=scale,
                        use_qk_l2norm=use_qk_l2norm, max_chunks=max_chunks, matmul_dtype=mm, interpret=interpret)


def gdn_chunk_fused(q, k, v, g, beta, *, cu_seqlens, initial_state=None, scale=None, use_qk_l2norm=True,
                    snapshot_seq=None, snapshot_len=None, chunk_size=64, start_pos=None, max_chunks=None,
                    matmul_dtype=jnp.bfloat16, interpret=False):
    """``gdn_chunked`` with the whole chunk on the fused Mosaic GPU kernel. Same arguments and results::

        q, k [T, Hk, dk]; v [T, Hv, dv]; g [T, Hv] log-decay; beta [T, Hv] (sigmoided);
        cu_seqlens int32 [N+1]; initial_state [N, Hv, dk, dv] fp32 or None; start_pos [N] (default 0);
        snapshot_seq / snapshot_len int32 [S] or None
        -> (o [T, Hv, dv] in v.dtype, final [N, Hv, dk, dv] fp32, snapshots [S, Hv, dk, dv] or None)

    Snapshots exist at lengths 0, the whole sequence, or ``(start_pos + len) % 64 == 0``; others
    raise ``ValueError`` when concrete and come back NaN under ``jit`` (as in the reference).
    ``matmul_dtype`` (static): operand dtype of the products outside the inverse (bf16 on the GPU;
    fp32 with ``interpret`` only). ``interpret``: Mosaic GPU's interpreter (CPU tests).
    """
    gate = _per_head_gate(v, g)
    check_tiling("gdn_chunk_fused", tiling_problems(q.shape[-1], v.shape[-1], chunk_size, matmul_dtype, interpret))
    return run_chunked(_fused, q, k, v, g, beta, gate=gate, cu_seqlens=cu_seqlens, initial_state=initial_state,
                       snapshot_seq=snapshot_seq, snapshot_len=snapshot_len, start_pos=start_pos,
                       max_chunks=max_chunks, scale=scale, use_qk_l2norm=use_qk_l2norm,
                       matmul_dtype=jnp.dtype(matmul_dtype).name, interpret=interpret)
