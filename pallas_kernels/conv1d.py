"""Depthwise causal conv1d (the short conv in front of GDN / KDA): Pallas Mosaic GPU kernels (sm_90).

Same contract and results as ``conv1d_reference`` (``causal_conv1d_prefill`` over a ragged batch,
``causal_conv1d_update`` for one decode token per row): state layout ``[..., C, K-1]`` (the last
K-1 inputs, oldest first), fp32 states and arithmetic, ``y`` in ``x.dtype``.

The conv is bandwidth-bound (K multiply-adds per element read), so each kernel reads x once and
writes y once; the math is plain register arithmetic on ``[block_c]`` channel vectors (one
warpgroup, the WG-strided layout: a thread owns a few neighbouring channels).

Prefill (``causal_conv1d_prefill_pallas``): a grid of (channel block, token block) programs over
the packed tokens, so every y tile is written exactly once whatever the raggedness. A program
copies (TMA) its ``[block_t, block_c]`` x tile plus the 8 rows before it (the halo) into SMEM and
walks the rows in order, carrying the K-1 previous inputs of the current sequence in registers:

    window = initial_state[n] if the row starts sequence n, else the carried window
    y      = act(bias + Σ_j weight[:, j] · (window ++ x_row)[j]);   window <- window[1:] ++ x_row

It starts K-1 rows early, in the halo, so the window is right at its first row: either a
sequence starts within those rows (the reset loads its initial state) or they are the row's own
sequence. y overwrites x in SMEM row by row (a row is in the registers' window once it has been
read) and leaves by one TMA store: ~37 KiB of SMEM per 64 x 256 bf16 tile. Per row the kernel reads one int32 code, prepared by XLA from ``cu_seqlens``: the
sequence the row starts (``>= 0``), ``-1`` inside a sequence, ``-2`` for padding (``y = 0``).
Final states and snapshots are windows of ``initial_state ++ x``, ``(N + S) x C x (K-1)``
numbers: XLA gathers them (``conv1d_reference.history``), as the reference does; they are not
worth a kernel and must stay fp32-exact.

Update (``causal_conv1d_update_pallas``): a grid of (row, channel block) programs; each loads its
state columns straight from GMEM (the ``[C, K-1]`` rows are 12 bytes per channel at K = 4, too
narrow for TMA), shifts in x, writes the new state and y. No SMEM.

Contract: ``C % 128 == 0`` (one warpgroup per channel block); any T (padded to ``block_t`` here).

On the GPU, ``benchmarks/gpu_check.py --suites conv1d`` checks it (ragged prefill to 64k tokens with
x64 snapshots, the update at large batches, bf16 and fp32; states bit-exact to the float64 oracle's
rounding); it is in ``jaxserve.models.backends.AUTO_ON_GPU``. Speed against fla and XLA:
``benchmarks/RESULTS.md`` ("conv1d"); the update (one program per row and channel block) is the
part to tune.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import token_segments
from pallas_kernels.conv1d_reference import check_args, history

HALO = 8  # rows of x copied before each token tile (>= K-1; 8 keeps the TMA rows aligned)
CODE_HALO = 32  # codes copied before each tile's (a TMA moves a multiple of 128 bytes: 32 int32)
START, INSIDE, PAD = 0, -1, -2  # row codes: >= START the sequence the row starts


def supports(channels: int, kernel_size: int) -> bool:
    """Whether the kernels take ``channels`` and ``kernel_size`` (else use the reference)."""
    return channels % 128 == 0 and 2 <= kernel_size <= HALO + 1


def default_block_c(channels: int) -> int:
    """256 channels (2 per thread, ~37 KiB of SMEM per 64-token bf16 tile) when they divide C, else
    128. Untuned: benchmarks/kernels.py --only conv1d times the default."""
    return 256 if channels % 256 == 0 else 128


def _silu(y):
    return y / (1.0 + jnp.exp(-y))


def _act(name):
    if name not in (None, "silu", "swish"):
        raise ValueError(f"activation {name!r} not in ['None', 'silu', 'swish']")
    return _silu if name else (lambda y: y)


def _layout(block_c: int, vec: int = 2):
    """The WG-strided layout of the [block_c] vectors of a kernel, whatever their dtype: ``vec``
    neighbouring channels per thread (2 in prefill: one 64-bit fp32 / 32-bit bf16 access; 1 in
    the update, whose state columns have a stride of K-1)."""
    return plgpu.Layout.WG_STRIDED((block_c,), vec_size=min(vec, block_c // 128))


def _load(ref, block_c, vec=2):
    return plgpu.load(ref, layout=_layout(block_c, vec)).astype(jnp.float32)


def _dot(window, weight_rows, bias):
    """``bias + Σ_j weight_rows[j] * window[j]`` over a tuple of K [block_c] fp32 vectors (no
    bias: None)."""
    acc = bias
    for w, v in zip(weight_rows, window):
        acc = w * v if acc is None else acc + w * v
    return acc


def _prefill_kernel(code_ref, x_ref, w_ref, b_ref, init_ref, y_ref, x_smem, code_smem, w_smem, b_smem, bars,
                    *, block_t, block_c, activation):
    c = lax.axis_index("c")
    t = lax.axis_index("t")
    K = w_ref.shape[0]
    cols = pl.ds(c * block_c, block_c)
    t0 = t * block_t
    x_bar, halo_bar, code_bar, w_bar, b_bar = (bars.at[i] for i in range(5))
    plgpu.copy_gmem_to_smem(x_ref.at[pl.ds(t0, block_t), cols], x_smem.at[pl.ds(HALO, block_t)], x_bar)

    @pl.when(t > 0)
    def _():
        plgpu.copy_gmem_to_smem(x_ref.at[pl.ds(t0 - HALO, HALO), cols], x_smem.at[pl.ds(0, HALO)], halo_bar)

    plgpu.copy_gmem_to_smem(code_ref.at[pl.ds(t0, CODE_HALO + block_t)], code_smem, code_bar)
    plgpu.copy_gmem_to_smem(w_ref.at[:, cols], w_smem, w_bar)
    plgpu.copy_gmem_to_smem(b_ref.at[cols], b_smem, b_bar)
    plgpu.barrier_wait(w_bar)
    plgpu.barrier_wait(b_bar)
    weights = tuple(_load(w_smem.at[j], block_c) for j in range(K))
    bias = _load(b_smem, block_c)
    plgpu.barrier_wait(code_bar)
    plgpu.barrier_wait(x_bar)

    @pl.when(t > 0)
    def _():
        plgpu.barrier_wait(halo_bar)

    act = _act(activation)

    def row(r, window):
        code = code_smem[r + (CODE_HALO - HALO)]
        window = lax.cond(code >= START,
                          lambda: tuple(_load(init_ref.at[jnp.maximum(code, 0), m, cols], block_c)
                                        for m in range(K - 1)),
                          lambda: window)
        xr = _load(x_smem.at[r], block_c)
        y = act(_dot((*window, xr), weights, bias))
        x_smem[r] = jnp.where(code == PAD, 0.0, y).astype(x_smem.dtype)  # in place: row r is in the window now
        return (*window[1:], xr)

    zero = plgpu.layout_cast(jnp.zeros((block_c,), jnp.float32), _layout(block_c))
    lax.fori_loop(HALO - (K - 1), HALO + block_t, row, (zero,) * (K - 1))
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(x_smem.at[pl.ds(HALO, block_t)], y_ref.at[pl.ds(t0, block_t), cols])
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def row_codes(cu_seqlens, num_tokens: int):
    """Per token: the sequence it starts (``>= 0``), ``INSIDE`` or ``PAD`` (index ``>= cu[-1]``)."""
    seq, local = token_segments(cu_seqlens, num_tokens)
    num_seqs = cu_seqlens.shape[0] - 1
    return jnp.where(seq >= num_seqs, PAD, jnp.where(local == 0, seq, INSIDE)).astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("activation", "block_t", "block_c", "interpret"))
def _prefill_y(x, weight, bias, cu_seqlens, init, *, activation, block_t, block_c, interpret):
    T, C = x.shape
    K = weight.shape[-1]
    Tp = -(-T // block_t) * block_t
    codes = jnp.concatenate([jnp.full((CODE_HALO,), INSIDE, jnp.int32), row_codes(cu_seqlens, T),
                             jnp.full((Tp - T,), PAD, jnp.int32)])
    xp = x if Tp == T else jnp.pad(x, ((0, Tp - T), (0, 0)))
    f32 = jnp.float32
    kernel = plgpu.kernel(
        functools.partial(_prefill_kernel, block_t=block_t, block_c=block_c, activation=activation),
        kernel_name="conv1d_prefill",
        out_type=jax.ShapeDtypeStruct((Tp, C), x.dtype),
        grid=(C // block_c, Tp // block_t),
        grid_names=("c", "t"),
        scratch_types=[
            plgpu.SMEM((HALO + block_t, block_c), x.dtype),  # x in, y out (row by row, in place)
            plgpu.SMEM((CODE_HALO + block_t,), jnp.int32),
            plgpu.SMEM((K, block_c), f32),
            plgpu.SMEM((block_c,), f32),
            plgpu.Barrier(num_barriers=5),
        ],
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane),
        interpret=plgpu.InterpretGPUParams() if interpret else False,
    )
    y = kernel(codes, xp, weight.astype(f32).T, bias.astype(f32), jnp.swapaxes(init, 1, 2))
    return y[:T]


def causal_conv1d_prefill_pallas(x, weight, bias=None, *, cu_seqlens, initial_state=None, activation="silu",
                                 snapshot_seq=None, snapshot_len=None, block_t=64, block_c=None, interpret=False):
    """``conv1d_reference.causal_conv1d_prefill`` with y computed by the Mosaic GPU kernel.

    Same arguments and results; ``block_t`` (a multiple of 32) tokens by ``block_c`` (a multiple
    of 128 dividing C; default ``default_block_c``) channels per program; ``interpret`` runs
    Mosaic GPU's interpreter (CPU tests).
    """
    T, C = x.shape
    K = weight.shape[-1]
    num_seqs = cu_seqlens.shape[0] - 1
    check_args(x, weight, cu_seqlens, initial_state)
    block_c = block_c or default_block_c(C)
    if not supports(C, K) or C % block_c or block_c % 128 or block_t % 32:
        raise ValueError(f"conv1d kernel: C={C} (block_c={block_c}), K={K}, block_t={block_t} not supported")
    f32 = jnp.float32
    init = jnp.zeros((num_seqs, C, K - 1), f32) if initial_state is None else initial_state.astype(f32)
    bias = jnp.zeros((C,), f32) if bias is None else bias
    cu = jnp.asarray(cu_seqlens, jnp.int32)
    y = _prefill_y(x, weight, bias, cu, init, activation=activation, block_t=block_t, block_c=block_c,
                   interpret=interpret)
    xf = x.astype(f32)
    final = history(xf, init, cu, jnp.arange(num_seqs), jnp.diff(cu))
    if snapshot_seq is None:
        return y, final, None
    snaps = history(xf, init, cu, jnp.asarray(snapshot_seq, jnp.int32), jnp.asarray(snapshot_len, jnp.int32))
    return y, final, snaps


def _update_kernel(x_ref, state_ref, w_ref, *refs, block_c, activation, has_bias):
    """128 channels at a time, one per thread: the state columns and the weight's rows are strided
    (K-1) / K vectors, which Mosaic GPU loads one element per thread. The state and the weight are
    read in their own dtypes (the pool's and the checkpoint's) and computed in fp32, so no XLA
    kernel converts or transposes them first (a decode step ran those per GDN layer)."""
    b_ref, y_ref, new_ref = refs if has_bias else (None, *refs)
    b = lax.axis_index("b")
    K = w_ref.shape[1]
    load = functools.partial(_load, block_c=128, vec=1)
    for part in range(block_c // 128):
        cols = pl.ds(lax.axis_index("c") * block_c + part * 128, 128)
        window = (*(load(state_ref.at[b, cols, m]) for m in range(K - 1)), load(x_ref.at[b, cols]))
        weights = tuple(load(w_ref.at[cols, j]) for j in range(K))
        y = _dot(window, weights, load(b_ref.at[cols]) if has_bias else None)
        y_ref[b, cols] = _act(activation)(y).astype(y_ref.dtype)
        for m in range(K - 1):
            new_ref[b, cols, m] = window[m + 1]


@functools.partial(jax.jit, static_argnames=("activation", "block_c", "interpret"))
def causal_conv1d_update_pallas(x, state, weight, bias=None, activation="silu", *, block_c=None, interpret=False):
    """``conv1d_reference.causal_conv1d_update`` by the Mosaic GPU kernel: x ``[B, C]``, state
    ``[B, C, K-1]`` (any float dtype), weight ``[C, K]`` -> (y ``[B, C]`` in x.dtype, new state fp32).
    ``block_c`` channels per program (a multiple of 128 dividing C; default the largest of 512,
    256, 128 that does)."""
    B, C = x.shape
    K = weight.shape[-1]
    block_c = block_c or next(bc for bc in (512, 256, 128) if C % bc == 0 or bc == 128)
    if state.shape != (B, C, K - 1) or weight.shape != (C, K):
        raise ValueError(f"state {state.shape} / weight {weight.shape} must be [{B}, {C}, K-1] / [{C}, K]")
    if not supports(C, K) or C % block_c or block_c % 128:
        raise ValueError(f"conv1d kernel: C={C} (block_c={block_c}), K={K} not supported")
    f32 = jnp.float32
    kernel = plgpu.kernel(
        functools.partial(_update_kernel, block_c=block_c, activation=activation, has_bias=bias is not None),
        kernel_name="conv1d_update",
        out_type=(jax.ShapeDtypeStruct((B, C), x.dtype), jax.ShapeDtypeStruct((B, C, K - 1), f32)),
        grid=(B, C // block_c),
        grid_names=("b", "c"),
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane),
        interpret=plgpu.InterpretGPUParams() if interpret else False,
    )
    return kernel(x, state, weight, *(() if bias is None else (bias,)))


def main():
    """Small self-check: ``python -m pallas_kernels.conv1d [--interpret]`` (ragged prefill, update)."""
    import sys

    import numpy as np

    from pallas_kernels.conv1d_reference import causal_conv1d_prefill, causal_conv1d_update

    interpret = "--interpret" in sys.argv
    C, K, lens = (256, 4, [1, 0, 70, 2]) if interpret else (8192, 4, [3000, 1, 0, 5000])
    rng = np.random.default_rng(0)
    cu = jnp.asarray(np.concatenate([[0], np.cumsum(lens)]), jnp.int32)
    x = jnp.asarray(rng.normal(size=(int(cu[-1]) + 5, C)), jnp.bfloat16)
    w, b = jnp.asarray(rng.normal(size=(C, K)), jnp.float32), jnp.asarray(rng.normal(size=(C,)), jnp.float32)
    init = jnp.asarray(rng.normal(size=(len(lens), C, K - 1)), jnp.float32)
    got = causal_conv1d_prefill_pallas(x, w, b, cu_seqlens=cu, initial_state=init, interpret=interpret)
    want = causal_conv1d_prefill(x, w, b, cu_seqlens=cu, initial_state=init)
    err = float(jnp.max(jnp.abs(got[0].astype(jnp.float32) - want[0].astype(jnp.float32))))
    y, new = causal_conv1d_update_pallas(x[:4], init[jnp.array([0, 0, 2, 3])], w, b, interpret=interpret)
    y_r, new_r = causal_conv1d_update(x[:4], init[jnp.array([0, 0, 2, 3])], w, b)
    err_u = float(jnp.max(jnp.abs(y.astype(jnp.float32) - y_r.astype(jnp.float32))))
    print(f"conv1d C={C} K={K} lens={lens}: prefill max |dy| {err:.2e}, update max |dy| {err_u:.2e}")
    np.testing.assert_array_equal(got[1], want[1])
    np.testing.assert_array_equal(new, new_r)
    assert err < 0.1 and err_u < 0.1  # bf16 outputs of magnitude ~10


if __name__ == "__main__":
    main()
