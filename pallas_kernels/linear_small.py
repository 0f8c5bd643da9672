"""Dense projections of a few token rows (decode steps) through the swap-AB GEMM of ``moe.py``.

A decode step multiplies B <= 64 rows by every dense weight of the model once: the GDN in / out
projections, attention q / k / v / o, the shared expert, the LM head. That is a read of the
weights, ~2.3 GB a step for the real-size qwen3_5_moe (benchmarks/configs/qwen3_5_moe-6b.json),
and the step's time is how close the reads come to HBM bandwidth. XLA lowers ``x [1, K] @ w [K,
N]`` as a multiply and a column reduction (``input_reduce_fusion`` kernels) and small M as GEMMs
whose M tile is mostly padding; the profile of that step on the H100 showed them far from the
copy bandwidth (benchmarks/RESULTS.md "Serving").

``linear_small`` runs ``x @ w`` as the swap-AB grouped GEMM (``moe.grouped_gemm_small``): the
weight is the WGMMA M operand (64 output columns a program, streamed through a TMA ring), the
rows its N operand (8 / 16 / 32-row tiles), fp32 accumulation, one rounding. Two things are
done without touching the kernel, through its tile table (each row tile names the "expert" whose
weights it multiplies):

* split K: ``w [K, N]`` is, as a free reshape, ``[S, K / S, N]``, S "experts" of ``K / S`` rows;
  row tile ``s`` is x's columns ``[s K / S, (s+1) K / S)`` times expert ``s``. The kernel's grid
  is (N / 64 column tiles, row tiles): with N = 2048 (an output projection) one row tile would be
  32 programs on 132 SMs, too few to pull the weights at full bandwidth; S splits make ``32 S``.
* with splits the kernel stores each program's ``[64, R]`` fp32 accumulator as it is
  (``transposed_out``, ``out_dtype``): the S partial products are summed and transposed by one
  small XLA fusion and rounded once. Without (S = 1) it stores the result in row order and x's
  dtype (the MoE small path's store): no kernel after it. Each split costs that epilogue (a small
  kernel a projection); a deeper SMEM ring (``stages``) is the other way to keep a short grid's SMs
  pulling bytes, and the benchmark times both.
* a stack of layers ``w [L, K, N]`` and the layer's index (the decoder's scan): row tile ``s``
  multiplies row ``layer * S + s`` of the stack viewed as ``[L S, K / S, N]``, so the kernel reads
  the layer's weights in place, where a row of the stack passed as an operand would be copied out
  every step. The kernel computes the row from its tile index and ``layer`` (no tile table: one
  computed from the traced index was one more XLA kernel a projection, and a constant one XLA
  rewrites as an iota kernel).

Contract: ``x [M, K]`` with ``M <= MAX_ROWS``, ``w`` in x's dtype (bf16 / fp16 on the GPU; fp32 in
interpret mode only, as ``moe.py``), ``N`` a multiple of 64 and ``K`` one of 64 bf16 (``fits``).
Status: interpret-mode tested (tests/pallas_kernels/test_linear_small.py); checked on the H100
(``benchmarks/gpu_check.py --suites linear``) with a tile table, so in
``jaxserve.models.backends.AUTO_ON_GPU``. The table-free tiles ran in the engine's decode on the
H100 (benchmarks/RESULTS.md); their run of the suite is pending.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.moe import BLOCK_W, grouped_gemm_small, small_blocks

MAX_ROWS = 64  # above it XLA's GEMM tiles are full enough
MIN_PROGRAMS = 256  # split K until the grid has about two programs per SM (132 on the H100 / H200)
MAX_SPLITS = 8


def _step(dtype) -> int:
    return 128 // jnp.dtype(dtype).itemsize  # block_k: a 128-byte row, the swizzle of the 64-column weight tile


def fits(k: int, n: int, dtype) -> bool:
    """Whether ``linear_small`` tiles a ``[k, n]`` weight: ``n`` a multiple of 64 and ``k`` of a
    128-byte row (64 bf16; WGMMA wants the row tile's swizzle to be the weight tile's)."""
    return small_blocks(k, n, dtype) == _step(dtype)


def block_rows(m: int) -> int:
    """Rows per tile for ``m`` rows: 8, 16 or 32 (the WGMMA N); 32-row tiles above 32."""
    return next((r for r in (8, 16, 32) if m <= r), 32)


def splits(m: int, k: int, n: int, dtype) -> int:
    """The K splits of an ``[m, k] @ [k, n]`` product: the fewest (a power of two, at most
    ``MAX_SPLITS``) that give ``MIN_PROGRAMS`` programs while each split is whole 128-byte blocks,
    at least 4 of them; 1 when one split already does."""
    tiles = -(-m // block_rows(m))
    step = _step(dtype)
    s = 1
    while s < MAX_SPLITS and (n // BLOCK_W) * tiles * s < MIN_PROGRAMS and k % (2 * s * step) == 0 \
            and k // (2 * s) >= 4 * step:
        s *= 2
    return s


@functools.partial(jax.jit, static_argnames=("num_splits", "stages", "interpret"))
def linear_small(x: jax.Array, w: jax.Array, layer: jax.Array | None = None, *, num_splits: int | None = None,
                 stages: int = 4, interpret: bool = False) -> jax.Array:
    """``x @ w`` (``x [M, K]``, ``w [K, N]``), or ``x @ w[layer]`` for a stack ``w [L, K, N]`` and a
    traced int32 ``layer``. Returns ``[M, N]`` in x's dtype: fp32 products, one rounding.
    ``num_splits``: K splits (default ``splits``); ``stages``: the kernel's SMEM ring depth (a few
    programs per SM keep more bytes in flight with a deeper ring: the alternative to splitting K
    that ``benchmarks/kernels.py --only linear`` times, variant ``linear_deep``)."""
    M, K = x.shape
    N = w.shape[-1]
    if M > MAX_ROWS or w.shape[-2] != K or w.dtype != x.dtype or not fits(K, N, x.dtype):
        raise ValueError(f"linear_small: x {x.shape} {x.dtype}, w {w.shape} {w.dtype}")
    S = num_splits or splits(M, K, N, x.dtype)
    if K % (S * _step(x.dtype)):
        raise ValueError(f"linear_small: {S} splits of K={K}")
    R = block_rows(M)
    Mp = -(-M // R) * R
    stack = w.reshape(-1, K // S, N)  # [L * S, K / S, N]: free
    # row tile t is split t // per: "expert" t // per of the layer's S, row layer * S + t // per of
    # the stack, which the kernel computes (no tile table, no XLA op on the layer index)
    kw = dict(block_rows=R, stages=stages, name="linear_small", interpret=interpret,
              tiles_per_expert=Mp // R, tile_base=layer, base_scale=S)
    xp = x if Mp == M else jnp.pad(x, ((0, Mp - M), (0, 0)))
    if S == 1:  # the [Mp, N] result in row order and x's dtype, as the MoE small path stores it: no epilogue
        y = grouped_gemm_small(xp, stack, None, **kw)
        return y if Mp == M else y[:M]
    xs = xp.reshape(Mp, S, K // S).transpose(1, 0, 2).reshape(S * Mp, K // S)  # split s: rows [s Mp, (s+1) Mp)
    # fp32 [N, S * Mp]: each program's [64, R] accumulator stored as it is; the splits' sum and the
    # transpose are one small XLA fusion (N * S * Mp * 4 bytes: ~3% of the weight's at K = 2048, M = 8)
    y_t = grouped_gemm_small(xs, stack, None, transposed_out=True, out_dtype=jnp.float32, **kw)
    return y_t.reshape(N, S, Mp).sum(axis=1)[:, :M].T.astype(x.dtype)
