"""gdn_chunked_pallas (jnp UT transform + Mosaic GPU chunk recurrence, GPU interpret mode on CPU)
against the pure-jnp references.

Every case draws random ragged batches (start positions that are not multiples of 64, an empty
sequence, bucket padding past ``cu_seqlens[-1]``), random initial states, and asks for the state at
EVERY boundary the chunked form can produce (0, each absolute ×64 boundary inside the sequence,
the whole sequence). ``gdn_chunked`` / ``kda_chunked`` compute the same chunks, so the kernel must
match them to fp32 rounding; ``gdn_recurrent`` (token by token) is checked too. Shapes are the
smallest the tiling allows (dk = dv = 64: one WGMMA row group), so each case compiles in seconds.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.gdn_chunked import gdn_chunked_pallas
from pallas_kernels.gdn_reference import gdn_chunked, gdn_recurrent
from pallas_kernels.kda_reference import kda_chunked, kda_recurrent
from tests.pallas_kernels.chunk_checks import every_boundary, make_inputs, rel

TOL = 2e-5  # fp32 on both sides (interpretation runs the WGMMAs as fp32 dots)
NUM_SNAPSHOTS = 16  # requests padded to a fixed count (repeating the last), so shapes and compiles are shared


def check(x, cu, init, start_pos, *, kda, tol=TOL, recurrent=True, **kw):
    lens = np.diff(np.asarray(cu))
    snap_seq, snap_len = every_boundary(lens, np.asarray(start_pos), pad_to=NUM_SNAPSHOTS)
    args = dict(cu_seqlens=cu, initial_state=init, snapshot_seq=snap_seq, snapshot_len=snap_len)
    o, final, snaps = gdn_chunked_pallas(**x, **args, start_pos=start_pos, interpret=True, **kw)
    ref = kda_chunked if kda else gdn_chunked
    o_r, final_r, snaps_r = ref(**x, **args, start_pos=start_pos)
    assert o.dtype == x["v"].dtype and final.dtype == jnp.float32 and snaps.shape == snaps_r.shape
    assert np.isfinite(np.asarray(o, np.float32)).all() and np.isfinite(final).all() and np.isfinite(snaps).all()
    assert rel(o, o_r) < tol and rel(final, final_r) < tol and rel(snaps, snaps_r) < tol
    n_real = int(cu[-1])
    np.testing.assert_array_equal(np.asarray(o, np.float32)[n_real:], 0.0)  # bucket padding tokens
    if recurrent:
        rec = kda_recurrent if kda else gdn_recurrent
        o_t, final_t, snaps_t = rec(**x, **args)
        assert rel(o, o_t) < 10 * tol and rel(final, final_t) < 10 * tol and rel(snaps, snaps_t) < 10 * tol
    return o, final, snaps


SHARED_T = 300  # one token bucket for the GDN cases below: one kernel compile serves them all


@pytest.mark.parametrize("seed", [0, 1])
def test_gdn_random_ragged(seed):
    """Three sequences (one empty) with random lengths and random start positions, GQA (Hk=1, Hv=2)."""
    rng = np.random.default_rng(seed)
    lens = [int(rng.integers(1, 140)), 0, int(rng.integers(60, 150))]
    start = rng.integers(0, 200, size=3).astype(np.int32)
    x, cu, init = make_inputs(rng, lens=lens, T=SHARED_T, Hk=1, Hv=2, dk=64, dv=64, kda=False)
    check(x, cu, init, jnp.asarray(start), kda=False)


def test_gdn_aligned_and_tiny():
    """start_pos multiple of 64 (no partial first chunk), a one-token sequence, exact-chunk lengths."""
    rng = np.random.default_rng(5)
    lens = [128, 1, 64]
    x, cu, init = make_inputs(rng, lens=lens, T=SHARED_T, Hk=1, Hv=2, dk=64, dv=64, kda=False)
    check(x, cu, init, jnp.asarray([0, 63, 128], jnp.int32), kda=False)


def test_kda_per_channel_gate():
    """KDA's gate ``[T, Hv, dk]`` through the same kernel: the chunk decay is a [dk] vector."""
    rng = np.random.default_rng(7)
    lens = [90, 75]
    x, cu, init = make_inputs(rng, lens=lens, T=170, Hk=2, Hv=2, dk=64, dv=64, kda=True)
    check(x, cu, init, jnp.asarray([37, 5], jnp.int32), kda=True)


def test_two_dv_tiles_and_wide_dk():
    """dv = 128 split into two programs per head (block_dv=64); dk = 128 (two WGMMA K groups)."""
    rng = np.random.default_rng(9)
    lens = [70]
    x, cu, init = make_inputs(rng, lens=lens, T=70, Hk=1, Hv=1, dk=128, dv=128, kda=False)
    check(x, cu, init, jnp.asarray([20], jnp.int32), kda=False, block_dv=64, recurrent=False)


def test_prefill_in_pieces_equals_whole():
    """A prompt prefilled as 100 + 77 tokens (second piece resumed at start_pos 100 from the first
    piece's final state) gives the same outputs and states as one call: same absolute chunks. All
    three calls share one token bucket (the pieces are padded), so they share one compile."""
    rng = np.random.default_rng(11)
    L, cut = 177, 100
    x, cu, init = make_inputs(rng, lens=[L], T=L, Hk=1, Hv=2, dk=64, dv=64, kda=False)
    run = lambda x, n, init, start, snap: gdn_chunked_pallas(  # noqa: E731
        **x, cu_seqlens=jnp.asarray([0, n], jnp.int32), initial_state=init, start_pos=jnp.asarray([start], jnp.int32),
        snapshot_seq=jnp.zeros(1, jnp.int32), snapshot_len=jnp.asarray([snap], jnp.int32), interpret=True)
    o, final, snap = run(x, L, init, 0, 128)
    tail = {n: jnp.concatenate([a[cut:], a[:cut]]) for n, a in x.items()}  # padding past L - cut
    o1, s1, _ = run(x, cut, init, 0, 64)
    o2, s2, snap2 = run(tail, L - cut, s1, cut, 128 - cut)
    assert rel(jnp.concatenate([o1[:cut], o2[:L - cut]]), o) < TOL
    assert rel(s2, final) < TOL and rel(snap2, snap) < TOL
    _, _, snap_ref = gdn_chunked(**x, cu_seqlens=cu, initial_state=init, snapshot_seq=jnp.zeros(1, jnp.int32),
                                 snapshot_len=jnp.asarray([128], jnp.int32))
    assert rel(snap, snap_ref) < TOL


def test_bf16_activations_and_bf16_matmuls():
    """bf16 q/k/v/g/beta, o back in bf16, state fp32; bf16 WGMMA operands at bf16 accuracy."""
    rng = np.random.default_rng(13)
    lens = [50, 100]
    x, cu, init = make_inputs(rng, lens=lens, T=160, Hk=1, Hv=2, dk=64, dv=64, kda=False, dtype=jnp.bfloat16)
    check(x, cu, init, jnp.asarray([14, 64], jnp.int32), kda=False, tol=2e-2, recurrent=False,
          matmul_dtype=jnp.bfloat16)


def test_invalid_snapshot_raises_eagerly_and_is_nan_under_jit():
    rng = np.random.default_rng(17)
    x, cu, init = make_inputs(rng, lens=[80], T=80, Hk=1, Hv=1, dk=64, dv=64, kda=False)
    bad = dict(snapshot_seq=jnp.asarray([0, 0], jnp.int32), snapshot_len=jnp.asarray([64, 30], jnp.int32))
    with pytest.raises(ValueError, match="not available"):
        gdn_chunked_pallas(**x, cu_seqlens=cu, initial_state=init, interpret=True, **bad)
    run = jax.jit(lambda x, s, n: gdn_chunked_pallas(**x, cu_seqlens=cu, initial_state=init, snapshot_seq=s,
                                                     snapshot_len=n, interpret=True))
    _, _, snaps = run(x, bad["snapshot_seq"], bad["snapshot_len"])
    snaps = np.asarray(snaps)
    assert np.isfinite(snaps[0]).all() and np.isnan(snaps[1]).all()


def test_rejects_bad_shapes():
    rng = np.random.default_rng(0)
    x, cu, init = make_inputs(rng, lens=[10], T=10, Hk=1, Hv=1, dk=32, dv=64, kda=False)
    with pytest.raises(ValueError, match="dk=32"):
        gdn_chunked_pallas(**x, cu_seqlens=cu, interpret=True)
    x, cu, init = make_inputs(rng, lens=[10], T=10, Hk=1, Hv=1, dk=64, dv=64, kda=False)
    with pytest.raises(ValueError, match="block_dv"):
        gdn_chunked_pallas(**x, cu_seqlens=cu, block_dv=32, interpret=True)
    x2, cu2, _ = make_inputs(rng, lens=[10], T=10, Hk=1, Hv=1, dk=128, dv=128, kda=False)
    with pytest.raises(ValueError, match="SMEM"):  # Mosaic GPU would fail at compile time on the GPU
        gdn_chunked_pallas(**x2, cu_seqlens=cu2, block_dv=128, matmul_dtype=jnp.bfloat16, interpret=True)
    with pytest.raises(ValueError, match="gate"):
        gdn_chunked_pallas(**{**x, "g": x["g"][:-1]}, cu_seqlens=cu, interpret=True)


@pytest.mark.parametrize("kda,matmul_dtype", [(False, "float32"), (True, "float32"), (False, "bfloat16")])
def test_lowers_for_cuda_at_model_shapes(kda, matmul_dtype):
    """The GPU code path (not the interpreter's) goes through Pallas -> Mosaic GPU lowering for
    sm_90 on the CPU at Qwen3-Next / Kimi-Linear shapes (dk = dv = 128, 32 value heads, bf16
    activations): layouts, SMEM transforms, TMA shapes and the 227 KiB SMEM budget are checked
    there without a GPU. Nothing is compiled to SASS or run."""
    T, Hk, Hv, d = 256, 32 if kda else 16, 32, 128
    rng = np.random.default_rng(3)
    x, cu, init = make_inputs(rng, lens=[100, 150], T=T, Hk=Hk, Hv=Hv, dk=d, dv=d, kda=kda, dtype=jnp.bfloat16)
    snap = jnp.zeros(3, jnp.int32)
    f = jax.jit(lambda x, cu, init, start: gdn_chunked_pallas(
        **x, cu_seqlens=cu, initial_state=init, start_pos=start, snapshot_seq=snap, snapshot_len=snap,
        matmul_dtype=matmul_dtype))
    text = f.trace(x, cu, init, jnp.asarray([5, 64], jnp.int32)).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text


@pytest.mark.parametrize("kda", [False, True])
def test_chunk_terms_match_reference(kda):
    """The blocked (I + A)⁻¹ and the matmul form of u, w equal the reference's row-by-row solve."""
    from pallas_kernels.gdn_chunked import chunk_terms, unit_lower_inverse
    from pallas_kernels.kda_reference import _chunk_terms, l2norm

    rng = np.random.default_rng(21)
    M, H, C, dk, dv = 3, 2, 64, 32, 16
    n = lambda *s: jnp.asarray(rng.normal(size=s).astype(np.float32))  # noqa: E731
    q, k, v = l2norm(n(M, H, C, dk)), l2norm(n(M, H, C, dk)), n(M, H, C, dv)
    g = -jnp.asarray(rng.uniform(0, 0.5, size=(M, H, C, dk if kda else 1)).astype(np.float32))
    beta = jnp.asarray(rng.uniform(0, 1, size=(M, H, C)).astype(np.float32))
    for got, want in zip(chunk_terms(q, k, v, g, beta), _chunk_terms(q, k, v, g, beta)):
        assert rel(got, want) < 1e-5
    A = jnp.tril(n(2, C, C) * 0.2, -1)
    t = np.asarray(unit_lower_inverse(A), np.float64)
    np.testing.assert_allclose(t @ (np.eye(C) + np.asarray(A, np.float64)), np.broadcast_to(np.eye(C), t.shape),
                               atol=1e-5)


def test_tf32_prep_changes_only_the_precision_of_the_intra_chunk_products():
    """``prep_precision="default"`` (the TF32 experiment) lowers the same nine XLA products at the
    configured precision instead of HIGHEST, and computes the same terms (on the CPU, where the
    default is full fp32); a value outside ``PREP_PRECISIONS`` is an error."""
    import re

    from pallas_kernels.gdn_chunked import PREP_PRECISIONS, chunk_terms
    from pallas_kernels.kda_reference import _chunk_terms, l2norm

    T, d = 128, 64
    x = dict(q=jnp.zeros((T, 1, d)), k=jnp.zeros((T, 1, d)), v=jnp.zeros((T, 2, d)), g=jnp.zeros((T, 2)),
             beta=jnp.zeros((T, 2)))
    cu = jnp.asarray([0, 100], jnp.int32)
    precisions = {}
    for prep in PREP_PRECISIONS:
        f = jax.jit(lambda x, cu, prep=prep: gdn_chunked_pallas(**x, cu_seqlens=cu, prep_precision=prep))
        text = f.trace(x, cu).lower(lowering_platforms=("cuda",)).as_text()
        precisions[prep] = re.findall(r"stablehlo.dot_general[^\n]*precision = \[(\w+), \w+\]", text)
    assert len(precisions["highest"]) == len(precisions["default"]) > 0
    assert set(precisions["highest"]) == {"HIGHEST"} and set(precisions["default"]) == {"DEFAULT"}

    rng = np.random.default_rng(5)
    n = lambda *s: jnp.asarray(rng.normal(size=s).astype(np.float32))  # noqa: E731
    q, k, v = l2norm(n(2, 2, 64, 32)), l2norm(n(2, 2, 64, 32)), n(2, 2, 64, 16)
    g = -jnp.asarray(rng.uniform(0, 0.5, size=(2, 2, 64, 1)).astype(np.float32))
    beta = jnp.asarray(rng.uniform(0, 1, size=(2, 2, 64)).astype(np.float32))
    for got, want in zip(chunk_terms(q, k, v, g, beta, precision=None), _chunk_terms(q, k, v, g, beta)):
        assert rel(got, want) < 1e-5
    with pytest.raises(ValueError, match="prep_precision"):
        gdn_chunked_pallas(**x, cu_seqlens=cu, prep_precision="fast", interpret=True)
