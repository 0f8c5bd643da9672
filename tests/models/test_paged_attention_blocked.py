"""``layers.paged_attention`` with ``blocked_rows`` (the engine's mixed steps: rows of several tokens
in query blocks that gather each key block once) against the per-token form and a float64 softmax,
on random ragged batches over a page pool whose null page holds NaN."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jaxserve.models.layers import Ragged, paged_attention
from pallas_kernels.paged_attention import attention_np, random_paged_batch

P = 3  # rows of more than one token at most (the scheduler's promise)


@st.composite
def batches(draw):
    multi = draw(st.lists(st.integers(2, 150), min_size=0, max_size=P))
    ones = draw(st.integers(0 if multi else 1, 4))
    new = draw(st.permutations(multi + [1] * ones))
    ctx = draw(st.lists(st.one_of(st.sampled_from([0, 63, 64, 127]), st.integers(0, 200)),
                        min_size=len(new), max_size=len(new)))
    return (ctx, list(new), draw(st.integers(0, 20)), draw(st.sampled_from([None, 50])),
            draw(st.integers(0, 2**31 - 1)))


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=batches())
def test_blocked_rows_equal_the_per_token_form(case):
    ctx, new, pad, window, seed = case
    x, ragged = random_paged_batch(np.random.default_rng(seed), ctx, new, nh=4, nkv=2, hd=16, page_size=16,
                                   layers=2, pad_tokens=pad)
    for pool in ("k_pool", "v_pool"):
        x[pool][:, 0] = np.nan  # the null page: garbage no real row may see
    z = jnp.zeros(1, jnp.int32)
    r = Ragged(**{n: jnp.asarray(a) for n, a in ragged.items()}, read_slot=z, write_slot=z, snap_seq=z, snap_len=z,
               snap_dst=z)
    args = [jnp.asarray(x[n]) for n in ("q", "k", "v", "k_pool", "v_pool")]
    o_tok, kp_tok, vp_tok = paged_attention(*args, 1, r, window)
    o_blk, kp_blk, vp_blk = paged_attention(*args, 1, r, window, blocked_rows=P)
    real = int(ragged["cu_seqlens"][-1])
    o_tok, o_blk = np.asarray(o_tok)[:real], np.asarray(o_blk)[:real]
    assert np.isfinite(o_blk).all()
    np.testing.assert_allclose(o_blk, o_tok, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(kp_blk), np.asarray(kp_tok))  # the write is the same scatter
    np.testing.assert_array_equal(np.asarray(vp_blk), np.asarray(vp_tok))
    pools = {"k_pool": np.asarray(kp_blk), "v_pool": np.asarray(vp_blk)}
    ref = attention_np(x["q"], pools["k_pool"], pools["v_pool"], 1, ragged, window=window)[:real]
    np.testing.assert_allclose(o_blk, ref, rtol=1e-4, atol=1e-4)
