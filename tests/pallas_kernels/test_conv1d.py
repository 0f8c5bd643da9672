"""conv1d (Mosaic GPU causal conv, GPU interpret mode on CPU) against conv1d_reference.

Random ragged batches (empty sequences, sequences shorter than the K-1 window, starts on and just
past the 32-token tile edges, bucket padding holding garbage), initial states gathered from random
slots of a pool, snapshot requests at 0, at every sequence's end and in between. Shapes are the
smallest the tiling takes (C = 256: two 128-channel blocks; 32-token tiles), fixed across
examples so each configuration compiles once.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pallas_kernels import conv1d
from pallas_kernels.conv1d_reference import causal_conv1d_prefill, causal_conv1d_update
from tests.pallas_kernels.test_gdn_reference import assert_close, cu_from

T, N, S, C, K, SLOTS = 96, 6, 8, 256, 4, 10
BLOCKS = dict(block_t=32, block_c=128)
TOL = {jnp.float32: 1e-5, jnp.bfloat16: 8e-3}  # bf16: one rounding of y (the reference rounds too)
SETTINGS = settings(max_examples=8, deadline=None, database=None)


def inputs(rng, lens, dtype, *, bias=True, num_tokens=T):
    pool = rng.normal(size=(SLOTS, C, K - 1)).astype(np.float32)
    return dict(
        x=jnp.asarray(rng.normal(size=(num_tokens, C)), dtype),
        weight=jnp.asarray(rng.normal(size=(C, K)) * 0.5, jnp.float32),
        bias=jnp.asarray(rng.normal(size=(C,)), jnp.float32) if bias else None,
        cu_seqlens=jnp.asarray(cu_from(lens)),
        initial_state=jnp.asarray(pool[rng.integers(0, SLOTS, size=len(lens))]),
    )


def snapshot_requests(rng, lens):
    """0 and the whole length of a few sequences, the rest random positions; S of them."""
    seq = rng.integers(0, len(lens), size=S)
    length = np.array([[0, lens[n], rng.integers(0, lens[n] + 1)][i % 3] for i, n in enumerate(seq)])
    return jnp.asarray(seq, jnp.int32), jnp.asarray(length, jnp.int32)


def check_prefill(args, snaps, dtype, **kw):
    got = conv1d.causal_conv1d_prefill_pallas(**args, snapshot_seq=snaps[0], snapshot_len=snaps[1], **BLOCKS,
                                              interpret=True, **kw)
    want = causal_conv1d_prefill(**args, snapshot_seq=snaps[0], snapshot_len=snaps[1], **kw)
    assert got[0].dtype == args["x"].dtype and got[1].dtype == got[2].dtype == jnp.float32
    assert_close(np.asarray(got[0], np.float32), np.asarray(want[0], np.float32), TOL[dtype], "y")
    np.testing.assert_array_equal(got[1], want[1])  # states are windows of the inputs: exact
    np.testing.assert_array_equal(got[2], want[2])
    n_real = int(args["cu_seqlens"][-1])
    np.testing.assert_array_equal(np.asarray(got[0], np.float32)[n_real:], 0.0)  # bucket padding


@st.composite
def ragged(draw):
    lens = draw(st.lists(st.one_of(st.sampled_from([0, 1, 2, 3]), st.integers(0, T // N + 8)),
                         min_size=N, max_size=N))
    while sum(lens) > T:
        lens[int(np.argmax(lens))] //= 2
    return lens, draw(st.integers(0, 2**31 - 1)), draw(st.sampled_from([jnp.float32, jnp.bfloat16]))


@SETTINGS
@given(ragged())
def test_prefill_matches_reference(case):
    lens, seed, dtype = case
    rng = np.random.default_rng(seed)
    check_prefill(inputs(rng, lens, dtype), snapshot_requests(rng, lens), dtype)


def test_prefill_tile_edges_and_short_sequences():
    """Starts exactly on tile edges (32, 64), one- and two-token sequences whose windows reach
    into the initial state and across a tile edge, an empty one, padding after."""
    lens = [1, 2, 29, 1, 0, 31, 3]
    rng = np.random.default_rng(0)
    check_prefill(inputs(rng, lens, jnp.float32), snapshot_requests(rng, lens), jnp.float32)


def test_prefill_plain_no_bias_zero_state_untiled_length():
    """activation None, no bias, no initial state, T not a multiple of the tile, one block of channels."""
    lens = [5, 40]
    rng = np.random.default_rng(1)
    args = inputs(rng, lens, jnp.float32, bias=False, num_tokens=50)
    args["initial_state"] = None
    got = conv1d.causal_conv1d_prefill_pallas(**args, activation=None, block_t=32, interpret=True)
    want = causal_conv1d_prefill(**args, activation=None)
    assert got[2] is None
    assert_close(got[0], want[0], TOL[jnp.float32], "y")
    np.testing.assert_array_equal(got[1], want[1])


@pytest.mark.parametrize("batch,block_c,dtype,stored,bias", [(1, 128, jnp.float32, jnp.float32, True),
                                                            (3, 256, jnp.bfloat16, jnp.float32, True),
                                                            (8, None, jnp.float32, jnp.float32, True),
                                                            (2, None, jnp.bfloat16, jnp.bfloat16, False)])
def test_update_matches_reference(batch, block_c, dtype, stored, bias):
    """The update against the reference; ``stored``: the dtype of the state and the weight as the
    pool and the checkpoint hold them (the kernel reads them as they are); the model's convs have
    no bias."""
    rng = np.random.default_rng(batch)
    x = jnp.asarray(rng.normal(size=(batch, C)), dtype)
    state = jnp.asarray(rng.normal(size=(batch, C, K - 1)), stored)
    weight = jnp.asarray(rng.normal(size=(C, K)), stored)
    b = jnp.asarray(rng.normal(size=(C,)), jnp.float32) if bias else None
    y, new = conv1d.causal_conv1d_update_pallas(x, state, weight, b, block_c=block_c, interpret=True)
    f32 = jnp.float32
    y_r, new_r = causal_conv1d_update(x, state.astype(f32), weight.astype(f32), b)
    assert y.dtype == dtype and new.dtype == jnp.float32
    assert_close(np.asarray(y, np.float32), np.asarray(y_r, np.float32), TOL[dtype], "y")
    np.testing.assert_array_equal(new, new_r)


def test_unsupported_channels_are_refused():
    assert not conv1d.supports(96, 4) and conv1d.supports(8192, 4)
    rng = np.random.default_rng(2)
    with pytest.raises(ValueError, match="not supported"):
        conv1d.causal_conv1d_update_pallas(jnp.zeros((2, 96)), jnp.zeros((2, 96, 3)), jnp.zeros((96, 4)))
    args = inputs(rng, [3], jnp.float32)
    with pytest.raises(ValueError, match="not supported"):
        conv1d.causal_conv1d_prefill_pallas(**args, block_c=96)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_kernels_lower_for_the_gpu(dtype):
    """Mosaic GPU lowering (layouts, TMA sizes, strided state columns) runs without a GPU, and the
    interpreter does not take it: at the model's conv dim, each entry point must lower for CUDA to
    exactly one Mosaic GPU kernel (not a fallback; compiling to PTX needs the device). Their values
    are checked against the reference in interpret mode above."""
    import jax

    Cm, T, B = 8192, 256, 4
    f = jax.ShapeDtypeStruct
    x, w, b = f((T, Cm), dtype), f((Cm, K), jnp.float32), f((Cm,), jnp.float32)
    cu, init, snaps = f((5,), jnp.int32), f((4, Cm, K - 1), jnp.float32), f((S,), jnp.int32)
    prefill = jax.jit(lambda x, w, b, cu, init, s, n: conv1d.causal_conv1d_prefill_pallas(
        x, w, b, cu_seqlens=cu, initial_state=init, snapshot_seq=s, snapshot_len=n))
    text = prefill.trace(x, w, b, cu, init, snaps, snaps).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("custom_call @mosaic_gpu") == 1
    update = jax.jit(conv1d.causal_conv1d_update_pallas)
    text = update.trace(f((B, Cm), dtype), f((B, Cm, K - 1), jnp.float32), w, b).lower(
        lowering_platforms=("cuda",)).as_text()
    assert text.count("custom_call @mosaic_gpu") == 1
    # as the model calls it: the pool's state and the checkpoint's weight in the model dtype, no bias
    text = update.trace(f((B, Cm), dtype), f((B, Cm, K - 1), dtype), f((Cm, K), dtype)).lower(
        lowering_platforms=("cuda",)).as_text()
    assert text.count("custom_call @mosaic_gpu") == 1
