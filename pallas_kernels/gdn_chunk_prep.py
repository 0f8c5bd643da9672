"""The GDN chunked prefill's intra-chunk terms (the UT transform) as one Mosaic GPU kernel (sm_90),
parallel over every chunk: the part of ``gdn_chunked.gdn_chunked_pallas`` that XLA runs before
its recurrence kernel (``prep="kernel"``, which then runs the recurrence as
``gdn_chunked._kernel_natural``: the state as stored, no transposes around it).

What it replaces: ``gdn_chunked.chunk_terms`` in XLA on the chunk grid, per (chunk, value head):
the decay cumsum, ``A = strictly-lower(beta K Kᵀ ⊙ decay)``, ``T = (I + A)⁻¹``, ``w = T (beta k
e^G)``, ``u = T (beta v)``, the causal decayed scores ``qk``, ``q e^G`` and ``k e^(G_last - G)``.
On the real-size model's 8,192-token prefill that XLA work was ~120 small kernels a GDN layer and
step, ~63 ms of the prompt's 182 ms of kernel time on an H100 (benchmarks/RESULTS.md, "Serving:
decode"), where the recurrence kernel after it took 9 ms.

The kernel: one program per (chunk ``m``, value head ``h``, 64 columns ``j`` of v), all
independent (a 4,096-token step of Qwen3.5's 32 value heads is 64 x 32 x 2 programs). Each loads
its chunk's q, k (its key head), its 64 columns of v and the chunk's g and beta by TMA and runs the
chunk math of ``gdn_chunk_fused`` (its ``ut_transform``: the same products, the same blocked
inverse, the same roundings), then writes the terms ``_kernel_natural`` reads::

    w   [M, Hv, C, dk]   T (beta k e^G)                 operand dtype
    qd  [M, Hv, C, dk]   q e^G                          operand dtype
    kd  [M, Hv, C, dk]   k e^(G_last - G), token-major  operand dtype
    u   [M, Hv, C, dv]   T (beta v)                     fp32
    qk  [M, Hv, C, C]    causal(q Kᵀ ⊙ e^(G_i - G_j))   operand dtype

Only the ``j = 0`` program of a (chunk, head) writes the four terms that do not depend on v's
columns; every program writes its 64 columns of ``u``. The ``dv / 64`` programs of a head recompute
``A`` and ``T`` (a few 64 x 64 products each: cheap next to the bytes), which keeps every program's
SMEM within one chunk's operands.

Operands: bf16 / f16 on the GPU (``u = T (beta v)`` reads ``beta v`` as an N-major WGMMA operand
and ``_kernel_natural`` reads ``kd`` transposed and ``S`` N-major: the tensor cores take those for
16-bit types only); the interpreter (CPU tests) also takes fp32. Contract as
``gdn_chunk_fused``: ``dk`` in {64, 128}, ``dv % 64 == 0``, chunk 64, a scalar gate per head.

Status: checked on the CPU (GPU interpret mode) against ``chunk_terms`` and, through
``gdn_chunked_pallas(prep="kernel")`` (with ``_kernel_natural``), against the references; both
kernels lower for sm_90 at the model's shapes. Not yet run on a GPU: ``benchmarks/gpu_check.py --suites gdn_prep`` and ``benchmarks/kernels.py
--only gdn_prep`` are the next device call; until they pass, no model path uses it.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.gdn_chunk_fused import BLOCK_DV, CHUNK, ut_transform
from pallas_kernels.gdn_chunk_fused import tiling_problems as fused_tiling_problems
from pallas_kernels.gdn_chunked import _transforms

SMEM_BYTES = 227 * 1024  # per block on sm_90


def _kernel(q_ref, k_ref, v_ref, gb_ref, w_ref, qd_ref, kd_ref, u_ref, qk_ref,
            q_smem, k_smem, v_smem, gb_smem, t_smem, w_smem, qk_smem, bars, *, group, mm_dtype):
    """One (chunk, value head, 64 columns of v): the chunk's terms (module docstring)."""
    m, h, j = (lax.axis_index(axis) for axis in ("m", "h", "j"))
    hk = h // group
    cols = pl.ds(j * BLOCK_DV, BLOCK_DV)

    plgpu.copy_gmem_to_smem(gb_ref.at[m, h], gb_smem, bars.at[0])
    plgpu.copy_gmem_to_smem(q_ref.at[m, hk], q_smem, bars.at[1])
    plgpu.copy_gmem_to_smem(k_ref.at[m, hk], k_smem, bars.at[2])
    plgpu.copy_gmem_to_smem(v_ref.at[m, h, :, cols], v_smem, bars.at[3])

    u, _ = ut_transform(q_smem, k_smem, v_smem, gb_smem, t_smem, w_smem, qk_smem,
                        [bars.at[i] for i in range(4)], mm_dtype, transposed=False)  # w = T (beta k e^G) in w_smem

    def write_u(u_smem):
        u_smem[...] = u
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(u_smem, u_ref.at[m, h, :, cols])

        @pl.when(j == 0)
        def _():
            plgpu.copy_smem_to_gmem(w_smem, w_ref.at[m, h])
            plgpu.copy_smem_to_gmem(q_smem, qd_ref.at[m, h])
            plgpu.copy_smem_to_gmem(k_smem, kd_ref.at[m, h])
            plgpu.copy_smem_to_gmem(qk_smem, qk_ref.at[m, h])

        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    f32 = jnp.float32
    pl.run_scoped(write_u, plgpu.SMEM((CHUNK, BLOCK_DV), f32, transforms=_transforms(f32)))


def smem_bytes(dk: int, matmul_dtype) -> int:
    """q, k, v columns, T, w, qk in the operand dtype; g and beta; one scoped region for the larger of
    the inverse's four fp32 [64, 64] buffers and the fp32 ``uᵀ`` staging."""
    mm = jnp.dtype(matmul_dtype).itemsize
    operands = (3 * CHUNK * dk + CHUNK * BLOCK_DV + 2 * CHUNK * CHUNK) * mm
    return operands + 2 * CHUNK * 4 + max(4 * CHUNK * CHUNK * 4, BLOCK_DV * CHUNK * 4) + 1024


def tiling_problems(dk: int, dv: int, matmul_dtype, interpret: bool) -> list[str]:
    """What the kernel cannot take; empty when it can (``gdn_chunk_fused``'s rules, this SMEM)."""
    return fused_tiling_problems(dk, dv, CHUNK, matmul_dtype, interpret, smem=smem_bytes)


def chunk_terms_kernel(q, k, v, gb, *, matmul_dtype, interpret=False):
    """The terms of every chunk of the grid (module docstring) from ``q, k [M, Hk, C, dk]`` (normalised
    and scaled, in ``matmul_dtype``), ``v [M, Hv, C, dv]`` (``matmul_dtype``) and ``gb [M, Hv, 2, C]``
    fp32 (each chunk's log-decays g and betas). Returns ``(w, qd, kd, u, qk)``."""
    M, Hk, C, dk = q.shape
    Hv, dv = v.shape[1], v.shape[-1]
    mm, f32 = jnp.dtype(matmul_dtype), jnp.float32
    problems = tiling_problems(dk, dv, mm, interpret)
    if problems or C != CHUNK or Hv % Hk:
        raise ValueError("gdn_chunk_prep: " + "; ".join(problems + [f"chunks of {C} (need {CHUNK})"] * (C != CHUNK)
                                                       + [f"Hv={Hv} not a multiple of Hk={Hk}"] * bool(Hv % Hk)))
    scratch = [
        plgpu.SMEM((C, dk), mm, transforms=_transforms(mm)),        # q, then q e^G
        plgpu.SMEM((C, dk), mm, transforms=_transforms(mm)),        # k, then k e^(G_last - G)
        plgpu.SMEM((C, BLOCK_DV), mm, transforms=_transforms(mm)),  # v columns, then beta v
        plgpu.SMEM((2, C), f32),                                    # g, beta
        plgpu.SMEM((C, C), mm, transforms=_transforms(mm)),         # T
        plgpu.SMEM((C, dk), mm, transforms=_transforms(mm)),        # beta k e^G, then w
        plgpu.SMEM((C, C), mm, transforms=_transforms(mm)),         # qk
        plgpu.Barrier(num_barriers=4),
    ]
    call = plgpu.kernel(
        functools.partial(_kernel, group=Hv // Hk, mm_dtype=mm),
        kernel_name="gdn_chunk_prep",
        out_type=(jax.ShapeDtypeStruct((M, Hv, C, dk), mm), jax.ShapeDtypeStruct((M, Hv, C, dk), mm),
                  jax.ShapeDtypeStruct((M, Hv, C, dk), mm), jax.ShapeDtypeStruct((M, Hv, C, dv), f32),
                  jax.ShapeDtypeStruct((M, Hv, C, C), mm)),
        grid=(M, Hv, dv // BLOCK_DV),
        grid_names=("m", "h", "j"),
        scratch_types=scratch,
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane),
        interpret=plgpu.InterpretGPUParams() if interpret else False,
    )
    return call(q, k, v, gb)
