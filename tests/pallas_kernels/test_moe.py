"""MoE grouped GEMM (Mosaic GPU kernel, GPU interpret mode on CPU) and the routed-experts paths.

* ``grouped_matmul`` against a float64 NumPy loop over the groups (and ``lax.ragged_dot``), for
  group-size distributions with empty experts, every row on one expert, groups ending on and just
  past a 64-row tile edge, and rows past the groups' sum (they give 0);
* the kernel's epilogues (fused ``silu(gate) * up``, per-row weights) and a K loop several times
  longer than the SMEM ring, under the interpreter's race detector;
* ``moe_experts`` (grouped path and decode gather path) against ``layers.routed_experts``, the
  ``lax.ragged_dot`` reference, in fp32 (tight: summation order only) and bf16 (loose: the
  reference rounds after every op);
* ``layers.moe`` under ``kernels="pallas-interpret"`` against ``kernels="jnp"``, the backend
  switch, and the Mosaic GPU lowering for sm_90 at the target model's shapes.

Shapes are tiny and fixed across examples (E = 8 experts, top-2, hidden 64, expert intermediate
64, 40 tokens = 80 routed rows) so each configuration compiles once.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxserve.config import ModelConfig
from jaxserve.models import layers
from pallas_kernels import moe
from tests.pallas_kernels.test_gdn_reference import assert_close

E, TOP_K, H, I, N_TOK = 8, 2, 64, 64, 40
M = N_TOK * TOP_K
TOL = {jnp.float32: 2e-5, jnp.bfloat16: 3e-2}  # bf16: the reference rounds every intermediate
SETTINGS = settings(max_examples=5, deadline=None, database=None)
SMALL = moe.SMALL_MAX_ROWS  # the small path on, whatever moe.SMALL_PATH_ON says


def ref_grouped(xs, w, gs):
    """float64 ``xs[rows of g] @ w[g]`` per group; rows past the groups' sum are 0."""
    xs, w = np.asarray(xs, np.float64), np.asarray(w, np.float64)
    out = np.zeros((xs.shape[0], w.shape[2]))
    start = 0
    for g, size in enumerate(np.asarray(gs)):
        out[start:start + size] = xs[start:start + size] @ w[g]
        start += size
    return out


@st.composite
def group_sizes(draw, rows=M, experts=E):
    """Group sizes over ``rows`` sorted rows: random with empty experts, all on one expert, sizes on
    and around the 64-row tile edge, or summing to less than ``rows``."""
    kind = draw(st.sampled_from(["random", "one", "edges", "short"]))
    gs = np.zeros(experts, np.int64)
    if kind == "one":
        gs[draw(st.integers(0, experts - 1))] = rows
    elif kind == "edges":
        gs[[0, 1, experts - 1]] = [64, 1, rows - 65]  # a group filling a tile, one row past it
    else:
        cuts = np.sort(draw(st.lists(st.integers(0, rows), min_size=experts - 1, max_size=experts - 1)))
        gs = np.diff(np.concatenate([[0], cuts, [rows]]))
        if kind == "short":
            gs[-1] = 0  # the last group's rows belong to no group
    return gs.astype(np.int32), draw(st.integers(0, 2**31 - 1))


@SETTINGS
@given(group_sizes())
def test_grouped_matmul_matches_reference(case):
    gs, seed = case
    rng = np.random.default_rng(seed)
    xs = jnp.asarray(rng.normal(size=(M, H)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(E, H, 2 * I)), jnp.float32)
    got = moe.grouped_matmul(xs, w, jnp.asarray(gs), interpret=True)
    assert_close(got, ref_grouped(xs, w, gs), TOL[jnp.float32], "grouped")
    want = jax.lax.ragged_dot(xs, w, jnp.asarray(gs), precision=jax.lax.Precision.HIGHEST)
    assert_close(got, want, TOL[jnp.float32], "vs ragged_dot")


def test_grouped_matmul_bf16():
    gs = np.array([0, 30, 0, 0, 45, 1, 0, 4], np.int32)
    rng = np.random.default_rng(1)
    xs = jnp.asarray(rng.normal(size=(M, H)), jnp.bfloat16)
    w = jnp.asarray(rng.normal(size=(E, H, 2 * I)) * H ** -0.5, jnp.bfloat16)
    got = moe.grouped_matmul(xs, w, jnp.asarray(gs), interpret=True)
    assert got.dtype == jnp.bfloat16
    assert_close(np.asarray(got, np.float32), ref_grouped(xs.astype(jnp.float32), w.astype(jnp.float32), gs),
                 8e-3, "bf16 grouped")  # one rounding of fp32 products


@SETTINGS
@given(st.lists(st.integers(0, 5), min_size=1, max_size=40), st.sampled_from([8, 64]))
def test_pair_layout_by_comparison_is_the_stable_sort(flat, block_m):
    """The decode-size ``pair_layout`` (every pair compared, no sort) places each pair where the
    stable argsort into ``padded_layout`` does, with the same tiles."""
    ids = jnp.asarray(flat, jnp.int32)
    lay, pos = moe.pair_layout(ids, 6, block_m)
    order = np.argsort(np.asarray(flat), kind="stable")
    ref = moe.padded_layout(jnp.asarray(np.bincount(flat, minlength=6), jnp.int32), len(flat), block_m)
    want = np.zeros(len(flat), np.int32)
    want[order] = np.asarray(ref.pos)
    np.testing.assert_array_equal(np.asarray(pos), want)
    np.testing.assert_array_equal(np.asarray(lay.tiles), np.asarray(ref.tiles))


@SETTINGS
@given(group_sizes(rows=100, experts=4))
def test_padded_layout_invariants(case):
    """Every tile holds one expert's rows; a group starts on a tile; used tiles within the bound."""
    gs, _ = case
    lay = moe.padded_layout(jnp.asarray(gs), 100)
    tiles, pos = np.asarray(lay.tiles), np.asarray(lay.pos)
    nt = moe.num_tiles(100, 4)
    assert tiles.shape == (nt + 1,) and tiles[-1] == sum(-(-g // 64) for g in gs) <= nt
    expert_of_row = np.repeat(np.arange(4), gs)
    real = np.arange(100) < gs.sum()
    assert (pos[~real] == nt * 64).all() and len(set(pos[real])) == real.sum()
    np.testing.assert_array_equal(tiles[pos[real] // 64], expert_of_row)
    starts = np.concatenate([[0], np.cumsum(gs)[:-1]])
    assert (pos[starts[gs > 0]] % 64 == 0).all()


def test_ring_epilogues_and_races():
    """A K loop of 10 steps through 2- and 3-deep rings, the fused epilogue and row weights, under
    the interpreter's happens-before race detector (TMA copies vs WGMMA reads of the ring)."""
    from jax._src.pallas.mosaic_gpu.interpret.interpret_pallas_call import get_races

    K, N = 320, 64
    gs = np.array([5, 0, 60, 0, 0, 3, 2, 0], np.int32)
    rng = np.random.default_rng(2)
    xs = rng.normal(size=(70, K)).astype(np.float32)
    w = rng.normal(size=(E, K, 2 * N)).astype(np.float32) * K ** -0.5
    lay = moe.padded_layout(jnp.asarray(gs), 70)
    pos = np.asarray(lay.pos)
    xp = np.zeros((lay.num_rows, K), np.float32)
    xp[pos] = xs
    row_w = rng.uniform(size=lay.num_rows).astype(np.float32)
    gu = ref_grouped(xs, w, gs)
    fused_want = gu[:, :N] / (1 + np.exp(-gu[:, :N])) * gu[:, N:] * row_w[pos][:, None]
    params = moe.plgpu.InterpretGPUParams(detect_races=True)
    for stages in (2, 3):
        fused = jax.jit(lambda x, w, t, r: moe.grouped_gemm_padded(x, w, t, r, fused=True, block_n=32, stages=stages,
                                                                   interpret=params))
        got = np.asarray(fused(jnp.asarray(xp), jnp.asarray(w), lay.tiles, jnp.asarray(row_w)))
        assert not get_races().races_found
        assert_close(got[pos], fused_want, TOL[jnp.float32], f"fused, {stages} stages")
    plain = jax.jit(lambda x, w, t: moe.grouped_gemm_padded(x, w, t, stages=3, interpret=True))
    assert_close(np.asarray(plain(jnp.asarray(xp), jnp.asarray(w), lay.tiles))[pos], gu, TOL[jnp.float32], "plain")


def routing(rng, kind, n):
    """(top_w [n, k] fp32, top_i [n, k]) with distinct experts per token: random, every token on
    the same two experts, or skewed (most tokens on expert 0)."""
    if kind == "same":
        top_i = np.tile([5, 2], (n, 1))
    else:
        p = np.full(E, 1.0 / E) if kind == "random" else np.array([0.9] + [0.1 / (E - 1)] * (E - 1))
        top_i = np.stack([rng.choice(E, TOP_K, replace=False, p=p) for _ in range(n)])
    top_w = rng.uniform(0.1, 1.0, size=(n, TOP_K))
    return jnp.asarray(top_w / top_w.sum(1, keepdims=True), jnp.float32), jnp.asarray(top_i, jnp.int32)


def expert_inputs(rng, dtype, n=N_TOK):
    xt = jnp.asarray(rng.normal(size=(n, H)), dtype)
    gate_up = jnp.asarray(rng.normal(size=(E, H, 2 * I)) * H ** -0.5, dtype)
    down = jnp.asarray(rng.normal(size=(E, I, H)) * I ** -0.5, dtype)
    return xt, gate_up, down


def reference(xt, top_w, top_i, gate_up, down):
    return np.asarray(jax.jit(layers.routed_experts)(xt, top_w.astype(xt.dtype), top_i, gate_up, down), np.float32)


@SETTINGS
@given(st.sampled_from(["random", "same", "skewed"]), st.sampled_from([jnp.float32, jnp.bfloat16]),
       st.integers(0, 2**31 - 1))
def test_moe_experts_matches_routed_experts(kind, dtype, seed):
    rng = np.random.default_rng(seed)
    xt, gate_up, down = expert_inputs(rng, dtype)
    top_w, top_i = routing(rng, kind, N_TOK)
    got = moe.moe_experts(xt, top_w, top_i, gate_up, down, interpret=True)
    assert got.dtype == jnp.float32 and got.shape == (N_TOK, H)
    assert_close(got, reference(xt, top_w, top_i, gate_up, down), TOL[dtype], f"{kind} {jnp.dtype(dtype).name}")


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_decode_gather_path(dtype):
    """Below ``gather_below`` routed rows ``moe_experts`` gathers the tokens' experts: against the
    reference at 1 and 3 tokens, and the 64-row grouped kernel (forced: no gather, no small path)
    on the same 3 tokens agrees with it."""
    rng = np.random.default_rng(3)
    xt, gate_up, down = expert_inputs(rng, dtype, n=3)
    for n in (1, 3):
        top_w, top_i = routing(rng, "random", n)
        assert n * TOP_K < E  # the gather path
        got = moe.moe_experts(xt[:n], top_w, top_i, gate_up, down, gather_below=E, interpret=True)
        assert_close(got, reference(xt[:n], top_w, top_i, gate_up, down), TOL[dtype], f"gather n={n}")
    kernel = moe.moe_experts(xt, top_w, top_i, gate_up, down, gather_below=0, small_max_rows=0, interpret=True)
    # same roundings in the same places: only fp32 summation order differs (one bf16 ulp at most)
    assert_close(kernel, moe.moe_experts_gather(xt, top_w, top_i, gate_up, down),
                 TOL[jnp.float32] if dtype == jnp.float32 else 8e-3, "kernel vs gather")


def oracle64(xt, top_w, top_i, gate_up, down):
    """float64 ``Σ_s top_w[t, s] * down_e(silu(gate_e(x_t)) * up_e(x_t))`` (no intermediate rounding)."""
    x, gu, dn = (np.asarray(a, np.float64) for a in (xt, gate_up, down))
    top_w, top_i = np.asarray(top_w, np.float64), np.asarray(top_i)
    out = np.zeros(x.shape)
    for t in range(x.shape[0]):
        for s, e in enumerate(top_i[t]):
            g, u = np.split(x[t] @ gu[e], 2)
            out[t] += top_w[t, s] * ((g / (1 + np.exp(-g)) * u) @ dn[e])
    return out


def test_small_layout():
    """8-row tiles: every tile one expert's, groups start on a tile, used tiles within the bound."""
    gs = np.array([0, 9, 8, 1, 0, 0, 17, 3], np.int32)
    lay = moe.padded_layout(jnp.asarray(gs), 40, 8)
    tiles, pos = np.asarray(lay.tiles), np.asarray(lay.pos)
    nt = moe.num_tiles(40, E, 8)
    assert lay.num_rows == nt * 8 and tiles.shape == (nt + 1,) and tiles[-1] == 2 + 1 + 1 + 3 + 1 <= nt
    real = np.arange(40) < gs.sum()
    np.testing.assert_array_equal(tiles[pos[real] // 8], np.repeat(np.arange(E), gs))
    assert (pos[~real] == nt * 8).all() and (pos[np.concatenate([[0], np.cumsum(gs)[:-1]])[gs > 0]] % 8 == 0).all()
    assert [moe.small_block_rows(m, 64) for m in (8, 256, 257, 512, 513)] == [8, 8, 16, 16, 32]


def test_small_kernel_ring_epilogues_and_races():
    """The swap-AB kernel alone: a K loop of 10 (fp32: block_k 32) steps through 2- and 3-deep
    rings, the fused epilogue with row weights and the plain GEMM, 8- and 16-row tiles, the output
    in row order (through a transposed SMEM view) and transposed, under the race detector; against
    float64."""
    from jax._src.pallas.mosaic_gpu.interpret.interpret_pallas_call import get_races

    K, N = 320, 64
    gs = np.array([5, 0, 20, 0, 0, 3, 12, 0], np.int32)  # 40 rows
    rng = np.random.default_rng(5)
    xs = rng.normal(size=(40, K)).astype(np.float32)
    w = rng.normal(size=(E, K, 2 * N)).astype(np.float32) * K ** -0.5
    gu = ref_grouped(xs, w, gs)
    params = moe.plgpu.InterpretGPUParams(detect_races=True)
    for R, stages, tr in ((8, 2, False), (16, 3, True)):
        lay = moe.padded_layout(jnp.asarray(gs), 40, R)
        pos = np.asarray(lay.pos)
        xp = np.zeros((lay.num_rows, K), np.float32)
        xp[pos] = xs
        row_w = rng.uniform(size=lay.num_rows).astype(np.float32)
        fused_want = gu[:, :N] / (1 + np.exp(-gu[:, :N])) * gu[:, N:] * row_w[pos][:, None]
        fused = jax.jit(lambda x, w, t, r: moe.grouped_gemm_small(x, w, t, r, block_rows=R, fused=True, stages=stages,
                                                                  transposed_out=tr, interpret=params))
        got = np.asarray(fused(jnp.asarray(xp), jnp.asarray(w), lay.tiles, jnp.asarray(row_w)))
        assert not get_races().races_found
        assert got.shape == ((N, lay.num_rows) if tr else (lay.num_rows, N))
        assert_close((got.T if tr else got)[pos], fused_want, TOL[jnp.float32], f"small fused R={R} transposed={tr}")
        plain = jax.jit(lambda x, w, t: moe.grouped_gemm_small(x, w, t, block_rows=R, stages=stages,
                                                               transposed_out=not tr, interpret=True))
        got = np.asarray(plain(jnp.asarray(xp), jnp.asarray(w), lay.tiles))
        assert_close((got if tr else got.T)[pos], gu, TOL[jnp.float32], f"small plain R={R} transposed={not tr}")


def test_small_kernel_transposed_out_lowers():
    """The transposed-output variant (not ``moe_experts``' choice) lowers for sm_90 at the target
    shapes too: 8-row tiles, its 16-byte unswizzled output tile, fused and down with row weights."""
    f = jax.ShapeDtypeStruct
    bf = jnp.bfloat16
    lay_rows = moe.num_tiles(8, 64, 8) * 8
    tiles = f((lay_rows // 8 + 1,), jnp.int32)
    for fused, (K, Nw) in ((True, (2048, 1024)), (False, (512, 2048))):
        fn = jax.jit(lambda x, w, t, r: moe.grouped_gemm_small(x, w, t, None if fused else r, block_rows=8, fused=fused,
                                                               transposed_out=True))
        text = fn.trace(f((lay_rows, K), bf), f((64, K, Nw), bf), tiles, f((lay_rows,), jnp.float32)).lower(
            lowering_platforms=("cuda",)).as_text()
        assert text.count("custom_call @mosaic_gpu") == 1


def small_routing(rng, kind, n):
    """(top_w, top_i) for the small-path cases: random distinct experts, every row on one expert
    (each token's top-k all expert 3: repeated experts), or slot 0 on expert 3 for every token."""
    top_w, top_i = routing(rng, "random", n)
    top_i = np.asarray(top_i).copy()
    if kind == "one":
        top_i[:] = 3
    elif kind == "skewed":
        top_i[:, 0] = 3
        top_i[:, 1] = np.where(top_i[:, 1] == 3, 6, top_i[:, 1])
    return top_w, jnp.asarray(top_i, jnp.int32)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_small_path_matches_gather_and_oracle(dtype):
    """``moe_experts``' small path (the default at these sizes: 2 to 64 routed rows, 8- and 16-row
    tiles) against the gather path (same roundings: fp32 summation order apart) and float64, at 1,
    2, 5 and 32 tokens, random, skewed and all-on-one-expert routing (repeated experts in a token)."""
    rng = np.random.default_rng(6)
    xt, gate_up, down = expert_inputs(rng, dtype, n=32)
    for n, kind in ((1, "random"), (2, "one"), (5, "random"), (32, "random"), (32, "skewed"), (32, "one")):
        top_w, top_i = small_routing(rng, kind, n)
        args = (xt[:n], top_w, top_i, gate_up, down)
        got = moe.moe_experts(*args, small_max_rows=SMALL, interpret=True)
        assert got.dtype == jnp.float32 and got.shape == (n, H)
        what = f"small n={n} {kind} {jnp.dtype(dtype).name} R={moe.small_block_rows(n * TOP_K, E)}"
        assert_close(got, moe.moe_experts_gather(*args), TOL[jnp.float32] if dtype == jnp.float32 else 8e-3,
                     what + " vs gather")
        assert_close(got, oracle64(*args), TOL[dtype], what + " vs float64")
        if n * TOP_K <= moe.PAIR_TILE_MAX_ROWS:  # pair tiles (no sort) against the sorted layout
            sorted_ = moe.moe_experts(*args, small_max_rows=SMALL, pair_max_rows=0, interpret=True)
            assert_close(got, sorted_, TOL[jnp.float32] if dtype == jnp.float32 else 8e-3, what + " pairs vs sorted")
    got = moe.moe_experts(*args, small_max_rows=SMALL, block_rows=32, stages=2, interpret=True)  # 32-row tiles, 2-deep ring
    assert_close(got, oracle64(*args), TOL[dtype], "small R=32")
    got = moe.moe_experts(*args, small_max_rows=SMALL, small_transposed_out=True, interpret=True)  # transposed tiles, XLA transposes
    assert_close(got, oracle64(*args), TOL[dtype], "small transposed_out")


def test_pair_tiles_layout():
    """A tile per (token, slot) pair: the table is the expert ids in pair order, the pair's token in
    the tile's first row and zeros after it, its routing weight on that row only."""
    xt = jnp.arange(2 * H, dtype=jnp.float32).reshape(2, H) + 1
    top_i = jnp.asarray([[3, 1], [1, 7]], jnp.int32)
    top_w = jnp.asarray([[0.75, 0.25], [0.5, 0.5]], jnp.float32)
    tiles, xp, row_w = moe.pair_tiles(top_i, top_w, xt, 8)
    np.testing.assert_array_equal(tiles, [3, 1, 1, 7])
    want_x = np.zeros((32, H), np.float32)
    want_x[[0, 8]] = xt[0]
    want_x[[16, 24]] = xt[1]
    np.testing.assert_array_equal(xp, want_x)
    want_w = np.zeros(32, np.float32)
    want_w[[0, 8, 16, 24]] = [0.75, 0.25, 0.5, 0.5]
    np.testing.assert_array_equal(row_w, want_w)


def _moe_cfg(kernels: str, **kw) -> ModelConfig:
    base = ModelConfig.from_file(Path(__file__).resolve().parents[2] / "weights" / "moe" / "config.json")
    return dataclasses.replace(base, kernels=kernels, **kw)


def test_layers_moe_runs_the_kernel_under_pallas_interpret():
    """``layers.moe`` (router + routed + gated shared expert) through the kernel equals the jnp
    backend in fp32, on a prefill-sized batch (grouped kernel) and a decode one (small path)."""
    cfg = _moe_cfg("pallas-interpret", hidden_size=H, moe_intermediate_size=I, num_experts=E,
                   num_experts_per_tok=TOP_K)
    rng = np.random.default_rng(4)
    f = lambda fan_in, *s: jnp.asarray(rng.normal(size=s) * fan_in ** -0.5, jnp.float32)  # noqa: E731
    p = dict(router=f(H, H, E + 1), gate_up=f(H, E, H, 2 * I), down=f(I, E, I, H),  # router: + the shared gate
             shared_expert=dict(gate_up_proj=dict(w=f(H, H, 2 * 32)), down_proj=dict(w=f(32, 32, H))))
    assert layers.use_moe_kernel(cfg, jnp.float32)
    for n in (N_TOK, 2):
        x = f(1, n, H)
        got = jax.jit(lambda p, x: layers.moe(p, cfg, x))(p, x)
        want = jax.jit(lambda p, x: layers.moe(p, dataclasses.replace(cfg, kernels="jnp"), x))(p, x)
        assert_close(got, want, TOL[jnp.float32], f"layers.moe n={n}")


def test_backend_switch_and_contract():
    """``moe`` runs when asked for, and under ``auto`` only on a GPU (this CPU: jnp; the GPU side is
    tests/models/test_backends.py); a shape or dtype it cannot take is an error when asked for,
    jnp under ``auto``."""
    from jaxserve.models import backends

    assert "moe" in backends.KERNELS and "moe" in backends.AUTO_ON_GPU
    assert not layers.use_moe_kernel(_moe_cfg("auto"), jnp.bfloat16)
    assert not layers.use_moe_kernel(_moe_cfg("jnp"), jnp.bfloat16)
    assert layers.use_moe_kernel(_moe_cfg("moe"), jnp.bfloat16)  # the shipped moe model: I = 32
    assert not layers.use_moe_kernel(_moe_cfg("conv1d"), jnp.bfloat16)
    assert moe.supports(2048, 512, jnp.bfloat16) and moe.supports(64, 64, jnp.float32, gpu=False)
    assert not moe.supports(2048, 512, jnp.float32) and not moe.supports(2048, 24, jnp.bfloat16)
    # the small path needs 64-column tiles of both GEMMs; where it cannot, decode gathers (I = 32)
    assert moe.small_supports(2048, 512, jnp.bfloat16) and not moe.small_supports(2048, 32, jnp.bfloat16)
    with pytest.raises(ValueError, match="the moe kernel does not take hidden 2048, expert intermediate 24"):
        layers.use_moe_kernel(_moe_cfg("pallas", hidden_size=2048, moe_intermediate_size=24), jnp.bfloat16)
    with pytest.raises(ValueError, match="float32"):
        layers.use_moe_kernel(_moe_cfg("pallas"), jnp.float32)  # tf32 with an MN-major B: no sm_90 WGMMA
    x = jnp.zeros((128, 64), jnp.bfloat16)
    with pytest.raises(ValueError, match="do not fit"):
        moe.grouped_gemm_padded(x, jnp.zeros((2, 64, 40), jnp.bfloat16), jnp.zeros(3, jnp.int32))


@pytest.mark.parametrize("n, kw", [(1, dict(gather_below=0, small_max_rows=0)), (4096, {}), (1, dict(small_max_rows=SMALL)),
                                   (32, dict(small_max_rows=SMALL)), (64, dict(small_max_rows=SMALL)),
                                   (8, dict(small_max_rows=SMALL, block_rows=32)),
                                   (1, dict(small_max_rows=SMALL, small_transposed_out=True))])
def test_kernels_lower_for_the_gpu(n, kw):
    """Mosaic GPU lowering (TMA boxes, swizzles, WGMMA operand layouts incl. the small path's
    MN-major A, the SMEM budget) runs without a GPU, and the interpreter does not take it: at the
    target model's shapes (hidden 2048, 64 experts top-8, intermediate 512, bf16), decode (the
    64-row kernel forced at one token; the small path at 1, 32, 64 tokens: 8- and 16-row tiles,
    and 32 forced) and prefill, the experts must lower for CUDA to exactly two Mosaic GPU kernels
    (gate/up and down; no jnp fallback). Their values are checked against the references in
    interpret mode above."""
    f = jax.ShapeDtypeStruct
    Et, kt, Ht, It = 64, 8, 2048, 512
    fn = jax.jit(lambda x, w, i, g, d: moe.moe_experts(x, w, i, g, d, **kw))
    text = fn.trace(f((n, Ht), jnp.bfloat16), f((n, kt), jnp.float32), f((n, kt), jnp.int32),
                    f((Et, Ht, 2 * It), jnp.bfloat16), f((Et, It, Ht), jnp.bfloat16)).lower(
        lowering_platforms=("cuda",)).as_text()
    assert text.count("custom_call @mosaic_gpu") == 2


@pytest.mark.parametrize("n, kw", [(1, dict(gather_below=E)), (5, dict(small_max_rows=SMALL)),
                                   (12, dict(small_max_rows=SMALL)), (N_TOK, dict(small_max_rows=0))])
def test_stacked_experts_read_in_place(n, kw):
    """Experts given as a stack of 3 layers' (``[3 * E, ...]``) with ``num_experts`` and a traced
    ``stack_row`` give that layer's result exactly, on the gather path, the small path (pair
    tiles at 5 tokens, the sorted layout at 12) and the 64-row kernel (the decoder's scan passes the stack so no layer's experts are copied)."""
    rng = np.random.default_rng(7)
    xt, gate_up, down = expert_inputs(rng, jnp.float32)
    top_w, top_i = routing(rng, "random", n)
    others = [expert_inputs(rng, jnp.float32)[1:] for _ in range(2)]
    stack_gu = jnp.concatenate([others[0][0], gate_up, others[1][0]])
    stack_dn = jnp.concatenate([others[0][1], down, others[1][1]])
    want = moe.moe_experts(xt[:n], top_w, top_i, gate_up, down, interpret=True, **kw)
    got = jax.jit(lambda row: moe.moe_experts(xt[:n], top_w, top_i, stack_gu, stack_dn, num_experts=E,
                                              stack_row=row, interpret=True, **kw))(jnp.int32(1))
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
