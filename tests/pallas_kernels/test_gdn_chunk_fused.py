"""gdn_chunk_fused (the whole chunk in one Mosaic GPU kernel, GPU interpret mode on CPU) against the
pure-jnp references.

Between them the cases cover an empty sequence, one-token and exact-chunk sequences, sequences
resumed mid-chunk (``start_pos`` not a multiple of 64), bucket padding past ``cu_seqlens[-1]``,
grouped heads, two state tiles per head, gates strong enough to forget a state within a chunk and
bf16 operands; each starts from random initial states, asks for the state at EVERY boundary the
chunked form can produce and for one it cannot (NaN under ``jit``). ``gdn_chunked`` computes the
same absolute chunks, so with fp32 operands (the interpreter runs the WGMMAs as fp32 dots) the
kernel must match it to fp32 rounding; ``gdn_recurrent`` (token by token) is checked too. One
interpreted call costs 10-20 s on a loaded 2-core machine, so the cases are few and each covers many
edges; the CUDA lowering at model shapes checks layouts, WGMMA operands, TMA shapes and the SMEM
budget without a GPU.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.gdn_chunk_fused import gdn_chunk_fused, smem_bytes, supports
from pallas_kernels.gdn_reference import gdn_chunked, gdn_recurrent
from tests.pallas_kernels.chunk_checks import check_fused, make_inputs

TOL = 2e-5  # fp32 on both sides
BF16_TOL = 2e-2  # bf16 operands (and bf16 activations): METHOD.md's bf16 band


def check(x, cu, init, start_pos, *, tol=TOL, **kw):
    check_fused(gdn_chunk_fused, gdn_chunked, gdn_recurrent, x, cu, init, start_pos, tol=tol, **kw)


def test_ragged_resumed_and_every_boundary():
    """GQA (Hk=1, Hv=2); lengths 1, 0, 64 and 150 starting at 5, 9, 128 and 37: a one-token
    sequence, an empty one, an exact chunk resumed on a boundary and a sequence resumed mid-chunk
    (a 27-token first chunk, a partial last one); 16 tokens of padding."""
    rng = np.random.default_rng(0)
    lens = [1, 0, 64, 150]
    x, cu, init = make_inputs(rng, lens=lens, T=sum(lens) + 16, Hk=1, Hv=2, dk=64, dv=64)
    check(x, cu, init, jnp.asarray([5, 9, 128, 37], jnp.int32), matmul_dtype=jnp.float32)


def test_wide_heads_strong_gates_and_unit_beta():
    """dk = dv = 128: two programs per head (64 state columns each) and two WGMMA K groups of K Kᵀ.
    Gates up to -1 per token, beta near 1 and keys close to one direction: A's entries near the
    diagonal approach 1, where the UT inverse alternates in sign and a power-series inverse would
    cancel catastrophically; a state is mostly forgotten within a chunk."""
    rng = np.random.default_rng(3)
    T, d = 100, 128
    x, cu, init = make_inputs(rng, lens=[T], T=T, Hk=1, Hv=1, dk=d, dv=d)
    base = rng.normal(size=(1, 1, d)).astype(np.float32)
    x["k"] = x["k"] * 0.3 + jnp.asarray(base)  # every key close to one direction
    x["g"] = -jnp.asarray(rng.uniform(0, 1.0, size=(T, 1)).astype(np.float32))
    x["beta"] = jnp.asarray(rng.uniform(0.9, 1.0, size=(T, 1)).astype(np.float32))
    check(x, cu, init, jnp.asarray([3], jnp.int32), matmul_dtype=jnp.float32, tol=1e-4, recurrent=False)


def test_bf16_activations_and_bf16_operands():
    """The GPU configuration: bf16 q/k/v/beta, fp32 g, bf16 WGMMA operands, o back in bf16."""
    rng = np.random.default_rng(13)
    lens = [50, 80]
    x, cu, init = make_inputs(rng, lens=lens, T=140, Hk=1, Hv=2, dk=64, dv=64, dtype=jnp.bfloat16)
    x["g"] = x["g"].astype(jnp.float32)
    check(x, cu, init, jnp.asarray([14, 64], jnp.int32), tol=BF16_TOL, recurrent=False)


def test_unavailable_snapshot_raises_eagerly():
    rng = np.random.default_rng(17)
    x, cu, init = make_inputs(rng, lens=[80], T=80, Hk=1, Hv=1, dk=64, dv=64)
    with pytest.raises(ValueError, match="not available"):
        gdn_chunk_fused(**x, cu_seqlens=cu, initial_state=init, snapshot_seq=jnp.asarray([0, 0], jnp.int32),
                        snapshot_len=jnp.asarray([64, 30], jnp.int32), matmul_dtype=jnp.float32, interpret=True)


def test_rejects_what_it_cannot_take():
    rng = np.random.default_rng(0)
    x, cu, _ = make_inputs(rng, lens=[10], T=10, Hk=1, Hv=1, dk=32, dv=64)
    with pytest.raises(ValueError, match="dk=32"):
        gdn_chunk_fused(**x, cu_seqlens=cu, interpret=True)
    x, cu, _ = make_inputs(rng, lens=[10], T=10, Hk=1, Hv=1, dk=64, dv=96)
    with pytest.raises(ValueError, match="dv=96"):
        gdn_chunk_fused(**x, cu_seqlens=cu, interpret=True)
    x, cu, _ = make_inputs(rng, lens=[10], T=10, Hk=1, Hv=1, dk=64, dv=64)
    with pytest.raises(ValueError, match="float32"):  # fp32 operands: interpreter only
        gdn_chunk_fused(**x, cu_seqlens=cu, matmul_dtype=jnp.float32)
    with pytest.raises(ValueError, match="gate"):  # KDA's per-channel gate is not this kernel's
        gdn_chunk_fused(**{**x, "g": jnp.zeros((10, 1, 64))}, cu_seqlens=cu, interpret=True)
    with pytest.raises(ValueError, match="chunk_size"):
        gdn_chunk_fused(**x, cu_seqlens=cu, chunk_size=32, interpret=True)
    assert supports(128, 128) and supports(64, 64) and not supports(128, 128, jnp.float32)
    assert supports(128, 128, jnp.float32, interpret=True)  # the interpreter has no SMEM limit
    assert smem_bytes(128, jnp.bfloat16) <= 227 * 1024 < smem_bytes(128, jnp.float32)


def test_lowers_for_cuda_at_model_shapes():
    """The GPU code path (not the interpreter's) through Pallas -> Mosaic GPU lowering for sm_90 at
    Qwen3-Next shapes (dk = dv = 128, 16 key heads, 32 value heads), bf16: layouts, WGMMA operand
    majorness, TMA shapes and the 227 KiB SMEM budget are checked there. Nothing is run."""
    T, Hk, Hv, d = 256, 16, 32, 128
    rng = np.random.default_rng(3)
    x, cu, init = make_inputs(rng, lens=[100, 150], T=T, Hk=Hk, Hv=Hv, dk=d, dv=d, dtype=jnp.bfloat16)
    snap = jnp.zeros(3, jnp.int32)
    f = jax.jit(lambda x, cu, init, start: gdn_chunk_fused(
        **x, cu_seqlens=cu, initial_state=init, start_pos=start, snapshot_seq=snap, snapshot_len=snap))
    text = f.trace(x, cu, init, jnp.asarray([5, 64], jnp.int32)).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text
