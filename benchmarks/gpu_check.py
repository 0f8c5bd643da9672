"""GPU correctness check for the Pallas kernels at model shapes (run on the device, not in CI).

    python benchmarks/gpu_check.py [--out DIR]

For each case: fresh random inputs, a state pool larger than the batch with the batch's rows at
random distinct slots (plus null-slot padding rows), the kernel run once, and the result compared
with (a) a float64 NumPy evaluation of the same step on the host (the oracle, METHOD.md tolerances:
fp32 arithmetic far under 1e-3; outputs rounded to bf16 between 1e-3 and 1e-2; NaN never passes),
(b) the pure-jnp references ``gdn_recurrent`` / ``kda_recurrent`` run on the GPU. Slots the batch
does not name must come back bit-identical; the same call repeated must give bit-identical
results (a moving result is a race). Exit status 1 if any case fails.
"""

from __future__ import annotations

import argparse
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
    pools_identical = bool(np.array_equal(np.asarray(kp), np.asarray(kp_jnp))
                           and np.array_equal(np.asarray(vp), np.asarray(vp_jnp)))
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


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--batches", default="1,64,256,512")
    ap.add_argument("--interpret", action="store_true", help="CPU smoke run of this script (slow: use --batches 1)")
    ap.add_argument("--suites", default="decode,paged_attention", help="decode (GDN/KDA), paged_attention")
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
            print(f"{head} {r['o_rel_err']:9.2e} {r['state_rel_err']:9.2e} {vs} {'yes' if r['ok'] else 'NO'}")
    failed = [r for r in results if not r["ok"]]
    print(f"gpu_check: {len(results) - len(failed)}/{len(results)} passed")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
