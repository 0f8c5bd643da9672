"""Decode-step dense projections through the swap-AB kernel (``pallas_kernels/linear_small.py``,
Mosaic GPU interpret mode on the CPU) against a float64 NumPy product: row counts across the 8 /
16 / 32-row tiles and several tiles, K split 1 to 4 ways, a stack of layers read at a traced
index; and the lowering for sm_90 at the target model's shapes (one Mosaic GPU kernel per
projection, fp32 partials in bf16 runs).

Shapes are small and few (K 128 / 256, N 64 / 128) so each configuration compiles once."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pallas_kernels import linear_small as ls

TOL = 2e-6  # fp32 products accumulated in fp32: summation order only (relative to max |y|)


def oracle(x, w):
    return np.asarray(x, np.float64) @ np.asarray(w, np.float64)


def close(got, want, what):
    err = np.abs(np.asarray(got, np.float64) - want).max() / max(np.abs(want).max(), 1e-30)
    assert err < TOL, f"{what}: relative error {err:.2e}"


@settings(max_examples=6, deadline=None, database=None)
@given(m=st.sampled_from([1, 5, 8, 13, 32, 40]), splits=st.sampled_from([1, 2, 4]), stages=st.sampled_from([2, 4, 12]),
       seed=st.integers(0, 99))
def test_matches_float64(m, splits, stages, seed):
    """Any row count up to MAX_ROWS (one or several row tiles, padding rows), K split 1 / 2 / 4
    ways (one split: stored in row order; several: fp32 partials) and any ring depth (12: more
    buffers than K steps) give x @ w: the padding rows never reach the result, the splits sum to
    the whole K."""
    rng = np.random.default_rng(seed)
    K, N = 256, 128
    x = rng.standard_normal((m, K)).astype(np.float32)
    w = rng.standard_normal((K, N)).astype(np.float32)
    y = ls.linear_small(jnp.asarray(x), jnp.asarray(w), num_splits=splits, stages=stages, interpret=True)
    assert y.shape == (m, N) and y.dtype == jnp.float32
    close(y, oracle(x, w), f"m={m} splits={splits}")


def test_stacked_layer_read_in_place():
    """``w [L, K, N]`` with a traced layer index gives ``x @ w[layer]`` for every layer, split or not
    (the decoder's scan passes the whole stack, so no layer's weights are copied out)."""
    rng = np.random.default_rng(3)
    L, K, N = 3, 256, 64
    x = rng.standard_normal((5, K)).astype(np.float32)
    ws = rng.standard_normal((L, K, N)).astype(np.float32)
    run = jax.jit(lambda x, w, l, s: ls.linear_small(x, w, l, num_splits=s, interpret=True), static_argnums=3)
    for s in (1, 2):
        for layer in range(L):
            close(run(jnp.asarray(x), jnp.asarray(ws), jnp.int32(layer), s), oracle(x, ws[layer]),
                  f"layer {layer} splits {s}")


def test_splits_rule():
    """Splits grow (powers of two, at most MAX_SPLITS) only while the grid is short of MIN_PROGRAMS
    and each split still spans several K blocks; they never change a wide projection."""
    bf = jnp.bfloat16
    assert ls.splits(1, 2048, 151936, bf) == 1  # the LM head: 2374 column tiles
    assert ls.splits(1, 2048, 8192, bf) == 2    # 128 column tiles
    assert ls.splits(1, 4096, 2048, bf) == 8    # an output projection: 32 column tiles
    assert ls.splits(64, 4096, 2048, bf) == 4   # two row tiles of 32
    assert ls.splits(1, 128, 64, bf) == 1       # K = 2 blocks: nothing to split
    for m, k, n in ((1, 512, 2048), (8, 2048, 512), (32, 2048, 4096)):
        s = ls.splits(m, k, n, bf)
        assert k % (s * 64) == 0 and k // s >= 4 * 64


def test_rejects_what_it_cannot_tile():
    x = jnp.zeros((ls.MAX_ROWS + 1, 128), jnp.float32)
    with pytest.raises(ValueError, match="linear_small"):
        ls.linear_small(x, jnp.zeros((128, 64), jnp.float32), interpret=True)
    with pytest.raises(ValueError, match="linear_small"):
        ls.linear_small(jnp.zeros((1, 128), jnp.float32), jnp.zeros((128, 96), jnp.float32), interpret=True)
    assert not ls.fits(2048, 32, jnp.bfloat16) and ls.fits(2048, 8192, jnp.bfloat16)
    assert not ls.fits(32, 64, jnp.bfloat16)  # K = 64 bytes: the row tile's swizzle would not be the weight's


@pytest.mark.parametrize("m, K, N", [(1, 2048, 8192), (32, 4096, 2048), (64, 512, 2048), (8, 2048, 151936)])
def test_lowers_for_sm90_at_target_shapes(m, K, N):
    """bf16 at the target model's projections (GDN in_proj qkv, out_proj, the shared expert's down,
    the LM head) lowers for CUDA to one Mosaic GPU kernel, list and stacked weights alike."""
    f = jax.ShapeDtypeStruct
    bf = jnp.bfloat16
    plain = jax.jit(ls.linear_small).trace(f((m, K), bf), f((K, N), bf)).lower(lowering_platforms=("cuda",))
    stacked = jax.jit(ls.linear_small).trace(f((m, K), bf), f((6, K, N), bf), f((), jnp.int32)).lower(
        lowering_platforms=("cuda",))
    for lowered in (plain, stacked):
        assert lowered.as_text().count("custom_call @mosaic_gpu") == 1
