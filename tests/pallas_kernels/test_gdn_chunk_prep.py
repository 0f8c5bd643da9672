"""gdn_chunk_prep (the GDN chunk's intra-chunk terms by a Mosaic GPU kernel parallel over the chunks,
GPU interpret mode on CPU) against the jnp terms it replaces, and ``gdn_chunked_pallas(prep="kernel")``
against the references.

The terms are checked one by one against ``gdn_chunked.chunk_terms`` at fp32 (the interpreter runs
the WGMMAs as fp32 dots) on chunks with strong and weak gates, grouped heads, two column blocks of
v per head and an all-zero (padding) chunk. The whole prefill is checked through
``chunk_checks.check_fused`` (a ragged batch with an empty sequence, resumed sequences, every
snapshot boundary, bucket padding) at fp32 and with bf16 operands (the GPU configuration). The CUDA
lowering at Qwen3.5 shapes checks layouts, WGMMA operand majorness, TMA shapes and SMEM without a GPU.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.gdn_chunk_prep import chunk_terms_kernel, smem_bytes, SMEM_BYTES
from pallas_kernels.gdn_chunked import chunk_terms, gdn_chunked_pallas
from pallas_kernels.gdn_reference import gdn_chunked, gdn_recurrent
from pallas_kernels.kda_reference import l2norm
from tests.pallas_kernels.chunk_checks import check_fused, make_inputs, rel

C = 64


def test_terms_match_the_jnp_terms():
    """Three chunks of Hk = 1 key head and Hv = 2 value heads (dk = 64, dv = 128: two programs per
    head, of which only the first writes the v-independent terms): a weak-gate chunk, a
    strong-gate chunk with beta near 1, and an all-zero chunk (grid padding: T = I, terms 0)."""
    rng = np.random.default_rng(1)
    M, Hk, Hv, dk, dv = 3, 1, 2, 64, 128
    q = l2norm(jnp.asarray(rng.normal(size=(M, Hk, C, dk)), jnp.float32)) * dk ** -0.5
    k = l2norm(jnp.asarray(rng.normal(size=(M, Hk, C, dk)), jnp.float32))
    v = jnp.asarray(rng.normal(size=(M, Hv, C, dv)), jnp.float32)
    g = -np.stack([rng.uniform(0, 0.03, (Hv, C)), rng.uniform(0, 1.0, (Hv, C)), np.zeros((Hv, C))])
    beta = np.stack([rng.uniform(0, 1, (Hv, C)), rng.uniform(0.9, 1, (Hv, C)), np.zeros((Hv, C))])
    q, k, v = q.at[2].set(0), k.at[2].set(0), v.at[2].set(0)
    gb = jnp.asarray(np.stack([g, beta], axis=2), jnp.float32)  # [M, Hv, 2, C]

    w, qd, kd, u, qk = chunk_terms_kernel(q, k, v, gb, matmul_dtype=jnp.float32, interpret=True)
    rep = lambda x: jnp.repeat(x, Hv // Hk, axis=1)  # noqa: E731
    want = chunk_terms(rep(q), rep(k), v, jnp.asarray(g, jnp.float32)[..., None], jnp.asarray(beta, jnp.float32))
    for got, ref in ((w, want.w), (qd, want.q_decayed), (kd, want.k_decayed), (qk, want.qk),
                     (u, want.u)):
        assert got.shape == ref.shape
        assert rel(got[:2], ref[:2]) < 2e-5
        np.testing.assert_array_equal(np.asarray(got[2]), 0.0)


def check(x, cu, init, start_pos, *, tol, **kw):
    check_fused(functools.partial(gdn_chunked_pallas, prep="kernel"), gdn_chunked, gdn_recurrent, x, cu, init,
                start_pos, tol=tol, **kw)


def test_ragged_resumed_and_every_boundary():
    """GQA (Hk = 1, Hv = 2), dv = 128; lengths 1, 0, 64 and 150 starting at 5, 9, 128 and 37, 16
    tokens of padding: the prefill with the kernel's terms equals the reference to fp32 rounding."""
    rng = np.random.default_rng(0)
    lens = [1, 0, 64, 150]
    x, cu, init = make_inputs(rng, lens=lens, T=sum(lens) + 16, Hk=1, Hv=2, dk=64, dv=128)
    check(x, cu, init, jnp.asarray([5, 9, 128, 37], jnp.int32), tol=2e-5, matmul_dtype=jnp.float32)


def test_bf16_activations_and_bf16_operands():
    """The GPU configuration: bf16 q / k / v / beta, fp32 g, bf16 operands for the terms and the
    recurrence (the state carried as stored, its N-major and transposed operands), o back in bf16:
    within METHOD.md's bf16 band."""
    rng = np.random.default_rng(13)
    lens = [50, 80]
    x, cu, init = make_inputs(rng, lens=lens, T=140, Hk=1, Hv=2, dk=64, dv=64, dtype=jnp.bfloat16)
    x["g"] = x["g"].astype(jnp.float32)
    check(x, cu, init, jnp.asarray([14, 64], jnp.int32), tol=2e-2, matmul_dtype=jnp.bfloat16, recurrent=False)


def test_rejects_what_it_cannot_take():
    rng = np.random.default_rng(2)
    x, cu, _ = make_inputs(rng, lens=[10], T=10, Hk=1, Hv=1, dk=64, dv=64)
    with pytest.raises(ValueError, match="GDN's gate"):
        gdn_chunked_pallas(**{**x, "g": jnp.zeros((10, 1, 64))}, cu_seqlens=cu, prep="kernel", interpret=True)
    with pytest.raises(ValueError, match="float32 in interpret mode only"):
        gdn_chunked_pallas(**x, cu_seqlens=cu, prep="kernel", matmul_dtype=jnp.float32)
    with pytest.raises(ValueError, match="dk=32"):
        y, cu, _ = make_inputs(rng, lens=[10], T=10, Hk=1, Hv=1, dk=32, dv=64)
        gdn_chunked_pallas(**y, cu_seqlens=cu, prep="kernel", interpret=True)
    with pytest.raises(ValueError, match="prep="):
        gdn_chunked_pallas(**x, cu_seqlens=cu, prep="triton", interpret=True)
    assert smem_bytes(128, jnp.bfloat16) <= SMEM_BYTES


def test_lowers_for_cuda_at_model_shapes():
    """The GPU code path through Pallas -> Mosaic GPU lowering for sm_90 at Qwen3.5 shapes (dk = dv =
    128, 16 key heads, 32 value heads), bf16: the prep kernel and the natural-layout recurrence
    kernel (a [128, 64] accumulator, transposed and N-major SMEM operands). Nothing is run."""
    T, Hk, Hv, d = 256, 16, 32, 128
    rng = np.random.default_rng(3)
    x, cu, init = make_inputs(rng, lens=[100, 150], T=T, Hk=Hk, Hv=Hv, dk=d, dv=d, dtype=jnp.bfloat16)
    snap = jnp.zeros(3, jnp.int32)
    f = jax.jit(lambda x, cu, init, start: gdn_chunked_pallas(
        **x, cu_seqlens=cu, initial_state=init, start_pos=start, snapshot_seq=snap, snapshot_len=snap,
        matmul_dtype=jnp.bfloat16, prep="kernel"))
    text = f.trace(x, cu, init, jnp.asarray([5, 64], jnp.int32)).lower(lowering_platforms=("cuda",)).as_text()
    assert "gdn_chunk_prep" in text and "delta_chunk_natural" in text and "mosaic_gpu" in text
