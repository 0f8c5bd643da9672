"""Routed MoE experts: grouped GEMMs in Pallas Mosaic GPU (sm_90): 64-row tiles for prefill, swap-AB for decode.

Replaces the routed part of ``jaxserve.models.layers.moe``, whose ``lax.ragged_dot`` XLA lowers on
the GPU to masked dense work over every expert (at batch 1 a 64-expert top-8 layer reads all 64
experts' weights, 8x what the step needs; at a 4096-token prefill it does 8x the FLOPs).

Grouped GEMM (``grouped_matmul``, and the two GEMMs of ``moe_experts`` at prefill sizes)
-------------------------------------------------------------------------------------
Rows sorted by expert (``xs [M, K]``, ``group_sizes [E]``) times per-expert weights ``[E, K, N]``.

* Padded layout (XLA, before the kernel): each expert's rows start on a multiple of ``block_m``
  (``BLOCK_M`` = 64, one WGMMA M), so every ``block_m``-row tile belongs to exactly one expert. Expert ``e`` owns
  ``ceil(group_sizes[e] / block_m)`` tiles; their sum never exceeds
  ``num_tiles = M // block_m + min(E, M)`` (the floors sum to at most ``M // block_m``, and only a
  non-empty group has a partial tile), a static bound, so the padded row count
  ``num_tiles * block_m`` is static whatever the routing. A per-tile expert id array plus the used
  tile count (``tiles``, int32 ``[num_tiles + 1]``) is the kernel's scalar-prefetch-like input.
  Rows are moved into the padded layout by one XLA gather (padding rows are zero rows), the same
  cost as the ``xt[token_of]`` gather of the jnp path.
* Kernel: a grid of (N tile, row tile) programs, N tiles fastest, so the programs that run together
  share one row tile (the x tile is read once from HBM, then from L2) and neighbouring row tiles
  share an expert (its weight tiles are read once, then from L2). A program whose row tile is past
  the used count returns at once: no weight byte of an empty expert is read and no tile of padding
  is multiplied. A used program walks K in ``block_k`` steps through a ring of ``stages`` SMEM
  buffers (TMA copies, one barrier per buffer and operand; the copies of steps ``s+1 ..
  s+stages-1`` are in flight while step ``s`` multiplies) with WGMMA into fp32 accumulators, then
  runs the epilogue in registers and leaves by one TMA store of its ``[block_m, block_n]`` tile.
* The gate/up GEMM is fused: a program multiplies its x tile by the gate columns ``[j*bn,
  (j+1)*bn)`` AND the up columns ``[I + j*bn, ...)`` of ``gate_up [E, H, 2I]`` (two accumulators)
  and writes ``silu(gate) * up`` (fp32, rounded once to the activation dtype): the ``[M, 2I]``
  intermediate never exists. The down GEMM's epilogue scales each row by its routing weight
  (fp32, before the one rounding; the weights reach the registers through SMEM), so the un-sort is
  a gather of each token's ``top_k`` rows and an fp32 sum (no scatter-add).
* Reads per GEMM: each used expert's weights once per row tile it owns (from HBM for the first,
  mostly L2 after), the x rows once per N tile (L2 after the first), nothing of an empty expert.

Small-row (decode) path: swap-AB grouped GEMM (``grouped_gemm_small``)
-----------------------------------------------------------------------
A decode step has few routed rows per expert (1 token of top-8: 8 rows on 8 experts; 32 tokens:
256 rows, ~4 on each of nearly all 64 experts). In 64-row tiles (one WGMMA M) that is 1 / 64 of the
tensor core's work used and, at batch 1, a gate/up grid of 8 experts x 4 N tiles; the XLA gather
path instead reads the used experts' bytes ~3 times (read, write the copy, read it for the dot).
Swap-AB makes the WEIGHTS the WGMMA M operand and the tokens its N operand:

* Layout: the same padded layout in ``R``-row tiles (``padded_layout(.., block_m=R)``, ``R`` in 8 /
  16 / 32, WGMMA N a multiple of 8; ``small_block_rows``: the smallest at least twice the mean rows
  per expert, ``2 n k / E``: 8 up to ``4 E`` routed rows (1 to 32 tokens of the 64-expert top-8
  layer), 16 up to ``8 E`` (64 tokens), 32 above), the per-tile expert ids and used tile count as
  above; a program past the used count returns at once (reads nothing).
  Up to ``PAIR_TILE_MAX_ROWS`` routed rows (two tokens of top-8) no sort at all: a tile per (token,
  slot) pair, its first row the token (``pair_tiles``), the routing's expert ids as the table. One
  token's pairs name distinct experts, so it reads what the sorted layout reads; the sort it skips
  was ~10 XLA kernels per layer of a batch-1 decode step, more time than the layer's expert bytes.
* Program (column tile j, row tile i), grid (N / 64, num_tiles), column tiles fastest:
  ``acc[64, R] = w[e][:, 64j : 64j+64]^T @ x[rows(i)]^T`` in fp32. A = the weight tile ``[block_k,
  64]`` as TMA brings it (128-byte swizzle over its 64 columns), used through a transposed view
  (MN-major A: sm_90 WGMMA takes it for 16-bit types); B = the ``[R, block_k]`` row tile, through a
  transposed view (``[block_k, R]``, K-major: WGMMA's native B). Same ring as above (``stages``
  SMEM slots per operand, one barrier each, ``block_k`` = 64 bf16), the fused gate/up (two ``[64,
  R]`` accumulators for the gate columns ``64j..`` and the up columns ``I + 64j..``, epilogue
  ``silu(gate) * up`` in fp32, rounded once), and the down GEMM's routing weights (per tile, ``R``
  fp32 padded to 32 so the TMA copy is 128 bytes; loaded in the accumulator's column layout, a
  routed row being a column of ``acc``).
* Output: in row order, ``[rows, N]`` like the 64-row kernel: the epilogue stores the ``[64, R]``
  accumulator through a transposed view of a ``[R, 64]`` SMEM tile (128-byte swizzle), then one
  TMA store. So the gate/up output is the down GEMM's ``[rows, I]`` operand as it is and the
  un-sort is the same gather + fp32 sum: no XLA transpose between or after the kernels.
  (``transposed_out``: store the ``[64, R]`` tile as it is into ``[N, rows]``, an unswizzled
  16-byte-row tile at R = 8; kept, tested, for the case the transposed SMEM store is slow on the
  GPU; the small ``[n k, N]`` results would then be transposed by XLA.)
* Reads: every used expert's gate_up and down bytes once per row tile it owns (one tile whenever
  its rows fit ``R``: the rule above makes that the common case; a second tile runs right after
  the first, so from L2), the ``R`` rows once per column tile (L2 after the first), nothing of an
  unused expert. 64-column tiles: I / 64 = 8 gate/up and H / 64 = 32 down column tiles per used
  expert tile at the target layer (at batch 1: 64 gate/up programs of 512 KiB and 256 down
  programs of 64 KiB).
* SMEM per program (``small_smem_bytes``, bf16, ``block_k`` 64): ``(stages * (R + nw * 64) *
  block_k + 64 R) * 2 + 4 max(R, 32)`` bytes (``nw`` = 2 fused, else 1): fused 69 / 74 / 84 KiB at
  R = 8 / 16 / 32 and 4 stages (three programs per SM), down 37 KiB at R = 8.
* ``moe_experts`` takes it (once ``SMALL_PATH_ON``: see Status) at ``n * k <= SMALL_MAX_ROWS`` (512: 64 tokens of top-8) where it tiles
  (``small_supports``: H and I multiples of 64); above, the 64-row kernel, whose 64-row tiles are
  full enough there.

Gather path (``moe_experts_gather``): reference and fallback
-----------------------------------------------------------
Every expert a token uses is gathered (``gate_up[top_i]``, ``down[top_i]``) and multiplied by that
token's row alone (batched matmul-vector products in XLA, fp32 accumulation). XLA reads the
gathered experts' bytes, writes the gathered copy and reads it back for the dot (it does not fuse a
gather into a GEMM operand): at most 3x the used experts' bytes, against ``ragged_dot``'s
dense lowering reading all ``E`` experts. ``moe_experts`` takes it below ``gather_below`` routed
rows: by default only where the small path cannot tile the layer (e.g. the shipped test model's
I = 32) and ``n * k < E``. ``benchmarks/kernels.py --only moe`` times it beside the kernels at
n = 1, 8, 32.

Numerics (all paths): products accumulate in fp32; ``silu(gate) * up`` in fp32, rounded once to
the activation dtype (it is the next GEMM's operand); the down products accumulate in fp32 and are
scaled by the fp32 routing weights, rounded once; the ``top_k`` contributions of a token are summed
in fp32 and returned in fp32. ``layers.moe``'s jnp path rounds after each op instead, so bf16
results differ from it by bf16 roundings; in fp32 they agree to summation order.

Contract (GPU): bf16 or fp16 activations and weights (fp32 would be tf32 WGMMA with an MN-major
B operand, which sm_90 does not have; fp32 runs only in interpret mode, for tests); hidden and
expert intermediate sizes that ``default_blocks`` tiles (``supports``: multiples of 16; 64 gives
the 128-byte swizzle; the small path also wants multiples of 64, ``small_supports``, and is
skipped otherwise); ``sum(group_sizes) <= M``. The small path's MN-major A / transposed views are
16-bit-only on sm_90 too (fp32: interpret mode only, as above).

Status: the 64-row kernel and the gather path: correct in Mosaic GPU's interpreter on the CPU
(tests/pallas_kernels/test_moe.py) and on an H100 (``benchmarks/gpu_check.py --suites moe``: 15 /
15, 1 to 4096 tokens); in ``jaxserve.models.backends.AUTO_ON_GPU``. The small path: interpret-mode
tested (and lowered for sm_90 at the target shapes) and correct on an H100 (gpu_check variants
``moe_small``, ``_s2``, ``_r16``, ``_tr`` at 1, 8 and 32 tokens of the real-size layer, relative
error 0.22-0.25 % against float64 like the 64-row kernel's), so on by default (``SMALL_PATH_ON``). Timings: ``benchmarks/kernels.py --only moe``, benchmarks/RESULTS.md "MoE
experts".
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

BLOCK_M = 64  # rows per tile: one WGMMA M (one warpgroup); also the padding granule of every group
GPU_DTYPES = (jnp.bfloat16, jnp.float16)
MIN_PROGRAMS = 256  # about two programs per SM (132 on the H100 / H200): below it, narrower N tiles


def _transforms(dtype, minor: int):
    """Tiling + swizzle of an SMEM tile whose last dim holds ``minor`` elements (the largest swizzle
    that divides its rows, at most 128 bytes)."""
    swizzle = plgpu.find_swizzle(minor * jnp.dtype(dtype).itemsize * 8)
    return (plgpu.TilingTransform((8, swizzle // jnp.dtype(dtype).itemsize)), plgpu.SwizzleTransform(swizzle))


def default_blocks(k: int, n: int, dtype, tiles: int, fused: bool) -> tuple[int, int]:
    """``(block_k, block_n)`` of a GEMM with reduction size ``k`` and ``n`` output columns (fused:
    ``n`` gate and ``n`` up columns) over ``tiles`` row tiles; ``(0, 0)`` when no tiling fits.

    ``block_k``: 128 bytes of a row (64 bf16: the 128-byte swizzle WGMMA reads fastest), else 64 or
    32 bytes, the largest that divides ``k`` and leaves a ``block_n`` (the weight tile's swizzle is
    the x tile's, so ``block_n`` is a multiple of ``block_k``). ``block_n``: 128 fused (128 gate +
    128 up columns: two 64x128 fp32 accumulators) or 256 (one 64x256 accumulator), the widest tile
    one warpgroup holds; 64 when the wide tiles would make fewer than ``MIN_PROGRAMS`` programs
    (decode: a bandwidth-bound step must spread its expert bytes over many SMs); a smaller one when
    that does not divide ``n``. Untuned: benchmarks/kernels.py --only moe times the defaults."""
    step = 128 // jnp.dtype(dtype).itemsize
    wide = 128 if fused else 256
    want = wide if tiles * (n // wide) >= MIN_PROGRAMS else 64
    for bk in (step, step // 2, step // 4):
        if k % bk:
            continue
        bn = next((bn for bn in (256, 128, 64, 32, 16) if bn <= want and n % bn == 0 and bn % bk == 0), 0)
        if bn:
            return bk, bn
    return 0, 0


def supports(hidden: int, intermediate: int, dtype, *, gpu: bool = True) -> bool:
    """Whether the kernels take a layer of this hidden / expert intermediate size and activation
    dtype (gate_up ``[E, hidden, 2 * intermediate]`` fused, down ``[E, intermediate, hidden]``), at
    every routed row count."""
    if gpu and jnp.dtype(dtype) not in map(jnp.dtype, GPU_DTYPES):
        return False
    return all(default_blocks(k, n, dtype, tiles, fused)[0]
               for k, n, fused in ((hidden, intermediate, True), (intermediate, hidden, False))
               for tiles in (1, 10**6))


# ------------------------------------------------------------------------------------------------
# Padded layout (XLA)
# ------------------------------------------------------------------------------------------------


class Layout(NamedTuple):
    """Where the expert-sorted rows go in the padded layout.

    ``tiles`` int32 ``[num_tiles + 1]``: the expert of each ``block_m``-row tile, then the number of
    used tiles (tiles past it belong to no expert and are skipped; their expert id is clamped to
    E-1, never read). ``pos`` int32 ``[M]``: the padded row of sorted row ``j`` (``num_tiles *
    block_m``, out of range, for rows past ``sum(group_sizes)``, which belong to no group)."""

    tiles: jax.Array
    pos: jax.Array
    block_m: int = BLOCK_M  # rows per tile (static): 64 for the grouped kernel, 8 / 16 / 32 for the small path

    @property
    def num_rows(self) -> int:
        return (self.tiles.shape[0] - 1) * self.block_m


def num_tiles(num_rows: int, num_experts: int, block_m: int = BLOCK_M) -> int:
    """Static bound on the ``block_m``-row tiles of ``num_rows`` routed rows: ``Σ_e ceil(g_e / b) <=
    M // b + #{e: g_e % b != 0} <= M // b + min(E, M)``."""
    return num_rows // block_m + min(num_experts, num_rows)


def padded_layout(group_sizes: jax.Array, num_rows: int, block_m: int = BLOCK_M) -> Layout:
    """The padded layout of ``num_rows`` expert-sorted rows with these group sizes, in
    ``block_m``-row tiles (jnp ops only: the routing is data, the shapes are static)."""
    E = group_sizes.shape[0]
    gs = group_sizes.astype(jnp.int32)
    nt = num_tiles(num_rows, E, block_m)
    tiles_per = (gs + block_m - 1) // block_m
    tile_end = jnp.cumsum(tiles_per)
    tile_start = tile_end - tiles_per
    # compare_all: one fused compare-and-count; the default method is a loop of tiny GPU kernels
    expert = jnp.searchsorted(tile_end, jnp.arange(nt, dtype=jnp.int32), side="right", method="compare_all")
    tiles = jnp.concatenate([jnp.minimum(expert, E - 1), tile_end[-1:]]).astype(jnp.int32)
    row_end = jnp.cumsum(gs)
    j = jnp.arange(num_rows, dtype=jnp.int32)
    e = jnp.searchsorted(row_end, j, side="right", method="compare_all")
    ec = jnp.minimum(e, E - 1)
    pos = tile_start[ec] * block_m + j - (row_end[ec] - gs[ec])
    return Layout(tiles, jnp.where(e < E, pos, nt * block_m).astype(jnp.int32), block_m)


COMPARE_MAX_ROWS = 1024  # pair_layout ranks up to this many routed rows by comparing every pair


def pair_layout(flat: jax.Array, num_experts: int, block_m: int = BLOCK_M) -> tuple[Layout, jax.Array]:
    """The padded layout of the routed rows ``flat [M]`` (pair ``t * k + s``'s expert id) in
    ``block_m``-row tiles, and ``pos [M]``: each pair's padded row (its expert's first row, plus the
    pairs before it with the same expert: the stable sort's order).

    Up to ``COMPARE_MAX_ROWS`` rows (decode) every pair is compared with every other and with each
    expert id: a few fused elementwise-and-reduce kernels, where a stable argsort is a radix sort
    of several kernels and the bincount a scatter (at batch 1 a decode step's 24 MoE layers spent
    more time launching those than moving their bytes). Above it, the argsort."""
    M = flat.shape[0]
    ids = jnp.arange(num_experts, dtype=jnp.int32)
    if M > COMPARE_MAX_ROWS:
        order = jnp.argsort(flat, stable=True)
        lay = padded_layout(jnp.bincount(flat, length=num_experts).astype(jnp.int32), M, block_m)
        return lay, jnp.zeros((M,), jnp.int32).at[order].set(lay.pos, unique_indices=True)
    group_sizes = jnp.sum(flat[:, None] == ids[None, :], axis=0, dtype=jnp.int32)
    lay = padded_layout(group_sizes, M, block_m)
    j = jnp.arange(M, dtype=jnp.int32)
    rank = jnp.sum((flat[:, None] == flat[None, :]) & (j[None, :] < j[:, None]), axis=1, dtype=jnp.int32)
    tiles_per = (group_sizes + block_m - 1) // block_m
    tile_start = jnp.cumsum(tiles_per) - tiles_per
    return lay, (tile_start[flat] * block_m + rank).astype(jnp.int32)


# ------------------------------------------------------------------------------------------------
# Kernel
# ------------------------------------------------------------------------------------------------


def _kernel(tiles_ref, x_ref, w_ref, *refs, block_n, block_k, stages, fused, scaled):
    """One (N tile j, row tile i): ``x[i] @ w[expert(i)][:, cols(j)]`` and the epilogue, or nothing
    when tile i is past the used count."""
    if scaled:
        rw_ref, o_ref, x_smem, w_smem, o_smem, rw_smem, bars = refs
    else:
        rw_ref, rw_smem, (o_ref, x_smem, w_smem, o_smem, bars) = None, None, refs
    j = lax.axis_index("n")
    i = lax.axis_index("m")
    bm, bn, bk = BLOCK_M, block_n, block_k
    nk = x_ref.shape[1] // bk
    half = o_ref.shape[1]  # fused: the up columns start here in w (w is [E, K, 2 * half])
    cols = (j * bn,) + ((half + j * bn,) if fused else ())
    nops = len(cols)
    per_slot = 1 + nops  # barriers per ring slot: the x tile and each weight tile
    rows = pl.ds(i * bm, bm)

    @pl.when(i < tiles_ref[tiles_ref.shape[0] - 1])
    def _():
        e = tiles_ref[i]
        if scaled:  # the rows' weights reach registers through SMEM (no row-layout load from GMEM)
            rw_bar = bars.at[stages * per_slot]
            plgpu.copy_gmem_to_smem(rw_ref.at[rows], rw_smem, rw_bar)

        def issue(s):
            slot = s % stages
            ks = pl.ds(s * bk, bk)
            plgpu.copy_gmem_to_smem(x_ref.at[rows, ks], x_smem.at[slot], bars.at[slot * per_slot])
            for op, c0 in enumerate(cols):
                plgpu.copy_gmem_to_smem(w_ref.at[e, ks, pl.ds(c0, bn)], w_smem.at[op, slot],
                                        bars.at[slot * per_slot + 1 + op])

        def products(*accs):
            for s in range(min(stages - 1, nk)):
                issue(s)

            def step(s, carry):
                slot = lax.rem(s, stages)
                for b in range(per_slot):
                    plgpu.barrier_wait(bars.at[slot * per_slot + b])
                for op, acc in enumerate(accs):
                    plgpu.wgmma(acc, x_smem.at[slot], w_smem.at[op, slot])
                plgpu.wgmma_wait(nops)  # step s-1's products are done: its slot takes step s+stages-1

                @pl.when(s + stages - 1 < nk)
                def _():
                    issue(s + stages - 1)

                return carry

            lax.fori_loop(0, nk, step, 0)
            return tuple(acc[...] for acc in accs)

        out = pl.run_scoped(products, *(plgpu.ACC((bm, bn), jnp.float32) for _ in range(nops)))
        if fused:
            gate, up = out
            h = gate / (1.0 + jnp.exp(-gate)) * up
        else:
            (h,) = out
        if scaled:
            plgpu.barrier_wait(rw_bar)
            w_rows = plgpu.load(rw_smem, layout=plgpu.Layout.WGMMA.reduce(1))
            h = h * lax.broadcast_in_dim(w_rows, h.shape, [0])
        o_smem[...] = h.astype(o_smem.dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem, o_ref.at[rows, pl.ds(j * bn, bn)])
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def _interpret_params(interpret):
    """``interpret``: False (compile for the GPU), True (Mosaic GPU's interpreter, defaults) or an
    ``InterpretGPUParams`` (e.g. with ``detect_races=True``, as a test asks)."""
    if isinstance(interpret, plgpu.InterpretGPUParams):
        return interpret
    return plgpu.InterpretGPUParams() if interpret else False


def grouped_gemm_padded(xp, w, tiles, row_weights=None, *, fused=False, block_n=None, block_k=None, stages=4,
                        interpret=False):
    """The kernel on the padded layout: ``xp [num_tiles * 64, K]`` (tile ``t`` of rows times expert
    ``tiles[t]``'s weights, for ``t < tiles[-1]``), ``w [E, K, N]``, both bf16 / fp16 on the GPU.

    Returns ``[num_tiles * 64, N]`` in ``xp.dtype`` (``fused``: ``[.., N / 2]``, ``silu(x w[:, :N/2])
    * (x w[:, N/2:])``); rows of unused tiles are left unwritten. ``row_weights`` fp32
    ``[num_tiles * 64]`` scales each output row (before its one rounding). ``block_n`` / ``block_k``
    default to ``default_blocks``; ``stages`` (>= 2) SMEM ring buffers per operand. SMEM: ``stages *
    (64 + nw * block_n) * block_k + 64 * block_n`` elements (``nw`` = 2 fused, else 1): 176 KiB for
    the fused bf16 defaults at 4 stages (one program per SM), 96 KiB at 2 (two per SM)."""
    Mp, K = xp.shape
    E, K2, Nw = w.shape
    if K2 != K or xp.dtype != w.dtype or Mp % BLOCK_M or tiles.shape != (Mp // BLOCK_M + 1,):
        raise ValueError(f"moe grouped GEMM: x {xp.shape} {xp.dtype}, w {w.shape} {w.dtype}, tiles {tiles.shape}")
    N = Nw // 2 if fused else Nw
    bk, bn = default_blocks(K, N, xp.dtype, Mp // BLOCK_M, fused)
    block_k, block_n = block_k or bk, block_n or bn
    if (not block_k or K % block_k or not block_n or N % block_n or block_n % block_k or (fused and Nw % 2)
            or stages < 2):
        raise ValueError(f"moe grouped GEMM: K={K}, N={N} (fused={fused}) do not fit block_k={block_k}, "
                         f"block_n={block_n}, stages={stages}")
    stages = min(stages, max(2, K // block_k))  # no more buffers than K steps
    nops = 2 if fused else 1
    in_t = _transforms(xp.dtype, block_k)
    scratch = [
        plgpu.SMEM((stages, BLOCK_M, block_k), xp.dtype, transforms=in_t),
        plgpu.SMEM((nops, stages, block_k, block_n), w.dtype, transforms=in_t),
        plgpu.SMEM((BLOCK_M, block_n), xp.dtype, transforms=_transforms(xp.dtype, block_n)),
        *([plgpu.SMEM((BLOCK_M,), jnp.float32)] if row_weights is not None else []),
        plgpu.Barrier(num_barriers=stages * (1 + nops) + (row_weights is not None)),
    ]
    kernel = plgpu.kernel(
        functools.partial(_kernel, block_n=block_n, block_k=block_k, stages=stages, fused=fused,
                          scaled=row_weights is not None),
        kernel_name="moe_gemm",
        out_type=jax.ShapeDtypeStruct((Mp, N), xp.dtype),
        grid=(N // block_n, Mp // BLOCK_M),
        grid_names=("n", "m"),
        scratch_types=scratch,
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane),
        interpret=_interpret_params(interpret),
    )
    args = (tiles, xp, w) + (() if row_weights is None else (row_weights.astype(jnp.float32),))
    return kernel(*args)


@functools.partial(jax.jit, static_argnames=("block_n", "block_k", "stages", "interpret"))
def grouped_matmul(xs, w, group_sizes, *, block_n=None, block_k=None, stages=4, interpret=False):
    """``lax.ragged_dot(xs, w, group_sizes)`` by the kernel: ``xs [M, K]`` sorted by group, ``w
    [E, K, N]``, ``group_sizes [E]`` int32 (rows past their sum give 0). Returns ``[M, N]`` in
    ``xs.dtype`` (fp32 accumulation, one rounding)."""
    M = xs.shape[0]
    lay = padded_layout(group_sizes, M)
    src = jnp.full((lay.num_rows,), M, jnp.int32).at[lay.pos].set(jnp.arange(M, dtype=jnp.int32), mode="drop")
    xp = jnp.concatenate([xs, jnp.zeros((1, xs.shape[1]), xs.dtype)])[src]
    out = grouped_gemm_padded(xp, w, lay.tiles, block_n=block_n, block_k=block_k, stages=stages, interpret=interpret)
    return jnp.where((lay.pos < lay.num_rows)[:, None], out[jnp.minimum(lay.pos, lay.num_rows - 1)], 0)


# ------------------------------------------------------------------------------------------------
# Small-row (decode) path: swap-AB grouped GEMM
# ------------------------------------------------------------------------------------------------

BLOCK_W = 64  # weight output columns per program: the WGMMA M of the swap-AB kernel
SMALL_MAX_ROWS = 512  # the small path's reach: up to this many routed rows (64 tokens of top-8)
# Whether moe_experts takes the small path by default (small_max_rows=None): on since its GPU check
# passed (Status in the module docstring); a kernel enters the serving path only after that.
SMALL_PATH_ON = True
SMALL_BLOCK_ROWS = (8, 16, 32)  # row tiles of the small path (WGMMA N: a multiple of 8)


def small_block_rows(num_rows: int, num_experts: int) -> int:
    """Rows per tile of the small path for ``num_rows`` routed rows over ``num_experts`` experts:
    the smallest of 8 / 16 / 32 at least twice the mean rows per expert (``2 M / E``), so at
    uniform routing nearly every used expert fits one tile (its weights read once) and the padding
    the tensor core multiplies stays small (8 at up to ``4 E`` rows: 1 to 32 tokens of a 64-expert
    top-8 layer; 16 up to ``8 E``: 64 tokens; 32 above)."""
    return next((r for r in SMALL_BLOCK_ROWS if 2 * num_rows <= r * num_experts), SMALL_BLOCK_ROWS[-1])


def small_blocks(k: int, n: int, dtype) -> int:
    """``block_k`` of a small-path GEMM with reduction size ``k`` and ``n`` output columns (fused:
    ``n`` gate and ``n`` up columns); 0 when it does not tile: ``n`` a multiple of ``BLOCK_W`` (64
    weight columns, the WGMMA M and the weight tile's 128-byte swizzle row in bf16), ``block_k`` =
    128 bytes of a row (64 bf16), else 64 or 32 bytes, the largest that divides ``k``."""
    if n % BLOCK_W:
        return 0
    step = 128 // jnp.dtype(dtype).itemsize
    return next((bk for bk in (step, step // 2, step // 4) if k % bk == 0), 0)


def small_supports(hidden: int, intermediate: int, dtype) -> bool:
    """Whether the small path tiles a layer of this hidden / expert intermediate size."""
    return bool(small_blocks(hidden, intermediate, dtype) and small_blocks(intermediate, hidden, dtype))


def _kernel_small(*refs, block_rows, block_k, stages, fused, scaled, transposed_out, table, counted, based,
                  tiles_per_expert, base_scale):
    """One (column tile j, row tile i) of the swap-AB GEMM: ``acc[64, R] = w[e][:, cols(j)]^T @
    x[rows(i)]^T`` (the weight tile is WGMMA's A operand, MN-major; the row tile its B, K-major)
    and the epilogue; written as the ``[R, 64]`` tile of ``o [rows, N]`` through a transposed
    view of the SMEM output tile (``transposed_out``: as the ``[64, R]`` tile of ``o [N, rows]``).

    ``e`` = ``tiles[i]`` (``table``; else ``i // tiles_per_expert``) plus ``base_scale * base[0]``
    (``based``). Nothing when row tile i is past the used count (``counted``: the table's last
    entry; else every tile is used)."""
    refs = list(refs)
    tiles_ref = refs.pop(0) if table else None
    base_ref = refs.pop(0) if based else None
    x_ref, w_ref, *refs = refs
    if scaled:
        rw_ref, o_ref, x_smem, w_smem, o_smem, rw_smem, bars = refs
    else:
        rw_ref, rw_smem, (o_ref, x_smem, w_smem, o_smem, bars) = None, None, refs
    j = lax.axis_index("n")
    i = lax.axis_index("m")
    br, bw, bk = block_rows, BLOCK_W, block_k
    nk = x_ref.shape[1] // bk
    half = o_ref.shape[0 if transposed_out else 1]  # fused: the up columns start here in w (w is [E, K, 2 * half])
    cols = (j * bw,) + ((half + j * bw,) if fused else ())
    nops = len(cols)
    per_slot = 1 + nops
    rows = pl.ds(i * br, br)

    @pl.when(i < tiles_ref[tiles_ref.shape[0] - 1] if counted else True)
    def _():
        e = tiles_ref[i] if table else i // tiles_per_expert
        if based:
            e = e + base_ref[0] * base_scale
        if scaled:
            rw_bar = bars.at[stages * per_slot]
            plgpu.copy_gmem_to_smem(rw_ref.at[i], rw_smem, rw_bar)  # [max(R, 32)]: R weights, then 0s

        def issue(s):
            slot = s % stages
            ks = pl.ds(s * bk, bk)
            plgpu.copy_gmem_to_smem(x_ref.at[rows, ks], x_smem.at[slot], bars.at[slot * per_slot])
            for op, c0 in enumerate(cols):
                plgpu.copy_gmem_to_smem(w_ref.at[e, ks, pl.ds(c0, bw)], w_smem.at[op, slot],
                                        bars.at[slot * per_slot + 1 + op])

        def products(*accs):
            for s in range(min(stages - 1, nk)):
                issue(s)

            def step(s, carry):
                slot = lax.rem(s, stages)
                for b in range(per_slot):
                    plgpu.barrier_wait(bars.at[slot * per_slot + b])
                xt = x_smem.at[slot].transpose((1, 0))  # [bk, R]: B, K-major (plgpu.transpose_ref)
                for op, acc in enumerate(accs):
                    plgpu.wgmma(acc, w_smem.at[op, slot].transpose((1, 0)), xt)  # A [64, bk]: MN-major
                plgpu.wgmma_wait(nops)  # step s-1's products are done: its slot takes step s+stages-1

                @pl.when(s + stages - 1 < nk)
                def _():
                    issue(s + stages - 1)

                return carry

            lax.fori_loop(0, nk, step, 0)
            return tuple(acc[...] for acc in accs)

        out = pl.run_scoped(products, *(plgpu.ACC((bw, br), jnp.float32) for _ in range(nops)))
        if fused:
            gate, up = out
            h = gate / (1.0 + jnp.exp(-gate)) * up
        else:
            (h,) = out
        if scaled:  # a routed row is a column of acc
            plgpu.barrier_wait(rw_bar)
            w_rows = plgpu.load(rw_smem.at[pl.ds(0, br)], layout=plgpu.Layout.WGMMA.reduce(0))
            h = h * lax.broadcast_in_dim(w_rows, h.shape, [1])
        if transposed_out:
            o_smem[...] = h.astype(o_smem.dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(o_smem, o_ref.at[pl.ds(j * bw, bw), rows])
        else:  # o_smem is [R, 64]: acc's transpose goes through the store's addressing
            o_smem.transpose((1, 0))[...] = h.astype(o_smem.dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(o_smem, o_ref.at[rows, pl.ds(j * bw, bw)])
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def small_smem_bytes(block_rows: int, block_k: int, stages: int, fused: bool, itemsize: int = 2) -> int:
    """SMEM of one small-path program: the ring (``stages`` x tiles of ``R x block_k`` rows and
    ``nw`` weight tiles of ``block_k x 64``), the ``64 x R`` output tile and the fp32 row weights."""
    nw = 2 if fused else 1
    return (stages * (block_rows + nw * BLOCK_W) * block_k + BLOCK_W * block_rows) * itemsize + 4 * max(block_rows, 32)


def grouped_gemm_small(xp, w, tiles, row_weights=None, *, block_rows, fused=False, block_k=None, stages=4,
                       transposed_out=False, out_dtype=None, tile_count=True, tiles_per_expert=1, tile_base=None,
                       base_scale=1, name="moe_small", interpret=False):
    """The swap-AB kernel on the padded layout of ``block_rows``-row tiles: ``xp [num_tiles * R,
    K]`` (tile ``t`` of rows times expert ``tiles[t]``'s weights, for ``t < tiles[-1]``), ``w [E,
    K, N]``.

    Other tile tables, each sparing the XLA kernel that would compute one (a decode step runs this
    kernel ~150 times, and at batch 1 the small kernels around it cost more than its bytes):
    ``tile_count=False``: ``tiles [num_tiles]`` without the count, every tile used (the MoE pair
    tiles: the routing's expert ids as they are); ``tiles=None``: tile ``t`` multiplies expert
    ``t // tiles_per_expert``, every tile used (``linear_small``'s K splits). ``tile_base`` (traced
    int32 scalar) and ``base_scale`` (static): the expert is ``base_scale * tile_base`` further on,
    the kernel adding it as it reads the table (a layer's rows of a stacked weight, the decoder's
    scan).

    Returns ``[num_tiles * R, N]`` in ``xp.dtype`` (``fused``: ``[.., N / 2]``, ``silu(x w[:, :N/2])
    * (x w[:, N/2:])``), as ``grouped_gemm_padded``; rows of unused tiles are left unwritten.
    ``transposed_out``: the transposed result ``[N (or N / 2), num_tiles * R]`` instead, each
    program's ``[64, R]`` accumulator stored as it is (the default stores it through a transposed
    view of a ``[R, 64]`` SMEM tile, so the next GEMM takes it without an XLA transpose).
    ``row_weights`` fp32 ``[num_tiles * R]`` scales each row (output column) before its one
    rounding. ``out_dtype``: the result's dtype (default ``xp.dtype``; fp32 for partial products
    summed later, ``pallas_kernels.linear_small``). ``block_k`` defaults to ``small_blocks``. SMEM:
    ``small_smem_bytes`` (fused bf16, R = 8, 4 stages: 69 KiB)."""
    Mp, K = xp.shape
    E, K2, Nw = w.shape
    R = block_rows
    table = tiles is not None
    want = (Mp // R + tile_count,) if table else None
    if (K2 != K or xp.dtype != w.dtype or R % 8 or R > 64 or Mp % R or (table and tiles.shape != want)
            or (fused and Nw % 2)):
        raise ValueError(f"moe small GEMM: x {xp.shape} {xp.dtype}, w {w.shape} {w.dtype}, tiles "
                         f"{None if tiles is None else tiles.shape}, block_rows {R}")
    N = Nw // 2 if fused else Nw
    out_dtype = jnp.dtype(out_dtype or xp.dtype)
    block_k = block_k or small_blocks(K, N, xp.dtype)
    if not block_k or K % block_k or N % BLOCK_W or stages < 2:
        raise ValueError(f"moe small GEMM: K={K}, N={N} (fused={fused}) do not fit block_k={block_k}, "
                         f"{BLOCK_W}-column tiles, stages={stages}")
    stages = min(stages, max(2, K // block_k))
    nops = 2 if fused else 1
    # a TMA copy moves a multiple of 128 bytes: each tile's R fp32 row weights padded to 32
    rw_len = max(R, 32)
    scratch = [
        plgpu.SMEM((stages, R, block_k), xp.dtype, transforms=_transforms(xp.dtype, block_k)),
        plgpu.SMEM((nops, stages, block_k, BLOCK_W), w.dtype, transforms=_transforms(w.dtype, BLOCK_W)),
        # transposed_out: the output tile's rows are R elements, 16 bytes at R = 8 bf16, below the
        # smallest swizzle (32 bytes): unswizzled then
        plgpu.SMEM((BLOCK_W, R), out_dtype, transforms=_transforms(out_dtype, R) if R * out_dtype.itemsize >= 32 else ())
        if transposed_out else plgpu.SMEM((R, BLOCK_W), out_dtype, transforms=_transforms(out_dtype, BLOCK_W)),
        *([plgpu.SMEM((rw_len,), jnp.float32)] if row_weights is not None else []),
        plgpu.Barrier(num_barriers=stages * (1 + nops) + (row_weights is not None)),
    ]
    kernel = plgpu.kernel(
        functools.partial(_kernel_small, block_rows=R, block_k=block_k, stages=stages, fused=fused,
                          scaled=row_weights is not None, transposed_out=transposed_out, table=table,
                          counted=table and tile_count, based=tile_base is not None,
                          tiles_per_expert=tiles_per_expert, base_scale=base_scale),
        kernel_name=name,
        out_type=jax.ShapeDtypeStruct((N, Mp) if transposed_out else (Mp, N), out_dtype),
        grid=(N // BLOCK_W, Mp // R),
        grid_names=("n", "m"),
        scratch_types=scratch,
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane),
        interpret=_interpret_params(interpret),
    )
    if row_weights is not None:
        row_weights = jnp.pad(row_weights.astype(jnp.float32).reshape(Mp // R, R), ((0, 0), (0, rw_len - R)))
    args = ((tiles,) if table else ()) + (() if tile_base is None else (jnp.asarray(tile_base, jnp.int32).reshape(1),))
    return kernel(*args, xp, w, *(() if row_weights is None else (row_weights,)))


# ------------------------------------------------------------------------------------------------
# The routed experts of a MoE layer
# ------------------------------------------------------------------------------------------------


def _silu_times(gate_up, dtype):
    """``silu(gate) * up`` of fp32 ``[..., 2I]`` products, rounded once to ``dtype``."""
    gate, up = jnp.split(gate_up, 2, axis=-1)
    return (gate / (1.0 + jnp.exp(-gate)) * up).astype(dtype)


def moe_experts_gather(xt, top_w, top_i, gate_up, down):
    """The routed experts by gathering each token's ``top_k`` experts (the decode path; plain XLA).

    ``xt [n, H]``, ``top_w [n, k]`` (any float dtype; used in fp32), ``top_i [n, k]``, ``gate_up
    [E, H, 2I]``, ``down [E, I, H]``. Returns fp32 ``[n, H]``: ``Σ_s top_w[t, s] *
    down_e(silu(gate_e(x_t)) * up_e(x_t))`` with the roundings of ``moe_experts`` (see the module
    docstring). Reads the ``n * k`` gathered expert matrices (repeats included), never the others.
    """
    f32 = jnp.float32
    gu = jnp.einsum("th,tkhn->tkn", xt, gate_up[top_i], preferred_element_type=f32)
    h = _silu_times(gu, xt.dtype)
    y = jnp.einsum("tki,tkih->tkh", h, down[top_i], preferred_element_type=f32)
    return (y * top_w.astype(f32)[..., None]).astype(xt.dtype).astype(f32).sum(axis=1)


PAIR_TILE_MAX_ROWS = 16  # the small path's pair tiles up to this many routed rows (2 tokens of top-8)


def pair_tiles(top_i: jax.Array, top_w: jax.Array, xt: jax.Array, block_rows: int):
    """The small path's layout for a few routed rows: one ``block_rows``-row tile per (token, slot)
    pair, its first row the token, the rest zero; the tile table is the routing's expert ids as
    they are (``tile_count=False``). Returns (tiles [M], xp [M R, H], row weights [M R] fp32).

    Reads: pair ``t * k + s`` reads its expert's weights once, repeats included, where the sorted
    layout reads each distinct expert once: the same at one token (a token's top-k are distinct);
    at two, each expert both use once more (~1 of 16 reads at uniform routing over 64 experts,
    twice the bytes at worst). What it saves is the sort: no group sizes, ranks, scatters or
    gathers (at batch 1 those were ten small XLA kernels of every MoE layer's decode step, more time
    than the layer's weights took to stream)."""
    n, k = top_i.shape
    M, R = n * k, block_rows
    tiles = top_i.reshape(-1).astype(jnp.int32)
    row = jnp.arange(M * R, dtype=jnp.int32)
    first = (row % R == 0)
    xp = jnp.where(first[:, None], xt[row // (R * k)], jnp.zeros((), xt.dtype))
    row_w = jnp.where(first, top_w.reshape(-1).astype(jnp.float32)[row // R], 0.0)
    return tiles, xp, row_w


@functools.partial(jax.jit, static_argnames=("num_experts", "gather_below", "small_max_rows", "block_rows",
                                             "small_transposed_out", "stages", "pair_max_rows", "interpret"))
def moe_experts(xt, top_w, top_i, gate_up, down, *, num_experts=None, stack_row=None, gather_below=None,
                small_max_rows=None, block_rows=None, small_transposed_out=False, stages=4,
                pair_max_rows=PAIR_TILE_MAX_ROWS, interpret=False):
    """The routed experts of ``layers.moe`` (everything but the router and the shared expert).

    ``xt [n, H]``; ``top_w [n, k]`` routing weights (used in fp32); ``top_i [n, k]`` expert ids;
    ``gate_up [E, H, 2I]``, ``down [E, I, H]`` in ``xt.dtype``. Returns fp32 ``[n, H]``.

    Sort the ``n * k`` (token, expert) pairs by expert (stable), place them in the padded layout
    (``padded_layout``), run the fused gate/up kernel and the down kernel (its epilogue scales each
    row by its routing weight), and sum each token's ``k`` rows in fp32 (a gather: every pair
    knows its padded row). With at most ``small_max_rows`` routed rows (``n * k``; 0 turns it
    off; None: ``SMALL_MAX_ROWS`` where ``SMALL_PATH_ON``, else 0) and a shape it tiles (``small_supports``), the kernels are the swap-AB small path
    (``grouped_gemm_small``, ``block_rows``-row tiles, default ``small_block_rows``), on pair
    tiles (``pair_tiles``, no sort) up to ``pair_max_rows`` routed rows; else the
    64-row grouped kernel (``grouped_gemm_padded``). With fewer than ``gather_below`` routed rows
    the gather path (``moe_experts_gather``) instead; by default only where the small path does
    not apply and ``n * k < E``. ``small_transposed_out``: the small kernels store their tiles
    transposed and XLA transposes the small results (``grouped_gemm_small``'s ``transposed_out``;
    a GPU-check / timing variant). ``stages``: SMEM ring depth of both kernels; ``interpret``:
    Mosaic GPU's interpreter (CPU tests).

    A stack of layers' experts: ``gate_up [G * E, H, 2I]``, ``down [G * E, I, H]`` with
    ``num_experts`` = E (static) and ``stack_row`` (traced int32: the layer's row ``g`` of the
    stack, its experts ``g E .. g E + E - 1``); ``top_i`` stays in ``[0, E)``. The kernels then read
    the layer's experts in place, where a slice of the stack passed as an operand would be a copy
    of the layer's experts every call (the decoder's scan over stacked layers,
    ``jaxserve.models.decoder``); the small kernels add the offset as they read their tile table.
    """
    n, H = xt.shape
    k = top_i.shape[1]
    E = num_experts or gate_up.shape[0]
    row = jnp.int32(0) if stack_row is None else jnp.asarray(stack_row, jnp.int32)
    M = n * k
    if small_max_rows is None:
        small_max_rows = SMALL_MAX_ROWS if SMALL_PATH_ON else 0
    small = M <= small_max_rows and small_supports(H, gate_up.shape[2] // 2, xt.dtype)
    if M < (gather_below if gather_below is not None else 0 if small else E):
        return moe_experts_gather(xt, top_w, top_i + row * E, gate_up, down)
    base = dict(tile_base=row, base_scale=E)
    if small and M <= pair_max_rows and not small_transposed_out:
        R = block_rows or SMALL_BLOCK_ROWS[0]
        tiles, xp, row_w = pair_tiles(top_i, top_w, xt, R)
        kw = dict(block_rows=R, stages=stages, tile_count=False, interpret=interpret, **base)
        h = grouped_gemm_small(xp, gate_up, tiles, fused=True, **kw)
        y = grouped_gemm_small(h, down, tiles, row_w, **kw)
        return y.reshape(n, k, R, H)[:, :, 0].astype(jnp.float32).sum(axis=1)
    R = (block_rows or small_block_rows(M, E)) if small else BLOCK_M
    lay, pos = pair_layout(top_i.reshape(-1).astype(jnp.int32), E, R)  # pos: the padded row of pair t*k+s
    src = jnp.full((lay.num_rows,), n, jnp.int32).at[pos].set(jnp.arange(M, dtype=jnp.int32) // k,
                                                              unique_indices=True)
    xp = jnp.concatenate([xt, jnp.zeros((1, H), xt.dtype)])[src]  # padding rows: the zero row
    row_w = jnp.zeros((lay.num_rows,), jnp.float32).at[pos].set(top_w.reshape(-1).astype(jnp.float32),
                                                                unique_indices=True)
    if small and small_transposed_out:  # [I, rows] and [H, rows]: XLA transposes h, the un-sort reads y's columns
        kw = dict(block_rows=R, transposed_out=True, stages=stages, interpret=interpret, **base)
        h_t = grouped_gemm_small(xp, gate_up, lay.tiles, fused=True, **kw)
        y_t = grouped_gemm_small(h_t.T, down, lay.tiles, row_w, **kw)
        return jnp.take(y_t, pos.reshape(n, k), axis=1).astype(jnp.float32).sum(axis=2).T
    if small:
        gemm = functools.partial(grouped_gemm_small, block_rows=R, **base)
        tiles = lay.tiles
    else:  # each tile's expert as a row of the stack; the used count stays last
        gemm = grouped_gemm_padded
        tiles = lay.tiles if stack_row is None else lay.tiles.at[:-1].add(row * E)
    h = gemm(xp, gate_up, tiles, fused=True, stages=stages, interpret=interpret)
    y = gemm(h, down, tiles, row_w, stages=stages, interpret=interpret)
    return y[pos.reshape(n, k)].astype(jnp.float32).sum(axis=1)
