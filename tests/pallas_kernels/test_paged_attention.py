"""paged_attention (Mosaic GPU kernel, GPU interpret mode on CPU) against two references.

Each case builds a ragged batch over a page pool (rows at random, distinct pages; the page table
padded with the null page), runs the kernel and checks

* the output against a float64 NumPy dense softmax over each token's visible keys (gathered from
  the pools through the page table), and against ``jaxserve.models.layers.paged_attention``;
* the written pools: bit-identical to the reference's (the same scatter).

Lengths are random (1..~300) plus the edges: a row ending exactly on a page boundary, one ending on
a 64 (key block) boundary, a one-token row. Shapes are tiny (1-2 kv heads) so each case interprets
in seconds; the whole file runs in well under a minute on 2 CPU cores.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.models.layers import Ragged
from jaxserve.models.layers import paged_attention as reference
from pallas_kernels.paged_attention import (
    _tiles,
    attention_np,
    combine_splits,
    default_num_splits,
    paged_attention,
    random_paged_batch,
)

TOL = {jnp.float32: 1e-5, jnp.bfloat16: 1e-2}


def make_batch(rng, ctx, new, *, nh, nkv, hd, ps, dtype=jnp.float32, layers=2, layer=1, pad_tokens=0):
    """The reference's arguments for a random paged batch (``random_paged_batch``)."""
    x, ragged = random_paged_batch(rng, ctx, new, nh=nh, nkv=nkv, hd=hd, page_size=ps, layers=layers,
                                   pad_tokens=pad_tokens)
    z = jnp.zeros(1, jnp.int32)
    r = Ragged(**{n: jnp.asarray(a) for n, a in ragged.items()}, read_slot=z, write_slot=z, snap_seq=z,
               snap_len=z, snap_dst=z)
    x = {n: jnp.asarray(a, dtype) for n, a in x.items()}
    return (x["q"], x["k"], x["v"], x["k_pool"], x["v_pool"], layer, r)


def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30)


def check(args, *, window=None, dtype=jnp.float32, **kw):
    o_ref, kp_ref, vp_ref = reference(*args, window)
    o, kp, vp = paged_attention(*args, window, interpret=True, **kw)
    assert o.shape == o_ref.shape and o.dtype == args[0].dtype
    np.testing.assert_array_equal(np.asarray(kp), np.asarray(kp_ref))  # the write: same scatter
    np.testing.assert_array_equal(np.asarray(vp), np.asarray(vp_ref))
    o = np.asarray(o.astype(jnp.float32))
    real = np.asarray(args[-1].seq) < args[-1].num_rows
    assert np.isfinite(o).all()
    o64 = attention_np(args[0].astype(jnp.float32), kp_ref.astype(jnp.float32), vp_ref.astype(jnp.float32), args[5],
                       args[6]._asdict(), window=window)
    assert rel(o[real], o64[real]) < TOL[dtype]
    assert rel(o[real], np.asarray(o_ref.astype(jnp.float32))[real]) < TOL[dtype]
    assert (o[~real] == 0).all()


def random_lengths(rng, n, ps, lo=1, hi=300):
    """``n`` random lengths plus the edges: a page boundary (not a 64 one), a 64 boundary, 1."""
    edges = [3 * ps, 128, 1]
    return edges + [int(x) for x in rng.integers(lo, hi, n)]


@pytest.mark.parametrize("nh,nkv,hd,ps,splits,seed", [
    (4, 1, 128, 16, 2, 0),   # GQA 4, split-K (ranges end mid-context and at its end)
    (1, 1, 256, 64, None, 1),  # GQA 1 (MHA), d 256, one page per key block
], ids=["gqa4-d128-p16-split2", "gqa1-d256-p64"])
def test_decode_matches_references(nh, nkv, hd, ps, splits, seed):
    """One new token per row: the row's total length (context + 1) from random_lengths."""
    rng = np.random.default_rng(seed)
    total = random_lengths(rng, 2, ps)
    args = make_batch(rng, [t - 1 for t in total], [1] * len(total), nh=nh, nkv=nkv, hd=hd, ps=ps)
    check(args, num_splits=splits)


@pytest.mark.parametrize("nh,nkv,hd,ps,splits,seed", [
    (4, 1, 128, 16, 3, 2),
    (1, 1, 256, 64, None, 3),
], ids=["gqa4-d128-p16-split3", "gqa1-d256-p64"])
def test_extend_matches_references(nh, nkv, hd, ps, splits, seed):
    """Rows with many new tokens over cached pages: a prefill from 0, a chunk continuing at a 64
    boundary, a chunk ending on a page boundary, a decode row; bucket padding tokens at the end.
    Several query tiles per row (GQA 4: 16 tokens a tile; GQA 1: 64)."""
    rng = np.random.default_rng(seed)
    ctx = [0, 64, 3 * ps, int(rng.integers(50, 250))]
    new = [int(rng.integers(20, 80)), int(rng.integers(1, 40)), 2 * ps, 1]
    args = make_batch(rng, ctx, new, nh=nh, nkv=nkv, hd=hd, ps=ps, pad_tokens=3)
    check(args, num_splits=splits)


def test_sliding_window_extend():
    """A sliding layer (window 40): early key blocks are skipped, the window edge is masked."""
    rng = np.random.default_rng(4)
    args = make_batch(rng, [100, 10], [20, 3], nh=4, nkv=1, hd=128, ps=16)
    check(args, window=40, num_splits=2)


def test_bf16_decode():
    """Model dtype: bf16 q and pools, output in bf16, softmax and accumulation in fp32."""
    rng = np.random.default_rng(5)
    args = make_batch(rng, [127, 200, 15], [1, 1, 1], nh=8, nkv=2, hd=128, ps=16, dtype=jnp.bfloat16)
    check(args, dtype=jnp.bfloat16)


def test_tiles_and_combine():
    """Host-side pieces in plain jnp: the tile table covers every real token exactly once, and
    merging two split states equals one softmax over both halves."""
    rng = np.random.default_rng(6)
    args = make_batch(rng, [5, 0, 70], [17, 40, 1], nh=2, nkv=1, hd=64, ps=16, pad_tokens=2)
    r = args[-1]
    T = args[0].shape[0]
    tiles, tile_of, local = (np.asarray(x) for x in _tiles(r, T, 16, decode=False))
    seen = {}
    for i, (row, t0, pos0, ntok) in enumerate(tiles):
        for j in range(ntok):
            seen[t0 + j] = (i, j, row, pos0 + j)
    real = np.asarray(r.seq) < r.num_rows
    assert sorted(seen) == list(np.flatnonzero(real))
    for t in np.flatnonzero(real):
        assert seen[t] == (tile_of[t], local[t], r.seq[t], r.positions[t])

    # two splits of 8 keys for 1 tile, 1 kv head, G = 1
    s = rng.standard_normal((16,))
    v = rng.standard_normal((16, 4))
    parts = [(np.exp(s[a:b] - s[a:b].max()), s[a:b].max()) for a, b in ((0, 8), (8, 16))]
    acc = np.zeros((2, 1, 1, 8, 4), np.float32)
    m = np.full((2, 1, 1, 8), -1e30, np.float32)
    l = np.zeros((2, 1, 1, 8), np.float32)
    for i, ((p, mx), (a, b)) in enumerate(zip(parts, ((0, 8), (8, 16)))):
        acc[i, 0, 0, 0], m[i, 0, 0, 0], l[i, 0, 0, 0] = p @ v[a:b], mx, p.sum()
    o = combine_splits(jnp.asarray(acc), jnp.asarray(m), jnp.asarray(l), jnp.zeros(1, jnp.int32),
                       jnp.zeros(1, jnp.int32), jnp.ones(1, bool), 1)
    p = np.exp(s - s.max())
    assert rel(np.asarray(o)[0, 0, 0], p @ v / p.sum()) < 1e-5


def test_default_num_splits():
    assert default_num_splits(programs=2, max_blocks=512, num_sms=132) == 64  # batch 1, 32k: >= 8 blocks a split
    assert default_num_splits(programs=16, max_blocks=512, num_sms=132) == 8  # batch 8: one wave
    assert default_num_splits(programs=2, max_blocks=8, num_sms=132) == 1  # short context
    assert default_num_splits(programs=128, max_blocks=512, num_sms=132) == 1  # batch 64, 2 kv heads


@pytest.mark.parametrize("mode,nh,nkv,hd,ps,splits", [
    ("decode", 16, 2, 256, 16, 4),  # Qwen3.5-like full attention, split-K
    ("decode", 16, 2, 256, 64, None),
    ("decode", 32, 8, 128, 16, None),  # GQA 4, d 128: the 3-stage ring
    ("extend", 16, 2, 256, 16, 2),
    ("extend", 4, 4, 128, 32, None),  # MHA: 64-token query tiles, odd T * G
])
def test_lowers_for_cuda(mode, nh, nkv, hd, ps, splits):
    """The GPU code path (not the interpreter's) goes through Pallas -> Mosaic GPU lowering for
    sm_90 on the CPU: layouts, SMEM transforms, TMA shapes and the SMEM budget (227 KiB) are checked
    there without a GPU. Nothing is compiled to SASS or run."""
    rng = np.random.default_rng(7)
    new = [1, 1, 1] if mode == "decode" else [70, 30, 1]
    q, k, v, kp, vp, layer, r = make_batch(rng, [0, 100, 37], new, nh=nh, nkv=nkv, hd=hd, ps=ps,
                                           dtype=jnp.bfloat16, pad_tokens=1)
    f = jax.jit(lambda q, k, v, kp, vp, r: paged_attention(q, k, v, kp, vp, layer, r, None, num_splits=splits,
                                                           decode=mode == "decode"))
    text = f.trace(q, k, v, kp, vp, r).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text


def test_every_layer_shares_one_lowered_kernel():
    """Two attention layers in one program lower the read kernel once (one private function called
    per layer, the layer an operand), so the program's size does not grow by a Mosaic GPU module a
    layer."""
    rng = np.random.default_rng(8)
    q, k, v, kp, vp, _, r = make_batch(rng, [0, 100, 37], [1, 1, 1], nh=16, nkv=2, hd=256, ps=16,
                                       dtype=jnp.bfloat16)

    def lowered(layers):
        def step(q, k, v, kp, vp, r):
            outs = []
            for layer in layers:
                out, kp, vp = paged_attention(q, k, v, kp, vp, layer, r, None)
                outs.append(out)
            return outs, kp, vp
        return jax.jit(step).trace(q, k, v, kp, vp, r).lower(lowering_platforms=("cuda",)).as_text()

    one, two = lowered([1]), lowered([0, 1])
    assert two.count("func.func private @_read_blocks") == 1 and two.count("call @_read_blocks") == 2
    assert two.count("stablehlo.custom_call") == one.count("stablehlo.custom_call")


def test_rejects_bad_shapes():
    rng = np.random.default_rng(0)
    q, k, v, kp, vp, layer, r = make_batch(rng, [3], [1], nh=2, nkv=1, hd=64, ps=16)
    with pytest.raises(ValueError, match="head_dim"):
        paged_attention(q[..., :32], k[..., :32], v[..., :32], kp[..., :32], vp[..., :32], layer, r, interpret=True)
    with pytest.raises(ValueError, match="q heads"):
        paged_attention(q[:, :1].repeat(3, axis=1), k.repeat(2, axis=1), v.repeat(2, axis=1),
                        kp.repeat(2, axis=3), vp.repeat(2, axis=3), layer, r, interpret=True)
