"""GPU correctness check for the Pallas kernels at model shapes (run on the device, not in CI).

    python benchmarks/gpu_check.py [--out DIR]

For each case: fresh random inputs, a state pool larger than the batch with the batch's rows at
random distinct slots (plus null-slot padding rows), the kernel run once, and the result compared
with (a) a float64 NumPy evaluation of the same step on the host (the oracle, METHOD.md tolerances:
fp32 arithmetic far under 1e-3; outputs rounded to bf16 between 1e-3 and 1e-2; NaN never passes),
(b) the pure-jnp references ``gdn_recurrent`` / ``kda_recurrent`` run on the GPU. Slots the batch
does not name must come back bit-identical; the same call repeated must give bit-identical
results (a moving result is a race). Exit status 1 if any case fails. The ragged prefill suites
(``chunked``, ``conv1d``) check every output and state against a float64 oracle on a subset of
heads / channels and against the jnp reference on the GPU, and padding tokens must give zeros;
``gdn_fused`` and ``kda_fused`` (asked for by name) check ``pallas_kernels/gdn_chunk_fused.py`` and
``kda_chunk_fused.py`` the same way with bf16 operands, gates strong enough to stress the on-chip UT
inverse (and, for KDA, the per-channel decay's range) included; ``gdn_prep`` (by name) the GDN prefill
with its intra-chunk terms by ``pallas_kernels/gdn_chunk_prep.py``, at the same cases.
The ``linear`` suite checks ``pallas_kernels/linear_small.py`` (decode-step dense projections) at the
target model's weight shapes and 1 to 64 rows. The ``moe`` suite checks the routed experts
(``pallas_kernels/moe.py``: the 64-row grouped kernel, the swap-AB small path at decode token counts,
the gather path) at decode and prefill token counts against a float64 oracle on up to 64
tokens and against ``layers.routed_experts`` (``lax.ragged_dot``) on the GPU, and reports the max
absolute error beside the relative ones.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from pallas_kernels.gdn_decode import gdn_decode  # noqa: E402
from pallas_kernels.gdn_reference import gdn_recurrent  # noqa: E402
from pallas_kernels.kda_reference import kda_recurrent  # noqa: E402
from pallas_kernels.paged_attention import attention_np, paged_attention, random_paged_batch  # noqa: E402

# Qwen3-Next / Qwen3.5 GDN layers and Kimi-Linear KDA layers (transformers' config defaults).
MODELS = {"gdn": dict(Hk=16, Hv=32, dk=128, dv=128), "kda": dict(Hk=32, Hv=32, dk=128, dv=128)}
# Kernel variants checked: the one-block-per-tile kernel and the persistent pipelined one, with the
# settings benchmarks/kernels.py times. kernels.py only reports variants whose checks all passed.
VARIANTS = {"simple": dict(persistent=False),
            "persistent": dict(persistent=True, stages=3, block_dv=64, blocks_per_sm=2)}
ORACLE_ROWS = 64  # rows checked against float64 at large batch (rows are independent)
STATE_TOL = 1e-4  # fp32 state vs float64
O_TOL = {jnp.float32: 1e-4, jnp.bfloat16: 1e-2}


def decode_inputs(rng, *, kind, B, dtype, extra_slots=8, null_rows=0):
    m = MODELS[kind]
    Hk, Hv, dk, dv = m["Hk"], m["Hv"], m["dk"], m["dv"]
    normal = lambda *s: rng.standard_normal(size=s, dtype=np.float32)  # noqa: E731
    g_shape = (B, Hv, dk) if kind == "kda" else (B, Hv)
    x = dict(q=normal(B, Hk, dk), k=normal(B, Hk, dk), v=normal(B, Hv, dv),
             g=-rng.uniform(0, 1, size=g_shape).astype(np.float32),
             beta=rng.uniform(0, 1, size=(B, Hv)).astype(np.float32))
    # round activations to the model dtype once, so every side sees the same values
    x = {n: np.asarray(jnp.asarray(a, dtype).astype(jnp.float32)) for n, a in x.items()}
    num_slots = B + extra_slots + 1
    pool = normal(num_slots, Hv, dk, dv) * np.float32(0.5)
    slots = (rng.permutation(num_slots - 1)[:B] + 1).astype(np.int32)
    if null_rows:
        slots[-null_rows:] = 0
    return x, pool, slots


def oracle64(x, pool, slots):
    """One step in float64 on the host, for every row (padding rows too: their state is garbage)."""
    q, k, v, g, beta = (np.asarray(x[n], np.float64) for n in ("q", "k", "v", "g", "beta"))
    l2 = lambda a: a / np.sqrt((a * a).sum(-1, keepdims=True) + 1e-6)  # noqa: E731
    q, k = l2(q), l2(k)
    q = q * q.shape[-1] ** -0.5
    group = v.shape[1] // k.shape[1]
    q, k = np.repeat(q, group, axis=1), np.repeat(k, group, axis=1)
    s = pool[slots].astype(np.float64)
    s *= np.exp(g)[..., None] if g.ndim == 3 else np.exp(g)[..., None, None]
    delta = beta[..., None] * (v - np.einsum("bhk,bhkv->bhv", k, s))
    s += k[..., None] * delta[..., None, :]
    return np.einsum("bhk,bhkv->bhv", q, s), s


def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-300))


def check_decode(kind, B, dtype, seed, interpret=False, variant="simple", jnp_check=True):
    rng = np.random.default_rng(seed)
    null_rows = 3 if B >= 64 else 0
    x, pool, slots = decode_inputs(rng, kind=kind, B=B, dtype=dtype, null_rows=null_rows)
    real = np.arange(B - null_rows)
    xd = {n: jnp.asarray(a, dtype) for n, a in x.items()}
    run = lambda: gdn_decode(**xd, state_pool=jnp.asarray(pool), slots=jnp.asarray(slots),  # noqa: E731
                             interpret=interpret, **VARIANTS[variant])
    t0 = time.perf_counter()
    o, new_pool = run()
    o, new_pool = np.asarray(o.astype(jnp.float32)), np.asarray(new_pool)
    compile_run_s = time.perf_counter() - t0
    o2, new_pool2 = run()
    # padding rows race on the null slot by contract: determinism is asked of real rows and slots >= 1
    deterministic = bool(np.array_equal(np.asarray(o2.astype(jnp.float32))[real], o[real])
                         and np.array_equal(np.asarray(new_pool2)[1:], new_pool[1:]))
    named = slots[real]
    untouched = np.setdiff1d(np.arange(1, pool.shape[0]), named)
    sub = real if len(real) <= ORACLE_ROWS else np.sort(rng.choice(real, ORACLE_ROWS, replace=False))
    o64, s64 = oracle64({n: a[sub] for n, a in x.items()}, pool, slots[sub])
    res = dict(
        kernel=f"{kind}_decode", variant=variant, B=B, dtype=jnp.dtype(dtype).name, seed=seed,
        oracle_rows=len(sub),
        o_rel_err=rel(o[sub], o64), state_rel_err=rel(new_pool[slots[sub]], s64),
        finite=bool(np.isfinite(o[real]).all() and np.isfinite(new_pool[1:]).all()),
        untouched_identical=bool(np.array_equal(new_pool[untouched], pool[untouched])),
        deterministic=deterministic, first_call_s=round(compile_run_s, 2),
    )
    o_tol = O_TOL[dtype]
    ok = (res["finite"] and res["untouched_identical"] and res["deterministic"]
          and res["o_rel_err"] < o_tol and res["state_rel_err"] < STATE_TOL)
    if jnp_check:  # the pure-jnp reference on the GPU (recurrent form, one token per sequence)
        fn = kda_recurrent if kind == "kda" else gdn_recurrent
        o_jnp, s_jnp, _ = jax.jit(fn)(xd["q"], xd["k"], xd["v"], xd["g"], xd["beta"],
                                      cu_seqlens=jnp.arange(B + 1, dtype=jnp.int32),
                                      initial_state=jnp.asarray(pool)[slots])
        o_jnp = np.asarray(o_jnp.astype(jnp.float32))
        res.update(o_rel_err_vs_jnp=rel(o[real], o_jnp[real]),
                   state_rel_err_vs_jnp=rel(new_pool[named], np.asarray(s_jnp)[real]))
        ok = ok and res["o_rel_err_vs_jnp"] < o_tol and res["state_rel_err_vs_jnp"] < STATE_TOL
    res["ok"] = bool(ok)
    return res


# Paged attention (pallas_kernels/paged_attention.py) at Qwen3.5-like full-attention shapes: 16 q
# heads, 2 kv heads (GQA 8), head_dim 256, bf16. Cases: (name, batch, context range, new tokens
# per row, page size, num_splits (None: the kernel's default)). Each row's length is random in the
# range, with edges: one row ends exactly on a 64 boundary, one on a page boundary.
PA_MODEL = dict(nh=16, nkv=2, hd=256)
PA_CASES = [
    ("decode", 64, (3000, 4096), 1, 16, None),
    ("decode", 64, (3000, 4096), 1, 64, None),
    ("decode", 1, (32768, 32768), 1, 16, None),
    ("decode", 1, (30000, 32768), 1, 64, None),
    ("decode", 1, (32768, 32768), 1, 16, 1),  # no split: the split-K merge against the plain path
    ("extend", 4, (0, 4096), 200, 16, None),
]
PA_ORACLE_TOKENS = 64  # tokens checked against float64 (tokens are independent)
PA_TOL = 1e-2  # bf16 operands and output (METHOD.md: bf16 lands between 1e-3 and 1e-2)


def check_paged_attention(name, B, ctx_range, new, page_size, num_splits, seed, interpret=False):
    from jaxserve.models.layers import Ragged
    from jaxserve.models.layers import paged_attention as paged_attention_jnp

    rng = np.random.default_rng(seed)
    m = dict(nh=4, nkv=1, hd=128) if interpret else PA_MODEL
    lo, hi = ctx_range
    total = rng.integers(lo, hi + 1, B)
    if B >= 4:
        total[0], total[1] = hi // 64 * 64, hi // 64 * 64 - 64 + page_size  # 64 boundary, page boundary
    if name == "extend":  # rows of new tokens: a prefill from 0, chunks over context, a decode row
        new_b = [new, new // 2 + 7, new + 13, 1][:B] + [new] * max(0, B - 4)
        ctx = [0] + [max(0, int(t) - n) for t, n in zip(total[1:], new_b[1:])]
    else:
        new_b = [new] * B
        ctx = [int(t) - new for t in total]
    x, ragged = random_paged_batch(rng, ctx, new_b, page_size=page_size, layers=2, pad_tokens=3, **m)
    x = {n: np.asarray(jnp.asarray(a, jnp.bfloat16).astype(jnp.float32)) for n, a in x.items()}  # round once
    z = jnp.zeros(1, jnp.int32)
    r = Ragged(**{n: jnp.asarray(a) for n, a in ragged.items()}, read_slot=z, write_slot=z, snap_seq=z,
               snap_len=z, snap_dst=z)
    xd = {n: jnp.asarray(a, jnp.bfloat16) for n, a in x.items()}
    args = (xd["q"], xd["k"], xd["v"], xd["k_pool"], xd["v_pool"])
    kernel = jax.jit(lambda q, k, v, kp, vp, r: paged_attention(
        q, k, v, kp, vp, 1, r, None, num_splits=num_splits, decode=name == "decode", interpret=interpret))
    t0 = time.perf_counter()
    o, kp, vp = jax.block_until_ready(kernel(*args, r))
    first_call_s = time.perf_counter() - t0
    o2, _, _ = kernel(*args, r)
    real = np.flatnonzero(ragged["seq"] < B)
    o, o2 = np.asarray(o.astype(jnp.float32)), np.asarray(o2.astype(jnp.float32))
    o_jnp, kp_jnp, vp_jnp = jax.jit(lambda q, k, v, kp, vp, r: paged_attention_jnp(q, k, v, kp, vp, 1, r, None))(
        *args, r)
    o_jnp = np.asarray(o_jnp.astype(jnp.float32))
    # Page 0 is the null page: every padding token writes there (same page, same offset), and on
    # the GPU which of those duplicate scatter writes lands is unspecified, so it differs run to run.
    pools_identical = bool(np.array_equal(np.asarray(kp[:, 1:]), np.asarray(kp_jnp[:, 1:]))
                           and np.array_equal(np.asarray(vp[:, 1:]), np.asarray(vp_jnp[:, 1:])))
    del kp_jnp, vp_jnp
    sub = real if len(real) <= PA_ORACLE_TOKENS else np.sort(rng.choice(real, PA_ORACLE_TOKENS, replace=False))
    kp32, vp32 = (np.asarray(a[1].astype(jnp.float32)) for a in (kp, vp))  # layer 1 only
    o64 = attention_np(x["q"], kp32[None], vp32[None], 0, ragged, tokens=sub)
    res = dict(kernel=f"paged_attn_{name}", variant="paged", B=B, dtype="bfloat16", seed=seed,
               shape=f"nh={m['nh']} nkv={m['nkv']} hd={m['hd']} page={page_size} ctx={lo}..{hi} new={new}",
               num_splits=num_splits, tokens=len(real), oracle_tokens=len(sub),
               o_rel_err=rel(o[sub], o64), o_rel_err_vs_jnp=rel(o[real], o_jnp[real]),
               state_rel_err=0.0 if pools_identical else 1.0, pools_identical_to_jnp=pools_identical,
               finite=bool(np.isfinite(o).all()), padding_zero=bool((o[len(real):] == 0).all()),
               deterministic=bool(np.array_equal(o, o2)), first_call_s=round(first_call_s, 2))
    res["ok"] = bool(res["finite"] and res["deterministic"] and pools_identical and res["padding_zero"]
                     and res["o_rel_err"] < PA_TOL and res["o_rel_err_vs_jnp"] < PA_TOL)
    return res


def paged_attention_checks(interpret=False):
    """Every PA_CASES case, one record each; a case that raises is recorded as an error."""
    cases = PA_CASES
    if interpret:  # CPU smoke run: tiny contexts
        cases = [("decode", 2, (60, 200), 1, 16, 2), ("extend", 2, (60, 200), 40, 16, None)]
    for seed, (name, B, ctx_range, new, ps, splits) in enumerate(cases, 101):
        try:
            r = check_paged_attention(name, B, ctx_range, new, ps, splits, seed, interpret)
        except Exception as e:  # keep going: one broken case must not hide the others
            r = dict(kernel=f"paged_attn_{name}", variant="paged", B=B, dtype="bfloat16", ok=False,
                     shape=f"page={ps} ctx={ctx_range} new={new} splits={splits}",
                     error=f"{type(e).__name__}: {str(e)[:2000]}")
        yield r


# Chunked prefill (pallas_kernels/gdn_chunked.py: jnp UT transform + Mosaic GPU chunk recurrence) at
# model shapes, ~8k tokens. Cases: (kind, ragged, activation dtype, WGMMA operand dtype). Ragged
# batches have an empty sequence, random start positions (not multiples of 64) and bucket padding;
# every boundary the chunked form can produce is requested as a snapshot. The float64 oracle runs
# token by token on the host over CH_ORACLE_HEADS value heads (heads are independent).
CH_CASES = [  # (kind, ragged, activation dtype, WGMMA operand dtype, intra-chunk prep precision)
    ("gdn", True, jnp.bfloat16, jnp.float32, "highest"),
    ("gdn", True, jnp.bfloat16, jnp.bfloat16, "highest"),
    ("kda", True, jnp.bfloat16, jnp.float32, "highest"),
    ("gdn", False, jnp.float32, jnp.float32, "highest"),
    # the TF32-prep experiment (gdn_chunked_pallas prep_precision="default"), same tolerances
    ("gdn", True, jnp.bfloat16, jnp.float32, "default"),
    ("gdn", True, jnp.bfloat16, jnp.bfloat16, "default"),
    ("kda", True, jnp.bfloat16, jnp.float32, "default"),
]
CH_TOKENS = 8192
CH_ORACLE_HEADS = 4
# fp32 WGMMA operands run as tf32 (METHOD.md: near 3e-4 per product; the recurrence compounds a
# little); bf16 operands between 1e-3 and 1e-2. o in bf16 adds its own rounding (~4e-3).
CH_STATE_TOL = {jnp.float32: 2e-3, jnp.bfloat16: 2e-2}
CH_O_TOL = {jnp.float32: 2e-3, jnp.bfloat16: 2e-2}


def chunked_inputs(rng, *, kind, T, ragged, dtype, interpret=False):
    m = dict(Hk=1, Hv=2, dk=64, dv=64) if interpret else MODELS[kind]
    Hk, Hv, dk, dv = m["Hk"], m["Hv"], m["dk"], m["dv"]
    if ragged:  # 9 sequences, one empty, 37 tokens of bucket padding
        cuts = np.sort(rng.choice(np.arange(1, T - 37), 7, replace=False))
        lens = np.diff(np.concatenate([[0], cuts, [T - 37]])).tolist()
        lens.insert(3, 0)
        start = rng.integers(0, 5000, len(lens))
    else:
        lens, start = [T], np.array([100])
    normal = lambda *s: rng.standard_normal(size=s, dtype=np.float32)  # noqa: E731
    g_shape = (T, Hv, dk) if kind == "kda" else (T, Hv)
    x = dict(q=normal(T, Hk, dk), k=normal(T, Hk, dk), v=normal(T, Hv, dv),
             g=-rng.uniform(0, 0.03, size=g_shape).astype(np.float32),  # a state survives a chunk
             beta=rng.uniform(0, 1, size=(T, Hv)).astype(np.float32))
    x = {n: np.asarray(jnp.asarray(a, dtype).astype(jnp.float32)) for n, a in x.items()}  # round once
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    init = normal(len(lens), Hv, dk, dv) * np.float32(0.5)
    snap_seq, snap_len = [], []
    for n, (L, s0) in enumerate(zip(lens, start)):
        for t in range(L + 1):
            if t in (0, L) or (s0 + t) % 64 == 0:
                snap_seq.append(n)
                snap_len.append(t)
    return x, cu, init, start.astype(np.int32), np.array(snap_seq, np.int32), np.array(snap_len, np.int32)


def chunked_oracle64(x, cu, init, snap_seq, snap_len, heads):
    """Token-by-token delta rule in float64 on the value heads ``heads``: (o [T, len(heads), dv],
    finals [N, len(heads), dk, dv], snapshots [S, len(heads), dk, dv])."""
    q, k, v, g, beta = (np.asarray(x[n], np.float64) for n in ("q", "k", "v", "g", "beta"))
    l2 = lambda a: a / np.sqrt((a * a).sum(-1, keepdims=True) + 1e-6)  # noqa: E731
    group = v.shape[1] // k.shape[1]
    q, k = l2(q)[:, heads // group] * q.shape[-1] ** -0.5, l2(k)[:, heads // group]
    v, beta = v[:, heads], beta[:, heads]
    g = g[:, heads] if g.ndim == 3 else g[:, heads][..., None]
    o = np.zeros(v.shape)
    finals = np.zeros((len(cu) - 1, len(heads), q.shape[-1], v.shape[-1]))
    snaps = np.zeros((len(snap_seq), *finals.shape[1:]))
    for n in range(len(cu) - 1):
        s = np.asarray(init[n][heads], np.float64)
        want = {int(t): np.flatnonzero((snap_seq == n) & (snap_len == t)) for t in snap_len[snap_seq == n]}
        for t in range(cu[n], cu[n + 1] + 1):
            if t - cu[n] in want:
                snaps[want[t - cu[n]]] = s
            if t == cu[n + 1]:
                break
            s = np.exp(g[t])[..., None] * s
            delta = beta[t][:, None] * (v[t] - np.einsum("hk,hkv->hv", k[t], s))
            s = s + k[t][..., None] * delta[:, None, :]
            o[t] = np.einsum("hk,hkv->hv", q[t], s)
        finals[n] = s
    return o, finals, snaps


def chunked_variant(mm_dtype, prep):
    return f"chunked_{jnp.dtype(mm_dtype).name}mm" + ("" if prep == "highest" else f"_{prep}prep")


def check_chunked(kind, ragged, dtype, mm_dtype, prep, seed, interpret=False):
    from pallas_kernels.gdn_chunked import gdn_chunked_pallas
    from pallas_kernels.gdn_reference import gdn_chunked
    from pallas_kernels.kda_reference import kda_chunked

    rng = np.random.default_rng(seed)
    T = 300 if interpret else CH_TOKENS
    x, cu, init, start, snap_seq, snap_len = chunked_inputs(rng, kind=kind, T=T, ragged=ragged, dtype=dtype,
                                                            interpret=interpret)
    kernel = lambda x, idx: gdn_chunked_pallas(**x, **idx, matmul_dtype=mm_dtype, prep_precision=prep,  # noqa: E731
                                               interpret=interpret)
    ref = kda_chunked if kind == "kda" else gdn_chunked
    mm, dt = jnp.dtype(mm_dtype).type, jnp.dtype(dtype).type
    res = dict(kernel=f"{kind}_chunked", variant=chunked_variant(mm_dtype, prep), B=len(cu) - 1,
               dtype=jnp.dtype(dtype).name, seed=seed, tokens=int(cu[-1]), T=T, ragged=ragged,
               **compare_prefill(kernel, ref, rng, x, dtype, cu, init, start, snap_seq, snap_len))
    return with_verdict(res, max(CH_O_TOL[mm], CH_O_TOL[dt]), CH_STATE_TOL[mm])


def compare_prefill(kernel, reference, rng, x, dtype, cu, init, start, snap_seq, snap_len):
    """A chunked prefill ``kernel`` ``(inputs, indices) -> (o, final, snapshots)`` against the float64
    oracle (on a few random heads) and the jnp ``reference``: the measurements of a ragged prefill
    record (``with_verdict``'s inputs among them). The kernel runs twice under ``jit``: the first
    call's time, then the second must give bit-identical results."""
    xd = {n: jnp.asarray(a, dtype) for n, a in x.items()}
    idx = dict(cu_seqlens=jnp.asarray(cu), initial_state=jnp.asarray(init), start_pos=jnp.asarray(start),
               snapshot_seq=jnp.asarray(snap_seq), snapshot_len=jnp.asarray(snap_len))
    kernel = jax.jit(kernel)
    t0 = time.perf_counter()
    o, fin, snaps = jax.block_until_ready(kernel(xd, idx))
    first_call_s = time.perf_counter() - t0
    o2, fin2, snaps2 = kernel(xd, idx)
    deterministic = bool(np.array_equal(np.asarray(o2.astype(jnp.float32)), np.asarray(o.astype(jnp.float32)))
                         and np.array_equal(np.asarray(fin2), np.asarray(fin))
                         and np.array_equal(np.asarray(snaps2), np.asarray(snaps)))
    o, fin, snaps = np.asarray(o.astype(jnp.float32)), np.asarray(fin), np.asarray(snaps)
    o_j, fin_j, snaps_j = jax.jit(lambda x, idx: reference(**x, **idx))(xd, idx)
    o_j, fin_j, snaps_j = np.asarray(o_j.astype(jnp.float32)), np.asarray(fin_j), np.asarray(snaps_j)
    Hv = x["v"].shape[1]
    heads = np.sort(rng.choice(Hv, min(CH_ORACLE_HEADS, Hv), replace=False))
    o64, fin64, snaps64 = chunked_oracle64(x, cu, init, snap_seq, snap_len, heads)
    n_real = int(cu[-1])
    return dict(snapshots=len(snap_seq), oracle_heads=heads.tolist(),
                o_rel_err=rel(o[:n_real, heads], o64[:n_real]),
                state_rel_err=rel(np.concatenate([fin[:, heads], snaps[:, heads]]), np.concatenate([fin64, snaps64])),
                o_rel_err_vs_jnp=rel(o[:n_real], o_j[:n_real]),
                state_rel_err_vs_jnp=rel(np.concatenate([fin, snaps]), np.concatenate([fin_j, snaps_j])),
                jnp_o_rel_err=rel(o_j[:n_real, heads], o64[:n_real]),
                finite=bool(np.isfinite(o).all() and np.isfinite(fin).all() and np.isfinite(snaps).all()),
                padding_zero=bool((o[n_real:] == 0).all()), deterministic=deterministic,
                first_call_s=round(first_call_s, 2))


def with_verdict(res, o_tol, state_tol):
    """``res`` of a ragged prefill check with ``ok``: finite, zero on padding, deterministic, and
    outputs and states within tolerance of both the float64 oracle and the jnp reference."""
    res["ok"] = bool(res["finite"] and res["padding_zero"] and res["deterministic"]
                     and res["o_rel_err"] < o_tol and res["state_rel_err"] < state_tol
                     and res["o_rel_err_vs_jnp"] < o_tol and res["state_rel_err_vs_jnp"] < state_tol)
    return res


def chunked_checks(interpret=False):
    """Every CH_CASES case, one record each; a case that raises is recorded as an error."""
    cases = CH_CASES[:1] + CH_CASES[2:3] if interpret else CH_CASES
    for seed, (kind, ragged, dtype, mm_dtype, prep) in enumerate(cases, 201):
        try:
            r = check_chunked(kind, ragged, dtype, mm_dtype, prep, seed, interpret)
        except Exception as e:  # keep going: one broken case must not hide the others
            r = dict(kernel=f"{kind}_chunked", variant=chunked_variant(mm_dtype, prep), B=-1,
                     dtype=jnp.dtype(dtype).name, ok=False, ragged=ragged,
                     error=f"{type(e).__name__}: {str(e)[:2000]}")
        yield r


# GDN / KDA chunked prefill as one kernel (pallas_kernels/gdn_chunk_fused.py, kda_chunk_fused.py: the
# UT transform on chip), at the chunked suite's shapes and checks. Cases: (ragged, largest per-token
# log-decay). GDN gates up to 1 per token (the benchmark's) make the chunk's UT inverse far from the
# identity: the regime where its tf32 block merges on the GPU could lose accuracy. KDA's per-channel
# gates up to 5 per token put a chunk's cumulative log-decay far past fp32's exponent range: the
# regime its sub-block reference points are for. bf16 activations and operands (the GPU path).
# ``gdn_prep``: the split GDN prefill with its intra-chunk terms by pallas_kernels/gdn_chunk_prep.py
# (gdn_chunked_pallas prep="kernel", bf16 operands), at the same cases.
FUSED_CASES = {"gdn": [(True, 0.03), (False, 0.03), (True, 1.0)],
               "kda": [(True, 0.03), (False, 0.03), (True, 5.0)],
               "gdn_prep": [(True, 0.03), (False, 0.03), (True, 1.0)]}
FUSED_SEEDS = {"gdn": 251, "kda": 271, "gdn_prep": 291}
FUSED_NAMES = {"gdn": "gdn_chunk_fused", "kda": "kda_chunk_fused", "gdn_prep": "gdn_chunk_prep"}


def fused_kernel(kind):
    """(kernel, jnp chunked reference) of the one-kernel prefill of ``kind`` (``gdn_prep``: the split
    prefill with the prep kernel)."""
    if kind == "gdn_prep":
        import functools

        from pallas_kernels.gdn_chunked import gdn_chunked_pallas
        from pallas_kernels.gdn_reference import gdn_chunked
        return functools.partial(gdn_chunked_pallas, prep="kernel", matmul_dtype=jnp.bfloat16), gdn_chunked
    if kind == "gdn":
        from pallas_kernels.gdn_chunk_fused import gdn_chunk_fused
        from pallas_kernels.gdn_reference import gdn_chunked
        return gdn_chunk_fused, gdn_chunked
    from pallas_kernels.kda_chunk_fused import kda_chunk_fused
    from pallas_kernels.kda_reference import kda_chunked
    return kda_chunk_fused, kda_chunked


def check_fused(kind, ragged, gate, seed, interpret=False):
    fused, chunked = fused_kernel(kind)
    rng = np.random.default_rng(seed)
    T, dtype = (300 if interpret else CH_TOKENS), jnp.bfloat16
    x, cu, init, start, snap_seq, snap_len = chunked_inputs(rng, kind=kind.removesuffix("_prep"), T=T, ragged=ragged,
                                                            dtype=dtype, interpret=interpret)
    x["g"] = np.asarray(jnp.asarray(-rng.uniform(0, gate, size=x["g"].shape), dtype).astype(jnp.float32))
    kernel = lambda x, idx: fused(**x, **idx, interpret=interpret)  # noqa: E731
    res = dict(kernel=FUSED_NAMES[kind], variant=f"{kind}_fused_bf16mm", B=len(cu) - 1, dtype="bfloat16", seed=seed,
               tokens=int(cu[-1]), T=T, ragged=ragged, max_gate=gate,
               **compare_prefill(kernel, chunked, rng, x, dtype, cu, init, start, snap_seq, snap_len))
    return with_verdict(res, CH_O_TOL[jnp.bfloat16], CH_STATE_TOL[jnp.bfloat16])


def fused_checks(kind, interpret=False):
    """Every ``FUSED_CASES[kind]`` case, one record each; a case that raises is recorded as an error."""
    cases = FUSED_CASES[kind][:1] if interpret else FUSED_CASES[kind]
    for seed, (ragged, gate) in enumerate(cases, FUSED_SEEDS[kind]):
        try:
            r = check_fused(kind, ragged, gate, seed, interpret)
        except Exception as e:  # keep going: one broken case must not hide the others
            r = dict(kernel=FUSED_NAMES[kind], variant=f"{kind}_fused_bf16mm", B=-1, dtype="bfloat16",
                     ok=False, ragged=ragged, max_gate=gate, error=f"{type(e).__name__}: {str(e)[:2000]}")
        yield r


# ------------------------------------------------------------------------------------------------
# conv1d (pallas_kernels/conv1d.py): the GDN short conv, prefill over ragged sequences and the
# decode update, at the Qwen3-Next conv dim (2 * 16 * 128 + 32 * 128 = 8192), K = 4.
# ------------------------------------------------------------------------------------------------

CONV_C, CONV_K = 8192, 4
CONV_ORACLE_CHANNELS = 512  # channels checked against float64 (channels are independent)
# (kind, tokens or batch, ragged, dtype): prefill single / ragged (short sequences, an empty one,
# padding) at 8k and 64k tokens; the update at the engine's batches.
CONV_CASES = [("prefill", 8192, False, jnp.bfloat16), ("prefill", 8192, True, jnp.bfloat16),
              ("prefill", 65536, True, jnp.bfloat16), ("prefill", 8192, True, jnp.float32),
              ("update", 64, False, jnp.bfloat16), ("update", 512, False, jnp.bfloat16),
              ("update", 64, False, jnp.float32)]


def conv1d_oracle64(x, w, b, cu, init, snap_seq, snap_len):
    """The conv in float64 per sequence on the host: (y [T, C], finals [N, C, K-1], snaps [S, C, K-1])."""
    x, w, b, init = (np.asarray(a, np.float64) for a in (x, w, b, init))
    km1 = w.shape[1] - 1
    y = np.zeros_like(x)
    finals = np.zeros_like(init)
    snaps = np.zeros((len(snap_seq), *init.shape[1:]))
    for n in range(len(cu) - 1):
        full = np.concatenate([init[n].T, x[cu[n]:cu[n + 1]]])  # [K-1 + L, C]: the virtual sequence
        L = cu[n + 1] - cu[n]
        pre = sum(w[:, j] * full[j:j + L] for j in range(km1 + 1)) + b
        y[cu[n]:cu[n + 1]] = pre / (1 + np.exp(-pre))
        finals[n] = full[L:L + km1].T
        for s in np.flatnonzero(snap_seq == n):
            snaps[s] = full[snap_len[s]:snap_len[s] + km1].T
    return y, finals, snaps


def conv1d_inputs(rng, kind, size, ragged, C):
    normal = lambda *s: rng.standard_normal(size=s, dtype=np.float32)  # noqa: E731
    if kind == "update":
        lens = [1] * size
    elif ragged:  # 12 sequences: one empty, three shorter than the window, 29 tokens of padding
        cuts = np.sort(rng.choice(np.arange(1, size - 100), 7, replace=False))
        lens = np.diff(np.concatenate([[0], cuts, [size - 29 - 6]])).tolist()
        lens[3:3] = [0, 1, 2, 3]
    else:
        lens = [size]
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    T = size if kind == "prefill" else len(lens)
    snap_seq = np.repeat(np.arange(len(lens)), 3)[:64].astype(np.int32)
    snap_len = np.array([[0, L, rng.integers(0, L + 1)][i % 3] for i, L in enumerate(np.asarray(lens)[snap_seq])],
                        np.int32)
    return (normal(T, C), normal(C, CONV_K) * np.float32(0.5), normal(C), cu, normal(len(lens), C, CONV_K - 1),
            snap_seq, snap_len)


def check_conv1d(kind, size, ragged, dtype, seed, interpret=False):
    from pallas_kernels import conv1d
    from pallas_kernels.conv1d_reference import causal_conv1d_prefill, causal_conv1d_update

    rng = np.random.default_rng(seed)
    C = 256 if interpret else CONV_C
    size = min(size, 200) if interpret else size
    x, w, b, cu, init, snap_seq, snap_len = conv1d_inputs(rng, kind, size, ragged, C)
    x = np.asarray(jnp.asarray(x, dtype).astype(jnp.float32))  # round once: every side sees the same x
    xd, wd, bd, initd = jnp.asarray(x, dtype), jnp.asarray(w), jnp.asarray(b), jnp.asarray(init)
    if kind == "prefill":
        idx = dict(cu_seqlens=jnp.asarray(cu), initial_state=initd, snapshot_seq=jnp.asarray(snap_seq),
                   snapshot_len=jnp.asarray(snap_len))
        kernel = jax.jit(lambda x: conv1d.causal_conv1d_prefill_pallas(x, wd, bd, **idx, interpret=interpret))
        reference = jax.jit(lambda x: causal_conv1d_prefill(x, wd, bd, **idx))
    else:
        snap_seq = snap_len = np.zeros(0, np.int32)
        kernel = jax.jit(lambda x: (*conv1d.causal_conv1d_update_pallas(x, initd, wd, bd, interpret=interpret),
                                    jnp.zeros((0, C, CONV_K - 1))))
        reference = jax.jit(lambda x: (*causal_conv1d_update(x, initd, wd, bd), jnp.zeros((0, C, CONV_K - 1))))
    t0 = time.perf_counter()
    y, fin, snaps = (np.asarray(a.astype(jnp.float32)) for a in kernel(xd))
    first_call_s = time.perf_counter() - t0
    y2, fin2, snaps2 = (np.asarray(a.astype(jnp.float32)) for a in kernel(xd))
    deterministic = bool(np.array_equal(y, y2) and np.array_equal(fin, fin2) and np.array_equal(snaps, snaps2))
    y_j, fin_j, snaps_j = (np.asarray(a.astype(jnp.float32)) for a in reference(xd))
    ch = np.sort(rng.choice(C, min(CONV_ORACLE_CHANNELS, C), replace=False))
    y64, fin64, snaps64 = conv1d_oracle64(x[:, ch], w[ch], b[ch], cu, init[:, ch], snap_seq, snap_len)
    n_real = int(cu[-1])
    states, states_j = np.concatenate([fin, snaps]), np.concatenate([fin_j, snaps_j])
    o_tol = O_TOL[dtype]
    res = dict(kernel=f"conv1d_{kind}", variant="conv1d", B=len(cu) - 1, dtype=jnp.dtype(dtype).name, seed=seed,
               T=int(x.shape[0]), ragged=ragged, snapshots=len(snap_seq), oracle_channels=len(ch),
               o_rel_err=rel(y[:n_real, ch], y64[:n_real]),
               state_rel_err=rel(np.concatenate([fin[:, ch], snaps[:, ch]]), np.concatenate([fin64, snaps64])),
               o_rel_err_vs_jnp=rel(y[:n_real], y_j[:n_real]), state_rel_err_vs_jnp=rel(states, states_j),
               finite=bool(np.isfinite(y).all() and np.isfinite(states).all()),
               padding_zero=bool((y[n_real:] == 0).all()), deterministic=deterministic,
               first_call_s=round(first_call_s, 2))
    return with_verdict(res, o_tol, STATE_TOL)


def conv1d_checks(interpret=False):
    """Every CONV_CASES case, one record each; a case that raises is recorded as an error."""
    for seed, (kind, size, ragged, dtype) in enumerate(CONV_CASES, 301):
        try:
            r = check_conv1d(kind, size, ragged, dtype, seed, interpret)
        except Exception as e:  # keep going: one broken case must not hide the others
            r = dict(kernel=f"conv1d_{kind}", variant="conv1d", B=-1, dtype=jnp.dtype(dtype).name, ok=False,
                     ragged=ragged, error=f"{type(e).__name__}: {str(e)[:2000]}")
        yield r


# ------------------------------------------------------------------------------------------------
# MoE routed experts (pallas_kernels/moe.py): the grouped GEMM (fused gate/up + SiLU, then down with
# the routing weights) and the decode gather path, at the target model's shapes: hidden 2048, 64
# experts top-8, expert intermediate 512, bf16.
# ------------------------------------------------------------------------------------------------

SMALL_ON = 1 << 30  # small_max_rows of the moe_small* variants: their path whatever SMALL_PATH_ON says
MOE_MODEL = dict(E=64, k=8, H=2048, I=512)
# (tokens, routing): decode 1 / 8 / 32 tokens, prefill 512 / 4096; "skewed" routes most rows to a
# few experts and none to a quarter of them (empty groups, groups of many tiles).
MOE_CASES = [(1, "random"), (8, "random"), (32, "random"), (32, "skewed"), (512, "random"), (4096, "random"),
             (4096, "skewed")]
# Variants: the 64-row grouped kernel at every token count (gather_below=0, small_max_rows=0:
# moe_experts' default takes the small path up to moe.SMALL_MAX_ROWS routed rows), its 2-stage ring
# (96 KiB of SMEM: two programs per SM); the swap-AB small path (moe_experts' default at decode
# sizes: 8-row tiles at 1 to 32 tokens of top-8) with its 4- and 2-stage rings and 16-row tiles
# forced, and with its tiles stored transposed (XLA transposes; in case the default's store through
# a transposed SMEM view is wrong or slow on the GPU); and the gather path (decode sizes only: it materialises n * k experts' weights).
MOE_VARIANTS = {"moe_s4": dict(gather_below=0, small_max_rows=0),
                "moe_s2": dict(gather_below=0, small_max_rows=0, stages=2),
                "moe_small": dict(gather_below=0, small_max_rows=SMALL_ON),
                "moe_small_s2": dict(gather_below=0, small_max_rows=SMALL_ON, stages=2),
                "moe_small_r16": dict(gather_below=0, small_max_rows=SMALL_ON, block_rows=16),
                "moe_small_tr": dict(gather_below=0, small_max_rows=SMALL_ON, small_transposed_out=True),
                "moe_gather": None}
MOE_GATHER_MAX_TOKENS = 32
MOE_SMALL_MAX_TOKENS = 64  # moe.SMALL_MAX_ROWS (512) routed rows of top-8: the small variants' range
MOE_ORACLE_TOKENS = 64  # tokens checked against float64 (tokens are independent)
# bf16 operands, fp32 products; the intermediate and each weighted expert output rounded to bf16 once
# (METHOD.md: between 1e-3 and 1e-2). The jnp reference rounds after every op: twice the margin.
MOE_TOL, MOE_JNP_TOL = 1e-2, 2e-2


def moe_routing(rng, n, E, k, kind):
    """(top_w [n, k] fp32, top_i [n, k]): k distinct experts per token with softmax-like weights
    summing to 1; "skewed" draws from a Zipf-like law over three quarters of the experts."""
    if kind == "skewed":
        p = np.zeros(E)
        p[: 3 * E // 4] = 1.0 / np.arange(1, 3 * E // 4 + 1)
        p = p / p.sum()
        top_i = np.stack([rng.choice(E, k, replace=False, p=p) for _ in range(n)])
    else:
        top_i = np.argsort(rng.random((n, E)), axis=1)[:, :k]
    w = np.exp(rng.normal(size=(n, k)))
    return (w / w.sum(1, keepdims=True)).astype(np.float32), top_i.astype(np.int32)


def moe_oracle64(x, top_w, top_i, gate_up, down, tokens):
    """Σ_s top_w[t, s] * down_e(silu(gate_e(x_t)) * up_e(x_t)) in float64 for ``tokens``, one
    expert at a time (each expert's weights converted once)."""
    out = np.zeros((len(tokens), x.shape[1]))
    inter = down.shape[1]
    sel_i, sel_w = top_i[tokens], top_w[tokens].astype(np.float64)
    for e in np.unique(sel_i):
        r, s = np.nonzero(sel_i == e)
        gu = x[tokens[r]].astype(np.float64) @ gate_up[e].astype(np.float64)
        g, u = gu[:, :inter], gu[:, inter:]
        np.add.at(out, r, sel_w[r, s][:, None] * ((g / (1 + np.exp(-g)) * u) @ down[e].astype(np.float64)))
    return out


def check_moe(n, kind, variant, seed, interpret=False):
    from jaxserve.models.layers import routed_experts
    from pallas_kernels import moe

    m = dict(E=8, k=2, H=64, I=64) if interpret else MOE_MODEL
    E, k, H, I = m["E"], m["k"], m["H"], m["I"]
    rng = np.random.default_rng(seed)
    bf = lambda a: np.asarray(jnp.asarray(a, jnp.bfloat16).astype(jnp.float32))  # noqa: E731  (round once)
    x = bf(rng.standard_normal((n, H), dtype=np.float32))
    gate_up = bf(rng.standard_normal((E, H, 2 * I), dtype=np.float32) * np.float32(H ** -0.5))
    down = bf(rng.standard_normal((E, I, H), dtype=np.float32) * np.float32(I ** -0.5))
    top_w, top_i = moe_routing(rng, n, E, k, kind)
    args = (jnp.asarray(x, jnp.bfloat16), jnp.asarray(top_w), jnp.asarray(top_i),
            jnp.asarray(gate_up, jnp.bfloat16), jnp.asarray(down, jnp.bfloat16))
    kw = MOE_VARIANTS[variant]
    if kw is None:
        run = jax.jit(moe.moe_experts_gather)
    else:
        run = jax.jit(lambda *a: moe.moe_experts(*a, interpret=interpret, **kw))
    t0 = time.perf_counter()
    y = np.asarray(jax.block_until_ready(run(*args)))
    first_call_s = time.perf_counter() - t0
    deterministic = bool(np.array_equal(np.asarray(run(*args)), y))
    tokens = np.sort(rng.choice(n, min(n, MOE_ORACLE_TOKENS), replace=False))
    y64 = moe_oracle64(x, top_w, top_i, gate_up, down, tokens)
    res = dict(kernel="moe", variant=variant, B=n, dtype="bfloat16", seed=seed, routing=kind,
               shape=f"E={E} k={k} H={H} I={I}", experts_used=int(len(np.unique(top_i))),
               oracle_tokens=len(tokens), o_rel_err=rel(y[tokens], y64),
               max_abs_err=float(np.abs(y[tokens] - y64).max()), oracle_max_abs=float(np.abs(y64).max()),
               finite=bool(np.isfinite(y).all()), deterministic=deterministic, first_call_s=round(first_call_s, 2))
    ok = res["finite"] and deterministic and res["o_rel_err"] < MOE_TOL
    try:  # lax.ragged_dot (XLA's dense masked lowering) on the GPU; at prefill its temporaries are large
        y_j = np.asarray(jax.jit(routed_experts)(args[0], args[1].astype(jnp.bfloat16), *args[2:]).astype(jnp.float32))
        res.update(o_rel_err_vs_jnp=rel(y, y_j), max_abs_err_vs_jnp=float(np.abs(y - y_j).max()))
        ok = ok and res["o_rel_err_vs_jnp"] < MOE_JNP_TOL
    except Exception as e:  # noqa: BLE001  (recorded; the float64 oracle still decides)
        res["jnp_error"] = f"{type(e).__name__}: {str(e)[:300]}"
    res["ok"] = bool(ok)
    return res


def moe_checks(interpret=False):
    """Every MOE_CASES case for every applicable variant, one record each; a case that raises is
    recorded as an error."""
    cases = [(1, "random"), (8, "random"), (40, "skewed")] if interpret else MOE_CASES  # interpret: top-2
    seed = 400
    for n, kind in cases:
        for variant in MOE_VARIANTS:
            if MOE_VARIANTS[variant] is None and n > MOE_GATHER_MAX_TOKENS:
                continue
            if variant.startswith("moe_small") and n > MOE_SMALL_MAX_TOKENS:
                continue
            seed += 1
            try:
                r = check_moe(n, kind, variant, seed, interpret)
            except Exception as e:  # keep going: one broken case must not hide the others
                r = dict(kernel="moe", variant=variant, B=n, dtype="bfloat16", ok=False, routing=kind,
                         error=f"{type(e).__name__}: {str(e)[:2000]}")
            yield r


# ------------------------------------------------------------------------------------------------
# Dense projections of decode steps (pallas_kernels/linear_small.py) at the target model's weights:
# bf16 x [M, K] @ w [K, N] against a float64 oracle and XLA's dot; the stacked form (w [L, K, N],
# the decoder's scan) reads the named layer.
# ------------------------------------------------------------------------------------------------

# (name, K, N): GDN in_proj qkv / z and out_proj, attention q (with its gate) / k, shared expert
# gate / down, the LM head (vocab 151936 = 2374 column tiles)
LINEAR_SHAPES = [("in_proj_qkv", 2048, 8192), ("in_proj_z", 2048, 4096), ("out_proj", 4096, 2048),
                 ("k_proj", 2048, 512), ("shared_down", 512, 2048), ("lm_head", 2048, 151936)]
LINEAR_ROWS = (1, 8, 32, 64)
# Variants: default K splits (linear_small.splits), one split forced (4- and 12-stage rings), the stacked weight
LINEAR_VARIANTS = {"linear": dict(), "linear_s1": dict(num_splits=1), "linear_deep": dict(num_splits=1, stages=12),
                   "linear_stack": dict(stack=3)}
LINEAR_TOL, LINEAR_JNP_TOL = 1e-2, 2e-2  # bf16 output, rounded once (XLA's dot also once: 2x margin)


def check_linear(name, K, N, M, variant, seed, interpret=False):
    from pallas_kernels.linear_small import linear_small, splits

    if interpret:
        K, N = min(K, 256), min(N, 128)
    rng = np.random.default_rng(seed)
    dt = jnp.float32 if interpret else jnp.bfloat16
    kw = dict(LINEAR_VARIANTS[variant])
    L = kw.pop("stack", 0)
    x = np.asarray(jnp.asarray(rng.standard_normal((M, K), dtype=np.float32), dt).astype(jnp.float32))
    ws = np.asarray(jnp.asarray(rng.standard_normal((max(L, 1), K, N), dtype=np.float32) * K ** -0.5, dt)
                    .astype(jnp.float32))
    layer = L - 1 if L else None
    w_op = jnp.asarray(ws if L else ws[0], dt)
    run = jax.jit(lambda x, w, l: linear_small(x, w, l, interpret=interpret, **kw))
    args = (jnp.asarray(x, dt), w_op, None if layer is None else jnp.int32(layer))
    t0 = time.perf_counter()
    y = np.asarray(jax.block_until_ready(run(*args)).astype(jnp.float32))
    first_call_s = time.perf_counter() - t0
    deterministic = bool(np.array_equal(np.asarray(run(*args).astype(jnp.float32)), y))
    w = ws[layer or 0]
    y64 = x.astype(np.float64) @ w.astype(np.float64)
    y_j = np.asarray(jax.jit(lambda a, b: a @ b)(args[0], jnp.asarray(w, dt)).astype(jnp.float32))
    res = dict(kernel="linear", variant=variant, B=M, dtype=jnp.dtype(dt).name, seed=seed, shape=f"{name} K={K} N={N}",
               splits=kw.get("num_splits") or splits(M, K, N, dt), o_rel_err=rel(y, y64),
               o_rel_err_vs_jnp=rel(y, y_j), max_abs_err=float(np.abs(y - y64).max()),
               oracle_max_abs=float(np.abs(y64).max()), finite=bool(np.isfinite(y).all()),
               deterministic=deterministic, first_call_s=round(first_call_s, 2))
    res["ok"] = bool(res["finite"] and deterministic and res["o_rel_err"] < LINEAR_TOL
                     and res["o_rel_err_vs_jnp"] < LINEAR_JNP_TOL)
    return res


def linear_checks(interpret=False):
    """Every LINEAR_SHAPES x LINEAR_ROWS case with the default variant, the forced one-split and
    the stacked variants at 1 and 32 rows; a case that raises is recorded as an error."""
    plan = [(s, M, "linear") for s in LINEAR_SHAPES for M in LINEAR_ROWS]
    plan += [(s, M, v) for s in LINEAR_SHAPES for M in (1, 32) for v in ("linear_s1", "linear_deep", "linear_stack")]
    if interpret:
        plan = [p for p in plan if p[0][0] in ("out_proj", "k_proj") and p[1] in (1, 32)]
    for seed, ((name, K, N), M, variant) in enumerate(plan, 700):
        try:
            r = check_linear(name, K, N, M, variant, seed, interpret)
        except Exception as e:  # keep going: one broken case must not hide the others
            r = dict(kernel="linear", variant=variant, B=M, dtype="bfloat16", ok=False, shape=f"{name} K={K} N={N}",
                     error=f"{type(e).__name__}: {str(e)[:2000]}")
        yield r


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--batches", default="1,64,256,512")
    ap.add_argument("--interpret", action="store_true", help="CPU smoke run of this script (slow: use --batches 1)")
    ap.add_argument("--suites", default="decode,paged_attention,chunked,conv1d,moe,linear",
                    help="decode (GDN/KDA), paged_attention, chunked (GDN/KDA prefill), conv1d (short conv), "
                         "moe (MoE routed experts), linear (decode-step dense projections), gdn_fused / "
                         "kda_fused (GDN / KDA prefill as one kernel; not in the default), gdn_prep (GDN "
                         "prefill with the intra-chunk terms by a kernel; not in the default)")
    args = ap.parse_args()
    suites = args.suites.split(",")
    print(jax.devices())
    os.makedirs(args.out, exist_ok=True)
    log = open(os.path.join(args.out, "gpu_check.jsonl"), "w")  # one line per case, as it finishes
    batches = list(map(int, args.batches.split(",")))
    # both variants at each batch in turn (so a timeout still leaves both partly checked), fp32 last
    plan = [(variant, kind, B, jnp.bfloat16, variant == "simple") for B in batches
            for variant in ("simple", "persistent") for kind in ("gdn", "kda")
            if variant == "simple" or B != 256 or len(batches) == 1]
    plan += [("simple", kind, 64, jnp.float32, True) for kind in ("gdn", "kda") if 64 in batches]
    if "decode" not in suites:
        plan = []
    results = []
    for seed, (variant, kind, B, dtype, jnp_check) in enumerate(plan, 1):
        try:
            r = check_decode(kind, B, dtype, seed, args.interpret, variant, jnp_check)
        except Exception as e:  # keep going: one broken case must not hide the others
            r = dict(kernel=f"{kind}_decode", variant=variant, B=B, dtype=jnp.dtype(dtype).name, ok=False,
                     error=f"{type(e).__name__}: {str(e)[:2000]}")
        results.append(r)
        print(json.dumps(r), flush=True)
        log.write(json.dumps(r) + "\n")
        log.flush()
    for r in (paged_attention_checks(args.interpret) if "paged_attention" in suites else ()):
        results.append(r)
        print(json.dumps(r), flush=True)
        log.write(json.dumps(r) + "\n")
        log.flush()
    for r in itertools.chain(chunked_checks(args.interpret) if "chunked" in suites else (),
                             fused_checks("gdn", args.interpret) if "gdn_fused" in suites else (),
                             fused_checks("kda", args.interpret) if "kda_fused" in suites else (),
                             fused_checks("gdn_prep", args.interpret) if "gdn_prep" in suites else (),
                             conv1d_checks(args.interpret) if "conv1d" in suites else (),
                             moe_checks(args.interpret) if "moe" in suites else (),
                             linear_checks(args.interpret) if "linear" in suites else ()):
        results.append(r)
        print(json.dumps(r), flush=True)
        log.write(json.dumps(r) + "\n")
        log.flush()
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "gpu_check.json"), "w") as f:
        json.dump(results, f, indent=1)
    print(f"\n{'kernel':11} {'variant':10} {'B':>4} {'dtype':9} {'o err':>9} {'state err':>9} {'o vs jnp':>9} ok")
    for r in results:
        head = f"{r['kernel']:11} {r['variant']:10} {r['B']:>4} {r['dtype']:9}"
        if "error" in r:
            print(f"{head} ERROR {r['error'][:200]}")
        else:
            vs = f"{r['o_rel_err_vs_jnp']:9.2e}" if "o_rel_err_vs_jnp" in r else f"{'-':>9}"
            st = f"{r['state_rel_err']:9.2e}" if "state_rel_err" in r else f"{'-':>9}"  # moe: no state
            extra = f" max|err| {r['max_abs_err']:.2e} of {r['oracle_max_abs']:.2e}" if "max_abs_err" in r else ""
            print(f"{head} {r['o_rel_err']:9.2e} {st} {vs} {'yes' if r['ok'] else 'NO'}{extra}")
    failed = [r for r in results if not r["ok"]]
    print(f"gpu_check: {len(results) - len(failed)}/{len(results)} passed")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
