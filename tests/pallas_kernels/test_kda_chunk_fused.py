"""kda_chunk_fused (the whole KDA chunk in one Mosaic GPU kernel, GPU interpret mode on CPU) against
the pure-jnp references.

Between them the cases cover an empty sequence, one-token and exact-chunk sequences, sequences
resumed mid-chunk (``start_pos`` 37), bucket padding past ``cu_seqlens[-1]``, grouped heads, two
state tiles per head, per-channel gates from near 0 down to -10 per token (strong enough that
``e^G_i · e^-G_j`` would overflow within a chunk, so the sub-block reference points are what keeps
the scores finite) and bf16 operands; each starts from random initial states, asks for the state at
EVERY boundary the chunked form can produce and for one it cannot (NaN under ``jit``).
``kda_chunked`` computes the same absolute chunks, so with fp32 operands (the interpreter runs the
WGMMAs as fp32 dots) the kernel must match it to fp32 rounding; ``kda_recurrent`` (token by token)
is checked too. One interpreted call costs 10-30 s on a loaded 2-core machine, so the cases are few
and each covers many edges; the CUDA lowering at Kimi-Linear shapes checks layouts, WGMMA operands
and TMA shapes without a GPU.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.mosaic.gpu import core as mosaic_gpu_core

from pallas_kernels.gdn_chunk_fused import SMEM_BYTES
from pallas_kernels.kda_chunk_fused import kda_chunk_fused, smem_bytes, supports
from pallas_kernels.kda_reference import kda_chunked, kda_recurrent
from tests.pallas_kernels.chunk_checks import check_fused

TOL = 2e-5  # fp32 on both sides
BF16_TOL = 2e-2  # bf16 operands (and bf16 activations): METHOD.md's bf16 band


def make_inputs(rng, *, lens, T, Hk, Hv, dk, dv, max_decay, dtype=np.float32):
    """Random activations; per-channel log-decays uniform in ``[-max_decay, 0]``, except that half of
    the channels of every head get at most 0.03, so some state survives a chunk and the initial state
    and the chunk-to-chunk carry are really tested beside channels that forget within a few tokens."""
    normal = lambda *s: rng.normal(size=s).astype(np.float32)  # noqa: E731
    g = -rng.uniform(0, max_decay, size=(T, Hv, dk)).astype(np.float32)
    g[..., : dk // 2] *= np.float32(0.03 / max(max_decay, 0.03))
    x = dict(q=normal(T, Hk, dk), k=normal(T, Hk, dk), v=normal(T, Hv, dv), g=g,
             beta=rng.uniform(0, 1, size=(T, Hv)).astype(np.float32))
    x = {n: jnp.asarray(a, jnp.float32 if n == "g" else dtype) for n, a in x.items()}
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    assert cu[-1] <= T
    init = normal(len(lens), Hv, dk, dv) * np.float32(0.5)
    return x, jnp.asarray(cu), jnp.asarray(init)


def check(x, cu, init, start_pos, *, tol=TOL, **kw):
    check_fused(kda_chunk_fused, kda_chunked, kda_recurrent, x, cu, init, start_pos, tol=tol, **kw)


# At these gates the score products of rows outside a round's sub-block overflow; the kernel drops
# them by a select (module docstring), and the interpreter's numpy matmul warns.
@pytest.mark.filterwarnings("ignore:overflow encountered in matmul:RuntimeWarning")
def test_ragged_resumed_strong_gates_and_every_boundary():
    """GQA (Hk=1, Hv=2); lengths 1, 0, 64 and 150 starting at 5, 9, 128 and 37: a one-token
    sequence, an empty one, an exact chunk resumed on a boundary and a sequence resumed mid-chunk
    (a 27-token first chunk, a partial last one); 16 tokens of padding. Half the channels decay by
    up to e^-10 per token, one by exactly e^-10 every token (``MIN_LOG_DECAY``, where a sub-block's
    exponents reach 80 of fp32's 88) and the last by e^-25 (Kimi-Linear's gates reach past -10;
    the kernel takes it as -10, the references do not: the results still agree to fp32 rounding,
    where before the clamp they were NaN): a chunk's cumulative log-decay reaches -1600, so
    e^G_i · e^-G_j would overflow many times over."""
    rng = np.random.default_rng(0)
    lens = [1, 0, 64, 150]
    x, cu, init = make_inputs(rng, lens=lens, T=sum(lens) + 16, Hk=1, Hv=2, dk=64, dv=64, max_decay=10.0)
    x["g"] = x["g"].at[..., -2].set(-10.0).at[..., -1].set(-25.0)
    assert float(jnp.min(jnp.sum(x["g"][:64], axis=0))) < -88  # e^-G_j alone would overflow fp32
    check(x, cu, init, jnp.asarray([5, 9, 128, 37], jnp.int32), matmul_dtype=jnp.float32)


def test_wide_heads_two_state_tiles():
    """dk = dv = 128: two programs per head (64 state columns each), two WGMMA K groups per score
    round; moderate gates and beta near 1 (A's entries near the diagonal approach 1)."""
    rng = np.random.default_rng(3)
    T, d = 100, 128
    x, cu, init = make_inputs(rng, lens=[T], T=T, Hk=1, Hv=1, dk=d, dv=d, max_decay=1.0)
    x["beta"] = jnp.asarray(rng.uniform(0.9, 1.0, size=(T, 1)).astype(np.float32))
    check(x, cu, init, jnp.asarray([3], jnp.int32), matmul_dtype=jnp.float32, tol=1e-4, recurrent=False)


def test_bf16_activations_and_bf16_operands():
    """The GPU configuration: bf16 q/k/v/beta, fp32 g (strong), bf16 WGMMA operands, o back in bf16."""
    rng = np.random.default_rng(13)
    lens = [50, 80]
    x, cu, init = make_inputs(rng, lens=lens, T=140, Hk=1, Hv=2, dk=64, dv=64, max_decay=5.0, dtype=jnp.bfloat16)
    check(x, cu, init, jnp.asarray([14, 64], jnp.int32), tol=BF16_TOL, recurrent=False)


def test_rejects_what_it_cannot_take():
    rng = np.random.default_rng(0)
    x, cu, _ = make_inputs(rng, lens=[10], T=10, Hk=1, Hv=1, dk=32, dv=64, max_decay=1.0)
    with pytest.raises(ValueError, match="dk=32"):
        kda_chunk_fused(**x, cu_seqlens=cu, interpret=True)
    x, cu, _ = make_inputs(rng, lens=[10], T=10, Hk=1, Hv=1, dk=64, dv=96, max_decay=1.0)
    with pytest.raises(ValueError, match="dv=96"):
        kda_chunk_fused(**x, cu_seqlens=cu, interpret=True)
    x, cu, _ = make_inputs(rng, lens=[10], T=10, Hk=1, Hv=1, dk=64, dv=64, max_decay=1.0)
    with pytest.raises(ValueError, match="float32"):  # fp32 operands: interpreter only
        kda_chunk_fused(**x, cu_seqlens=cu, matmul_dtype=jnp.float32)
    with pytest.raises(ValueError, match="gate"):  # GDN's per-head gate is not this kernel's
        kda_chunk_fused(**{**x, "g": jnp.zeros((10, 1))}, cu_seqlens=cu, interpret=True)
    with pytest.raises(ValueError, match="chunk_size"):
        kda_chunk_fused(**x, cu_seqlens=cu, chunk_size=32, interpret=True)
    with pytest.raises(ValueError, match="not available"):
        kda_chunk_fused(**x, cu_seqlens=cu, snapshot_seq=jnp.asarray([0], jnp.int32),
                        snapshot_len=jnp.asarray([5], jnp.int32), matmul_dtype=jnp.float32, interpret=True)
    assert supports(128, 128) and supports(64, 64) and not supports(128, 128, jnp.float32)
    assert supports(128, 128, jnp.float32, interpret=True)  # the interpreter has no SMEM limit
    assert not supports(128, 128, jnp.float16)  # the scaled score operands leave float16's range
    assert smem_bytes(128, jnp.bfloat16) <= SMEM_BYTES < smem_bytes(128, jnp.float32)


def test_lowers_for_cuda_at_model_shapes():
    """The GPU code path (not the interpreter's) through Pallas -> Mosaic GPU lowering for sm_90 at
    Kimi-Linear shapes (dk = dv = 128, Hk = Hv = 32), bf16: layouts, WGMMA operand majorness and TMA
    shapes are checked there, and the SMEM the lowering allocates against ``smem_bytes`` (itself
    within 227 KiB). Nothing is run."""
    T, H, d = 256, 32, 128
    rng = np.random.default_rng(3)
    x, cu, init = make_inputs(rng, lens=[100, 150], T=T, Hk=H, Hv=H, dk=d, dv=d, max_decay=1.0,
                              dtype=jnp.bfloat16)
    snap = jnp.zeros(3, jnp.int32)
    f = jax.jit(lambda x, cu, init, start: kda_chunk_fused(
        **x, cu_seqlens=cu, initial_state=init, start_pos=start, snapshot_seq=snap, snapshot_len=snap))
    with mosaic_gpu_core.artificial_shared_memory_limit(smem_bytes(d, jnp.bfloat16)):
        lowered = f.trace(x, cu, init, jnp.asarray([5, 64], jnp.int32)).lower(lowering_platforms=("cuda",))
    text = lowered.as_text()
    assert "mosaic_gpu" in text
