"""Kernel benchmarks on the GPU: ours vs the best peer kernel vs the XLA-compiled jnp reference
vs the roofline, one JSON record per case.

    python benchmarks/kernels.py [--only decode] [--out DIR] [--quick]
    python benchmarks/kernels.py --table benchmarks/results/kernels-h200.json   # RESULTS.md table

Kernel families register a ``Suite`` in ``SUITES`` (cases, a JAX runner, a peer runner): GDN/KDA
decode, paged attention, chunked prefill (``chunked``; ``gdn_fused`` / ``kda_fused``: GDN / KDA
prefill as one kernel, timed beside the split kernel; ``gdn_prep``: the split kernel with its
intra-chunk terms by ``gdn_chunk_prep``), the causal conv1d and the MoE routed experts (``moe``: ours vs
``lax.ragged_dot`` vs the gather path; no peer).

Method (the device tool's METHOD.md): inputs are random (never zeros), states live in a pool of
at least 256 slots (>= 512 MiB, many times the 60 MB L2) and every step of a timed chain moves to
fresh slots, so no state is served from L2. JAX side (ours, jnp reference): a jitted chain of
``steps`` decode steps, the pool donated and threaded through; the reported time is the sum of
the chain's kernel durations measured with CUPTI (Mosaic GPU's profiler hook) divided by
``steps``, median of ``REPEATS`` chains after warm-up; the wall-clock time of the same chain per
step is recorded beside it. Peer side (fla's Triton kernels, torch): the same chain of calls
captured in one CUDA graph, replayed ``REPEATS`` times, timed with CUDA events, median. fla runs in
a child process of this script, after the JAX side, one case at a time, so a peer crash (issue 6
reports fla's GDN fused recurrent kernel hitting an illegal memory access at batch 256) is recorded
in that case's record instead of taking the whole run down (a CUDA fault poisons the process). Roofline: the state bytes a step must
move (read + write, fp32) over the device-to-device copy bandwidth measured in the same run.
Paged-attention extend is compute-bound: its roofline is its causal FLOP floor over a bf16 matmul
rate measured in the same run (``roofline_basis`` in each record says which floor), and its peer,
cuDNN flash attention through ``jax.nn.dot_product_attention``, is timed in this process like ours.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import subprocess
import sys
import time
from typing import Callable

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

DATE = datetime.date.today().isoformat()  # the day the run measured (the device clock)
REPEATS = 10
MIN_POOL_SLOTS = 256
RESULTS = os.path.join(ROOT, "benchmarks", "results", "kernels-h200.json")


# ------------------------------------------------------------------------------------------------
# Cases
# ------------------------------------------------------------------------------------------------

# Qwen3-Next (and Qwen3.5) GDN layers: 16 key heads, 32 value heads, d 128. Kimi-Linear KDA layers
# (transformers' KimiLinearConfig defaults: linear_num_heads 32, linear_head_dim 128): Hk = Hv = 32.
DECODE_MODELS = {
    "gdn": dict(model="Qwen3-Next", Hk=16, Hv=32, dk=128, dv=128),
    "kda": dict(model="Kimi-Linear", Hk=32, Hv=32, dk=128, dv=128),
}
DECODE_BATCHES = (1, 64, 256, 512)
if os.environ.get("KERNELS_SMOKE"):  # CPU smoke run of this script: tiny shapes, interpret mode
    DECODE_MODELS = {k: dict(m, Hk=1, Hv=2, dk=64, dv=64) for k, m in DECODE_MODELS.items()}
    DECODE_BATCHES, MIN_POOL_SLOTS, REPEATS = (1, 3), 4, 2

def decode_cases(quick=False):
    batches = DECODE_BATCHES[::3] if quick else DECODE_BATCHES
    return [dict(suite="decode", kind=kind, B=B, **DECODE_MODELS[kind])
            for kind in ("gdn", "kda") for B in batches]


def case_key(case):
    m = case
    if m.get("suite") == "paged_attention":
        return paged_case_key(m)
    if m.get("suite") == "chunked":
        return chunked_case_key(m)
    if m.get("suite") in ("gdn_fused", "kda_fused", "gdn_prep"):
        return fused_case_key(m)
    if m.get("suite") == "conv1d":
        return conv1d_case_key(m)
    if m.get("suite") == "moe":
        return moe_case_key(m)
    if m.get("suite") == "linear":
        return linear_case_key(m)
    return (f"{m['kind']}_decode", f"B={m['B']} Hk={m['Hk']} Hv={m['Hv']} dk={m['dk']} dv={m['dv']} ({m['model']})")


def decode_state_bytes(case):
    return case["B"] * case["Hv"] * case["dk"] * case["dv"] * 4 * 2


def decode_steps(B):
    """Steps per timed chain: enough kernel time per chain to dwarf one dispatch."""
    if os.environ.get("KERNELS_SMOKE"):
        return 2
    return {1: 32, 64: 16, 256: 8}.get(B, 6)


def decode_layout(case):
    """Pool size and the slots of every step of a chain: fresh, distinct slots each step."""
    import numpy as np

    B = case["B"]
    n = max(2 * B, MIN_POOL_SLOTS)
    steps = decode_steps(B)
    base = np.random.default_rng(B).permutation(n)
    slots = np.stack([base[(i * B + np.arange(B)) % n] for i in range(steps)]).astype(np.int32) + 1
    return n + 1, steps, slots  # slot 0 is the null slot


def decode_inputs_np(case, seed=0):
    import numpy as np

    rng = np.random.default_rng(seed)
    B, Hk, Hv, dk, dv = (case[n] for n in ("B", "Hk", "Hv", "dk", "dv"))
    f32 = lambda *s: rng.standard_normal(size=s, dtype=np.float32)  # noqa: E731
    g_shape = (B, Hv, dk) if case["kind"] == "kda" else (B, Hv)
    return dict(q=f32(B, Hk, dk), k=f32(B, Hk, dk), v=f32(B, Hv, dv),
                g=-rng.uniform(0.0, 1.0, size=g_shape).astype(np.float32),
                beta=rng.uniform(0.0, 1.0, size=(B, Hv)).astype(np.float32))


# ------------------------------------------------------------------------------------------------
# JAX side
# ------------------------------------------------------------------------------------------------


def time_jax_chain(chain: Callable, state, args, steps: int, repeats: int = REPEATS, hlo_name: str | None = None):
    """Median per-step kernel time (CUPTI, ``jaxserve.profiling``) and wall time of
    ``state, outs = chain(state, *args)``.

    ``chain`` donates ``state``; every call threads the returned state into the next one. With
    ``hlo_name`` and ``$KERNELS_HLO_DIR`` set, the compiled (optimised) HLO of ``chain`` is written
    there as ``hlo_name.hlo.txt.gz``: it maps the breakdown's fusion names back to the ops.
    """
    import jax
    import numpy as np

    from jaxserve import profiling

    hlo_dir = os.environ.get("KERNELS_HLO_DIR")
    if hlo_name and hlo_dir:
        import gzip

        os.makedirs(hlo_dir, exist_ok=True)
        with gzip.open(os.path.join(hlo_dir, f"{hlo_name}.hlo.txt.gz"), "wt") as f:
            f.write(chain.lower(state, *args).compile().as_text())
    carry = [state]

    def call():
        carry[0], outs = chain(carry[0], *args)
        jax.block_until_ready((carry[0], outs))

    for _ in range(2):  # compile + warm up
        call()
    wall_ms = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        call()
        wall_ms.append((time.perf_counter() - t0) * 1e3 / steps)
    res = dict(wall_ms=float(np.median(wall_ms)))
    per_call = profiling.kernel_timings(call, repeats)
    if per_call:  # kernel time, and where it goes: the 6 costliest kernels, median ms per step each
        res.update(profiling.summarize(per_call, top=6, divide=steps))
    return carry[0], res


def measure_copy_bandwidth(nbytes=2 << 30 if not os.environ.get("KERNELS_SMOKE") else 1 << 20):
    """Device-to-device copy bandwidth in TB/s (bytes read + bytes written), as METHOD.md asks."""
    import jax
    import jax.numpy as jnp

    x = jax.random.normal(jax.random.key(0), (nbytes // 4,), jnp.float32)
    steps = 1  # XLA would fuse several passes into one: time single passes

    def chain(x):
        return x + 1.0, ()  # one elementwise pass: read nbytes, write nbytes

    _, res = time_jax_chain(jax.jit(chain, donate_argnums=(0,)), x, (), steps)
    t = res.get("kernel_ms", res["wall_ms"])
    return 2 * nbytes / (t * 1e-3) / 1e12, res


def measure_matmul_rate(n=8192 if not os.environ.get("KERNELS_SMOKE") else 256):
    """bf16 matrix-product rate in TFLOP/s (2·n³ per product; XLA's GEMM, cuBLAS on the GPU): the
    compute ceiling METHOD.md asks for beside the copy bandwidth, the rate FLOP rooflines divide by.
    Random operands; b is scaled by n^-1/2 so the chained product stays O(1)."""
    import jax
    import jax.numpy as jnp

    ka, kb = jax.random.split(jax.random.key(5))
    a = jax.random.normal(ka, (n, n), jnp.bfloat16)
    b = (jax.random.normal(kb, (n, n), jnp.float32) * n ** -0.5).astype(jnp.bfloat16)

    def chain(a, b):
        return a @ b, ()

    _, res = time_jax_chain(jax.jit(chain, donate_argnums=(0,)), a, (b,), 1)
    t = res.get("kernel_ms", res["wall_ms"])
    return 2 * n ** 3 / (t * 1e-3) / 1e12, res


# Kernel variants timed (names match benchmarks/gpu_check.py's VARIANTS for the gating below).
OURS_VARIANTS = {
    "simple_bdv128": dict(persistent=False, block_dv=128),
    "persistent_s3_bdv64": dict(persistent=True, stages=3, block_dv=64, blocks_per_sm=2),
}
CHECKED_AS = {"simple_bdv128": "simple", "simple_bdv64": "simple", "persistent_s3_bdv64": "persistent"}
CHECKED_AS["paged"] = "paged"  # the paged-attention kernel (gpu_check rows with variant "paged")


def checked_variants(out_dir):
    """Variants the GPU check passed in this run (all when no check ran, e.g. a local smoke run)."""
    path = os.path.join(out_dir, "gpu_check.jsonl")
    if not os.path.exists(path):
        return set(OURS_VARIANTS) | set(CHECKED_AS)
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    ok = {v for v in set(CHECKED_AS.values())
          if any(r.get("variant") == v for r in rows) and all(r["ok"] for r in rows if r.get("variant") == v)}
    return {n for n, v in CHECKED_AS.items() if v in ok}


def run_decode_jax(case, allowed=None):
    """Ours (each variant the GPU check passed) and the jnp reference under XLA on one decode case."""
    import jax
    import jax.numpy as jnp

    from pallas_kernels.gdn_decode import gdn_decode_jnp, gdn_decode_pool

    num_slots, steps, slots = decode_layout(case)
    x = decode_inputs_np(case)
    dt = dict(q=jnp.bfloat16, k=jnp.bfloat16, v=jnp.bfloat16, g=jnp.float32, beta=jnp.bfloat16)
    xd = {n: jnp.asarray(a, dt[n]) for n, a in x.items()}
    slots_d = [jnp.asarray(s) for s in slots]  # one array per step: no slicing kernels in the chain
    Hv, dk, dv = case["Hv"], case["dk"], case["dv"]
    out = {}

    def make_chain(step):
        def chain(pool, x, slots):
            outs = []
            for i in range(steps):
                o, pool = step(x, pool, slots[i])
                outs.append(o)
            return pool, outs
        return jax.jit(chain, donate_argnums=(0,))

    interpret = bool(os.environ.get("KERNELS_SMOKE"))
    variants = {}
    for name, kw in OURS_VARIANTS.items():
        if allowed is not None and name not in allowed:
            out[f"ours_{name}"] = dict(error="not run: failed or missing in gpu_check")
            continue
        if kw["block_dv"] > dv:
            continue
        variants[f"ours_{name}"] = (lambda kw: lambda x, p, s: gdn_decode_pool(
            **x, state_pool=p, slots=s, interpret=interpret, **kw))(kw)
    variants["jnp"] = lambda x, p, s: gdn_decode_jnp(**x, state_pool=p, slots=s)
    # One jitted step, called ``steps`` times: JAX lowers (and Mosaic GPU compiles) it once, not once
    # per step of the chain (which cost ~16 s per variant on the 2026-12-02 run).
    variants = {n: jax.jit(f) for n, f in variants.items()}
    for name, step in variants.items():
        pool = jax.random.normal(jax.random.key(1), (num_slots, Hv, dk, dv), jnp.float32)
        try:
            _, res = time_jax_chain(make_chain(step), pool, (xd, slots_d), steps)
        except Exception as e:  # noqa: BLE001
            res = dict(error=f"{type(e).__name__}: {str(e)[:600]}")
        del pool
        out[name] = res
        print(f"  {name:14} {json.dumps(res)}", flush=True)
    return out


# ------------------------------------------------------------------------------------------------
# Peer side (fla, torch): runs in a child process
# ------------------------------------------------------------------------------------------------


def time_torch_graph(call, steps, repeats=REPEATS):
    """Median per-call time of ``call(i)`` for i in range(steps), captured in one CUDA graph."""
    import numpy as np
    import torch

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for i in range(steps):  # warm-up (Triton JIT / autotune) outside the capture
            call(i)
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for i in range(steps):
                call(i)
        run, how = graph.replay, "cuda graph"
    except Exception as e:  # noqa: BLE001  (fall back to eager launches, recorded as such)
        torch.cuda.synchronize()

        def run():
            for i in range(steps):
                call(i)
        how = f"eager ({type(e).__name__})"
    run()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        run()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) / steps)
    return dict(graph_ms=float(np.median(times)), graph_ms_spread=float(np.ptp(times)), timed_as=how)


def run_decode_fla(case):
    import torch

    num_slots, steps, slots = decode_layout(case)
    x = decode_inputs_np(case)
    dev = "cuda"
    dt = dict(q=torch.bfloat16, k=torch.bfloat16, v=torch.bfloat16, g=torch.float32, beta=torch.bfloat16)
    B, Hk, Hv, dk, dv = (case[n] for n in ("B", "Hk", "Hv", "dk", "dv"))
    t = {n: torch.from_numpy(a).to(dev, dt[n]) for n, a in x.items()}
    pool = torch.randn(num_slots, Hv, dk, dv, device=dev, dtype=torch.float32)
    slots_t = torch.from_numpy(slots).to(dev)
    scale = dk ** -0.5
    if case["kind"] == "gdn":
        from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule

        # fla's GDN kernel takes one initial state per sequence, not a pool: give it B contiguous
        # states (a fresh window of the pool each step) and let it write B new final states.
        q, k, v = (t[n].unsqueeze(1) for n in ("q", "k", "v"))  # [B, T=1, H, d]
        g, beta = t["g"].unsqueeze(1), t["beta"].unsqueeze(1)
        n_windows = (num_slots - 1) // B

        def call(i):
            w = 1 + (i % n_windows) * B
            return fused_recurrent_gated_delta_rule(q, k, v, g, beta, scale=scale,
                                                    initial_state=pool[w:w + B],
                                                    output_final_state=True, use_qk_l2norm_in_kernel=True)
        peer = "fla fused_recurrent_gated_delta_rule"
    else:
        from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd

        # fla's KDA decode path (the vLLM kernel): states read from and written back to the pool
        # in place through ssm_state_indices; the batch is B sequences of one token (cu_seqlens).
        q, k, v, g = (t[n].unsqueeze(0) for n in ("q", "k", "v", "g"))  # [1, B, H, d]
        beta = t["beta"].unsqueeze(0)
        cu = torch.arange(B + 1, device=dev, dtype=torch.long)

        def call(i):
            return fused_recurrent_kda_fwd(q, k, v, g, beta, initial_state=pool, scale=scale,
                                           inplace_final_state=True, cu_seqlens=cu,
                                           ssm_state_indices=slots_t[i], use_qk_l2norm_in_kernel=True)
        peer = "fla fused_recurrent_kda (pool, in place)"
    res = time_torch_graph(call, steps)
    res["peer"] = peer
    return res


def fla_worker(cases_json):
    """Child process: one JSON line per case on stdout, flushed as soon as it is measured."""
    cases = json.loads(cases_json)
    for case in cases:
        try:
            run = {"chunked": run_chunked_fla, "gdn_fused": run_chunked_fla, "kda_fused": run_chunked_fla,
                   "gdn_prep": run_chunked_fla,
                   "conv1d": run_conv1d_fla}.get(case.get("suite"), run_decode_fla)
            res = run(case)
        except Exception as e:  # noqa: BLE001  (a CUDA fault usually kills the process instead)
            res = dict(error=f"{type(e).__name__}: {str(e)[:600]}")
        print("RESULT " + json.dumps(dict(case=case, res=res)), flush=True)


def run_peers(cases, budget_s=80):
    """Run the fla worker over ``cases``; if it dies, record the error and go on after that case."""
    results, todo = {}, list(cases)
    deadline = time.monotonic() + budget_s
    while todo:
        timeout_s = max(5.0, deadline - time.monotonic())
        try:
            proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--fla-worker", json.dumps(todo)],
                                  capture_output=True, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired as e:
            out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
            proc = subprocess.CompletedProcess(e.cmd, 124, out, f"timed out after {timeout_s} s")
        for line in proc.stdout.splitlines():
            if line.startswith("RESULT "):
                r = json.loads(line[len("RESULT "):])
                results[case_key(r["case"])] = r["res"]
                print(f"  peer {case_key(r['case'])}: {json.dumps(r['res'])}", flush=True)
        done = [c for c in todo if case_key(c) in results]
        rest = [c for c in todo if case_key(c) not in results]
        if proc.returncode != 0 and rest:
            err = (proc.stderr.strip().splitlines() or ["(no stderr)"])[-1][:400]
            results[case_key(rest[0])] = dict(error=f"worker died (rc {proc.returncode}): {err}")
            print(f"  peer {case_key(rest[0])}: worker died: {err}", flush=True)
            rest = rest[1:]
        elif not done and rest:
            break
        todo = rest
    return results


# ------------------------------------------------------------------------------------------------
# Suites, records, table
# ------------------------------------------------------------------------------------------------


# ------------------------------------------------------------------------------------------------
# Paged attention: decode and prefill extend (pallas_kernels/paged_attention.py)
# ------------------------------------------------------------------------------------------------

# Qwen3.5-like full-attention layers: 16 q heads, 2 kv heads (GQA 8), head_dim 256, bf16 pools,
# the engine's page size (16).
# Decode: one new token per row, its row's context ``ctx`` keys long. Roofline: the K+V bytes a
# step must read (B * ctx * nkv * hd * 2 bytes * 2) over the measured copy bandwidth (the H200's is
# about 4.0e12 B/s). No peer kernel is timed for decode.
# Extend (a chunked-prefill step): B rows of ``new`` new tokens over ``ctx`` cached tokens each (the
# same for every row of a case), causal: query i of a row sees its row's ctx + i + 1 keys, read
# through the page table after the step wrote the new tokens' K/V. Roofline: the FLOP floor
# (``paged_flops``) over the bf16 matmul rate measured in the same run: an extend is compute-bound
# (its bytes, ``paged_bytes``, are kept in the record too). Peer: cuDNN's flash attention through
# ``jax.nn.dot_product_attention(implementation="cudnn")`` in this process (``paged_extend_peer``).
PAGED_MODEL = dict(model="Qwen3.5-like", nh=16, nkv=2, hd=256, page_size=16)
PAGED_CONTEXTS = (4096, 32768, 131072)
PAGED_BATCHES = (1, 64)
# Extend cases: 4 rows x 2048 new tokens (the engine's prefill chunk) over 0 / 2048 / 6144 cached.
PAGED_EXTEND_B, PAGED_EXTEND_NEW, PAGED_EXTEND_CONTEXTS = 4, 2048, (0, 2048, 6144)
PAGED_L2_BYTES = 256 << 20  # a chain cycles through layers until it has read this much (L2: 60 MB)
PAGED_PEER_IMPL = "cudnn"  # dot_product_attention's implementation for the extend peer
PAGED_PEER_TOL = 2e-2  # a peer variant further than this from the jnp output is not reported
if os.environ.get("KERNELS_SMOKE"):  # the XLA implementation stands in for cuDNN on the CPU
    PAGED_MODEL = dict(PAGED_MODEL, nh=4, nkv=1, hd=128)
    PAGED_CONTEXTS, PAGED_BATCHES, PAGED_L2_BYTES = (128,), (1, 2), 1 << 20
    PAGED_EXTEND_B, PAGED_EXTEND_NEW, PAGED_EXTEND_CONTEXTS, PAGED_PEER_IMPL = 2, 64, (0, 64), "xla"


def paged_cases(quick=False):
    contexts = PAGED_CONTEXTS[:2] if quick else PAGED_CONTEXTS
    extend = PAGED_EXTEND_CONTEXTS[:2] if quick else PAGED_EXTEND_CONTEXTS
    return ([dict(suite="paged_attention", kind="paged_decode", B=B, ctx=ctx, **PAGED_MODEL)
             for ctx in contexts for B in PAGED_BATCHES]
            + [dict(suite="paged_attention", kind="paged_extend", B=PAGED_EXTEND_B, new=PAGED_EXTEND_NEW, ctx=ctx,
                    **PAGED_MODEL) for ctx in extend])


def paged_case_key(m):
    heads = f"nh={m['nh']} nkv={m['nkv']} hd={m['hd']} page={m['page_size']} ({m['model']})"
    if m["kind"] == "paged_extend":
        return "paged_attn_extend", f"B={m['B']} new={m['new']} cached={m['ctx']} {heads}"
    return "paged_attn_decode", f"B={m['B']} ctx={m['ctx']} {heads}"


def paged_kv_bytes(case):
    """K+V bytes (bf16) of every row's keys: ``ctx`` per row for decode, ``ctx + new`` for extend."""
    return case["B"] * (case["ctx"] + case.get("new", 0)) * case["nkv"] * case["hd"] * 2 * 2


def paged_bytes(case):
    """Bytes a step must move: the K+V read; for extend also q read, o written (bf16, nh heads) and
    the new tokens' K/V written to their pages (left out for decode: one token a row)."""
    nbytes = paged_kv_bytes(case)
    if case["kind"] == "paged_extend":
        nbytes += case["B"] * case["new"] * case["hd"] * 2 * (2 * case["nh"] + 2 * case["nkv"])
    return nbytes


def paged_flops(case):
    """Extend: the causal FLOP floor, QKᵀ and PV (2·hd FLOPs each per head) for every visible
    (query, key) pair, 4·nh·hd·Σ visible keys, row b's query i seeing ctx + i + 1 keys (masked
    pairs are not counted). Decode: None (its roofline is the K/V bytes)."""
    if case["kind"] != "paged_extend":
        return None
    new, ctx = case["new"], case["ctx"]
    pairs = case["B"] * (new * ctx + new * (new + 1) // 2)
    return 4 * case["nh"] * case["hd"] * pairs


def paged_layout(case):
    """(layers, steps): enough layers that a chain reads PAGED_L2_BYTES before it re-reads a page.
    An extend step runs a fraction of a millisecond or more, so its chain is just one pass over them."""
    layers = max(1, -(-PAGED_L2_BYTES // paged_kv_bytes(case)))
    if os.environ.get("KERNELS_SMOKE"):
        return min(layers, 2), 2
    if case["kind"] == "paged_extend":
        return layers, max(layers, 2)
    steps = max(layers, 8) if paged_kv_bytes(case) < (4 << 30) else 2
    return layers, steps


def random_paged_pool(key, layers, num_pages, ps, nkv, hd):
    """Random bf16 pages ``[layers, num_pages, ps, nkv, hd]``, generated 2**28 elements at a time (a
    128k x 64 pool has 2**32 elements per pool, past what one random-bits call should count)."""
    import jax
    import jax.numpy as jnp

    chunk = max(1, (1 << 28) // (layers * ps * nkv * hd))
    parts = [jax.random.normal(jax.random.fold_in(key, i), (layers, min(chunk, num_pages - a), ps, nkv, hd),
                               jnp.bfloat16) for i, a in enumerate(range(0, num_pages, chunk))]
    return parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=1)


def time_paged_chains(steps_fns, new_pools, x, layers, steps):
    """Time each ``step(x, k_pool, v_pool, layer) -> (o, k_pool, v_pool)`` of ``steps_fns`` in a jitted
    chain of ``steps`` calls (the step compiled once), step i on layer i % layers (fresh pages for
    the L2), the pools donated and threaded through; ``new_pools()`` makes them (again after a
    failure, which may have consumed the donated ones)."""
    import jax
    import jax.numpy as jnp

    def make_chain(step):
        step = jax.jit(step)  # compiled once, called ``steps`` times inside the chain

        def chain(pools, x, layer_ids):
            kp, vp = pools
            outs = []
            for layer in layer_ids:
                o, kp, vp = step(x, kp, vp, layer)
                outs.append(o)
            return (kp, vp), outs
        return jax.jit(chain, donate_argnums=(0,))

    layer_ids = [jnp.int32(i % layers) for i in range(steps)]
    pools, out = new_pools(), {}
    for name, step in steps_fns.items():
        try:
            pools, res = time_jax_chain(make_chain(step), pools, (x, layer_ids), steps)
        except Exception as e:  # noqa: BLE001
            res = dict(error=f"{type(e).__name__}: {str(e)[:600]}")
            pools = new_pools()
        res.update(layers=layers, steps=steps)
        out[name] = res
        print(f"  {name:14} {json.dumps(res)}", flush=True)
    del pools
    return out


def run_paged_jax(case, allowed=None, peer=True):
    """Ours (default split-K, and one split: what split-K buys at batch 1) and the jnp reference
    (``layers.paged_attention`` under XLA), each a jitted chain of decode steps over donated pools
    (``time_paged_chains``). Extend cases go to ``run_paged_extend_jax`` (``peer`` is theirs)."""
    if case["kind"] == "paged_extend":
        return run_paged_extend_jax(case, allowed, peer)
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxserve.models.layers import Ragged
    from jaxserve.models.layers import paged_attention as paged_attention_jnp
    from pallas_kernels.paged_attention import paged_attention

    B, ctx, nh, nkv, hd, ps = (case[n] for n in ("B", "ctx", "nh", "nkv", "hd", "page_size"))
    layers, steps = paged_layout(case)
    pages_per_row = ctx // ps
    num_pages = B * pages_per_row + 1
    rng = np.random.default_rng(B * 7 + ctx)
    table = (rng.permutation(num_pages - 1) + 1).astype(np.int32).reshape(B, pages_per_row)
    z = jnp.zeros(1, jnp.int32)
    r = Ragged(positions=jnp.full((B,), ctx - 1, jnp.int32), cu_seqlens=jnp.arange(B + 1, dtype=jnp.int32),
               seq=jnp.arange(B, dtype=jnp.int32), context_len=jnp.full((B,), ctx - 1, jnp.int32),
               page_table=jnp.asarray(table), read_slot=z, write_slot=z, snap_seq=z, snap_len=z, snap_dst=z)
    keys = jax.random.split(jax.random.key(3), 5)
    x = dict(q=jax.random.normal(keys[0], (B, nh, hd), jnp.bfloat16),
             k=jax.random.normal(keys[1], (B, nkv, hd), jnp.bfloat16),
             v=jax.random.normal(keys[2], (B, nkv, hd), jnp.bfloat16))
    interpret = bool(os.environ.get("KERNELS_SMOKE"))
    variants = {"ours_auto": dict(), "ours_nosplit": dict(num_splits=1)}
    steps_fns = {}
    for name, kw in variants.items():
        if allowed is not None and "paged" not in allowed:
            continue
        steps_fns[name] = (lambda kw: lambda x, kp, vp, layer: paged_attention(
            x["q"], x["k"], x["v"], kp, vp, layer, r, None, decode=True, interpret=interpret, **kw))(kw)
    steps_fns["jnp"] = lambda x, kp, vp, layer: paged_attention_jnp(x["q"], x["k"], x["v"], kp, vp, layer, r, None)
    out = {n: dict(error="not run: failed or missing in gpu_check") for n in variants if n not in steps_fns}
    new_pools = lambda: tuple(random_paged_pool(k, layers, num_pages, ps, nkv, hd) for k in keys[3:])  # noqa: E731
    out.update(time_paged_chains(steps_fns, new_pools, x, layers, steps))
    return out


def run_paged_extend_jax(case, allowed=None, peer=True):
    """Ours (``decode=False``: query tiles of 64 // G tokens of a row, default split-K) and the jnp
    reference on one extend batch (``random_paged_batch``: each row's pages random pages of the
    pool), each a jitted chain of extend steps (write the new K/V into the pages, attend) over
    donated pools (``time_paged_chains``); then, unless ``peer`` is False, the cuDNN peer on the
    same tokens, returned under ``"peer"`` (a failure is recorded there, never raised)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxserve.models.layers import Ragged
    from jaxserve.models.layers import paged_attention as paged_attention_jnp
    from pallas_kernels.paged_attention import paged_attention, random_paged_batch

    B, new, ctx, nh, nkv, hd, ps = (case[n] for n in ("B", "new", "ctx", "nh", "nkv", "hd", "page_size"))
    layers, steps = paged_layout(case)
    batch, ragged = random_paged_batch(np.random.default_rng(B * 7 + ctx + new), [ctx] * B, [new] * B,
                                       nh=nh, nkv=nkv, hd=hd, page_size=ps)
    num_pages = batch["k_pool"].shape[1]  # its one-layer pools are not used: ours are ``layers`` deep
    z = jnp.zeros(1, jnp.int32)
    r = Ragged(**{n: jnp.asarray(a) for n, a in ragged.items()}, read_slot=z, write_slot=z, snap_seq=z,
               snap_len=z, snap_dst=z)
    x = {n: jnp.asarray(batch[n], jnp.bfloat16) for n in ("q", "k", "v")}
    del batch
    keys = jax.random.split(jax.random.key(4), 2)
    new_pools = lambda: tuple(random_paged_pool(k, layers, num_pages, ps, nkv, hd) for k in keys)  # noqa: E731
    interpret = bool(os.environ.get("KERNELS_SMOKE"))
    steps_fns, out = {}, {}
    if allowed is None or "paged" in allowed:
        steps_fns["ours_auto"] = lambda x, kp, vp, layer: paged_attention(
            x["q"], x["k"], x["v"], kp, vp, layer, r, None, decode=False, interpret=interpret)
    else:
        out["ours_auto"] = dict(error="not run: failed or missing in gpu_check")
    steps_fns["jnp"] = lambda x, kp, vp, layer: paged_attention_jnp(x["q"], x["k"], x["v"], kp, vp, layer, r, None)
    out.update(time_paged_chains(steps_fns, new_pools, x, layers, steps))
    if not peer:
        out["peer"] = dict(peer=f"jax.nn.dot_product_attention {PAGED_PEER_IMPL}", error="not run (--no-peer)")
        return out
    try:
        out["peer"] = paged_extend_peer(case, x, r, new_pools(), layers, steps)
    except Exception as e:  # noqa: BLE001  (e.g. no cuDNN: recorded, the run goes on)
        out["peer"] = dict(peer=f"jax.nn.dot_product_attention {PAGED_PEER_IMPL}",
                           error=f"{type(e).__name__}: {str(e)[:600]}")
    print(f"  {'peer':14} {json.dumps(out['peer'])}", flush=True)
    return out


def paged_extend_peer(case, x, r, pools, layers, steps):
    """cuDNN flash attention (``jax.nn.dot_product_attention``, implementation PAGED_PEER_IMPL) on the
    extend case's tokens, timed as ours is (a jitted chain of ``steps`` calls, step i on layer
    i % layers' K/V, CUPTI kernel time). cuDNN wants contiguous K/V: each row's cached K/V is
    gathered from the pages into dense ``[B, ctx, nkv, hd]`` arrays (and the new tokens' K/V copied
    per layer) outside the timing; only the attention (and the merge below) is timed, not the page
    write ours does. jax 0.11.2's cuDNN causal mask is top-left aligned (query i sees keys 0..i);
    rows with cached context need it bottom-right aligned (keys 0..ctx+i), so they are timed two
    ways and the faster is reported: "mask", one call over all ctx + new keys with that mask as an
    additive bf16 bias (precomputed; cuDNN then computes the whole new x (ctx + new) rectangle), and
    "split", the cached keys unmasked plus the new keys causal (top-left is right there), merged by
    their logsumexps (the exact work; jax hands the logsumexp back in bf16, which costs accuracy).
    Without cached context it is one causal call. Every variant's output is compared once with the
    jnp reference's (``o_rel_err_vs_jnp``); one further off than PAGED_PEER_TOL is not reported."""
    import jax
    import jax.numpy as jnp

    from jaxserve.models.layers import paged_attention as paged_attention_jnp

    B, new, ctx, nh, nkv, hd, ps = (case[n] for n in ("B", "new", "ctx", "nh", "nkv", "hd", "page_size"))
    o_ref = jax.jit(lambda x, kp, vp: paged_attention_jnp(x["q"], x["k"], x["v"], kp, vp, 0, r, None)[0])(x, *pools)
    kp, vp = pools
    pos = jnp.arange(ctx)
    pages = r.page_table[:, pos // ps]  # [B, ctx]: row b's cached positions, page by page
    q = x["q"].reshape(B, new, nh, hd)
    dense = []
    for layer in range(layers):  # each layer's own arrays: no step re-reads the previous one's from L2
        d = dict(kn=x["k"].reshape(B, new, nkv, hd) + 0, vn=x["v"].reshape(B, new, nkv, hd) + 0)
        if ctx:
            d.update(kc=kp[layer, pages, pos % ps], vc=vp[layer, pages, pos % ps])
            d.update(kd=jnp.concatenate([d["kc"], d["kn"]], 1), vd=jnp.concatenate([d["vc"], d["vn"]], 1))
        dense.append(d)
    del pools, kp, vp
    dpa = lambda *a, **kw: jax.nn.dot_product_attention(*a, implementation=PAGED_PEER_IMPL, **kw)  # noqa: E731
    keys_pos = jnp.arange(ctx + new)[None, :]
    visible = keys_pos <= ctx + jnp.arange(new)[:, None]  # bottom-right causal, [new, ctx + new]
    bias = jnp.where(visible, 0.0, -2.0 ** 41).astype(jnp.bfloat16)[None, None]  # as jax turns a mask into bias

    def merge(a, b):
        """Softmax over the union of two key sets from each part's output and logsumexp."""
        (oa, la), (ob, lb) = a, b
        la, lb = la.astype(jnp.float32)[..., None], lb.astype(jnp.float32)[..., None]
        m = jnp.maximum(la, lb)
        wa, wb = jnp.exp(la - m), jnp.exp(lb - m)
        return ((oa.astype(jnp.float32) * wa + ob.astype(jnp.float32) * wb) / (wa + wb)).astype(oa.dtype)

    variants = {"causal": (lambda q, d, bias: dpa(q, d["kn"], d["vn"], is_causal=True), ("kn", "vn"))}
    if ctx:
        variants = {
            "mask": (lambda q, d, bias: dpa(q, d["kd"], d["vd"], bias=bias), ("kd", "vd")),
            "split": (lambda q, d, bias: merge(dpa(q, d["kc"], d["vc"], return_residual=True),
                                               dpa(q, d["kn"], d["vn"], is_causal=True, return_residual=True)),
                      ("kc", "vc", "kn", "vn")),
        }
    res = {}
    for name, (fn, names) in variants.items():
        args = [{n: d[n] for n in names} for d in dense]
        call = jax.jit(fn)

        def chain(state, q, args, bias):
            return state, [call(q, args[i % layers], bias) for i in range(steps)]
        try:
            o = call(q, args[0], bias).reshape(B * new, nh * hd).astype(jnp.float32)
            err = float(jnp.linalg.norm(o - o_ref.astype(jnp.float32)) / jnp.linalg.norm(o_ref.astype(jnp.float32)))
            _, res[name] = time_jax_chain(jax.jit(chain), None, (q, args, bias), steps)
            res[name]["o_rel_err_vs_jnp"] = err
        except Exception as e:  # noqa: BLE001
            res[name] = dict(error=f"{type(e).__name__}: {str(e)[:600]}")
    t = lambda r: r.get("kernel_ms", r.get("wall_ms"))  # noqa: E731
    ok = {n: v for n, v in res.items() if "error" not in v and v["o_rel_err_vs_jnp"] <= PAGED_PEER_TOL}
    out = dict(peer=f"jax.nn.dot_product_attention {PAGED_PEER_IMPL}", variants=res, layers=layers, steps=steps)
    if not ok:
        why = "; ".join(f"{n}: {v['error'][:200]}" if "error" in v else f"{n}: rel err {v['o_rel_err_vs_jnp']:.2g}"
                        for n, v in res.items())
        return dict(out, error=f"no variant ran within {PAGED_PEER_TOL} of the jnp output ({why})")
    best = min(ok, key=lambda n: t(ok[n]))
    out.update({k: ok[best][k] for k in ("kernel_ms", "wall_ms") if k in ok[best]}, variant=best)
    out["peer"] += f" ({best})"
    how = f"the faster of {' / '.join(variants)}" if ctx else "one causal call"
    out["note"] = f"peer: {how}, attention only (ours also writes the K/V pages)"
    return out


# ------------------------------------------------------------------------------------------------
# GDN / KDA chunked prefill (pallas_kernels/gdn_chunked.py: jnp UT transform + Mosaic GPU recurrence)
# ------------------------------------------------------------------------------------------------

# Qwen3-Next GDN layers (16 k-heads, 32 v-heads, d 128) and Kimi-Linear KDA layers
# (DECODE_MODELS["kda"]: 32 k- and v-heads, d 128, a per-channel gate g [T, Hv, dk]), bf16
# activations, fp32 gates and states. A case is one prefill call over ``tokens`` tokens, the same
# layouts for both: one sequence (start_pos 0) or a ragged batch (random lengths, random start
# positions, so most sequences start mid-chunk). Each sequence asks for one snapshot, at its last
# x64 boundary (what the radix cache keeps). Roofline: the bytes the call must move (q, k, v, g,
# beta read once, o written once, initial and final states and the snapshots).
# Peer: fla's chunk_gated_delta_rule (GDN) or chunk_kda (KDA) on the same tokens (cu_seqlens, one
# initial state per sequence; its chunks start at each sequence's first token, it has no start_pos,
# no snapshots). Ours is the same kernel for both (gdn_chunked_pallas takes a KDA gate); the jnp
# reference is gdn_chunked or kda_chunked.
CHUNKED_MODEL = dict(model="Qwen3-Next", Hk=16, Hv=32, dk=128, dv=128)
CHUNKED_TOKENS = (8192, 65536)
CHUNKED_RAGGED_SEQS = {8192: 8, 65536: 16}
if os.environ.get("KERNELS_SMOKE"):
    CHUNKED_MODEL = dict(CHUNKED_MODEL, Hk=1, Hv=2, dk=64, dv=64)
    CHUNKED_TOKENS, CHUNKED_RAGGED_SEQS = (256,), {256: 3}
# Kernel variants timed: WGMMA operands fp32 (tf32 on the GPU) or bf16; gated by gpu_check's rows.
# name -> (WGMMA operand dtype, precision of the XLA intra-chunk products); "default" prep is the
# TF32 experiment (gdn_chunked_pallas's prep_precision), timed beside the shipped "highest".
CHUNKED_VARIANTS = {"chunked_f32mm": ("float32", "highest"), "chunked_bf16mm": ("bfloat16", "highest"),
                    "chunked_f32mm_tf32prep": ("float32", "default"),
                    "chunked_bf16mm_tf32prep": ("bfloat16", "default")}
CHECKED_AS.update(chunked_f32mm="chunked_float32mm", chunked_bf16mm="chunked_bfloat16mm",
                  chunked_f32mm_tf32prep="chunked_float32mm_defaultprep",
                  chunked_bf16mm_tf32prep="chunked_bfloat16mm_defaultprep")


def chunked_cases(quick=False):
    tokens = CHUNKED_TOKENS[:1] if quick else CHUNKED_TOKENS
    models = dict(gdn=CHUNKED_MODEL, kda=DECODE_MODELS["kda"])  # smoke: both already shrunk
    return [dict(suite="chunked", kind=kind, tokens=T, ragged=ragged, **models[kind])
            for kind in ("gdn", "kda") for T in tokens for ragged in (False, True)]


def chunked_case_key(m):
    seqs = f"{CHUNKED_RAGGED_SEQS[m['tokens']]} seqs ragged" if m["ragged"] else "1 seq"
    return (f"{m['kind']}_chunked_prefill",
            f"T={m['tokens']} {seqs} Hk={m['Hk']} Hv={m['Hv']} dk={m['dk']} dv={m['dv']} ({m['model']})")


def chunked_layout(case):
    """(lens, start_pos, snapshot_len) of the case's sequences: fixed per case (seeded by its shape)."""
    import numpy as np

    T = case["tokens"]
    rng = np.random.default_rng(T + case["ragged"])
    if case["ragged"]:
        n = CHUNKED_RAGGED_SEQS[T]
        lens = random_lens(rng, T, n)
        start = rng.integers(0, 4096, n)
    else:
        lens, start = np.array([T]), np.array([0])
    snap = np.maximum((start + lens) // 64 * 64 - start, 0)  # last x64 boundary (0: the initial state)
    return lens.astype(np.int32), start.astype(np.int32), snap.astype(np.int32)


def random_lens(rng, T, n):
    """``n`` sequence lengths (>= 1) summing to ``T``, cut at random points."""
    import numpy as np

    cuts = np.sort(rng.choice(np.arange(1, T), n - 1, replace=False))
    return np.diff(np.concatenate([[0], cuts, [T]]))


def chunked_bytes(case):
    """Bytes the call must move: q, k, v (bf16), g (fp32: [T, Hv] for GDN, [T, Hv, dk] for KDA) and
    beta (bf16) read once, o (bf16) written once, and per sequence the fp32 initial state read, the
    final state and one snapshot written."""
    T, Hk, Hv, dk, dv = (case[n] for n in ("tokens", "Hk", "Hv", "dk", "dv"))
    n = len(chunked_layout(case)[0])
    gate = 4 * (dk if case["kind"] == "kda" else 1)
    activations = T * (2 * Hk * dk * 2 + Hv * dv * 2 + Hv * (gate + 2) + Hv * dv * 2)  # q k v g beta in, o out
    return activations + 3 * n * Hv * dk * dv * 4  # initial states in, finals and snapshots out


def chunked_flops(case):
    """Matmul FLOPs of the chunked form (per chunk and value head, C = 64): K Kᵀ and Q Kᵀ scores
    (2·C²·dk each), T applied to beta·v and beta·k·e^G (2·C²·(dv + dk)), and the recurrence's
    w S, (q e^G) S, (k e^(G_last - G))ᵀ v_new (2·C·dk·dv each) and qk v_new (2·C²·dv). With the
    measured tf32 matrix rate this is the compute floor beside the byte roofline (METHOD.md).
    KDA: the same matmul FLOPs (its per-channel decayed scores are products of gated operands,
    q e^G against k e^-G, as fla forms them; our XLA terms form them elementwise over [C, C, dk],
    more than this floor) plus the per-channel gate work a scalar gate does not have: the cumulative
    sum of g and an exp and a multiply on each of the four gated [C, dk] operands (q e^G, k e^G,
    k e^-G, k e^(G_last - G)), 9·C·dk per chunk and head (under 1% of the matmuls; GDN's scalar
    gating and both forms' state decay, dk·dv multiplies per chunk, are not counted)."""
    C, dk, dv = 64, case["dk"], case["dv"]
    lens, start, _ = chunked_layout(case)
    chunks = int(sum(-(-(s % C + n) // C) for n, s in zip(lens.tolist(), start.tolist())))
    per = 2 * C * C * dk * 2 + 2 * C * C * (dk + dv) + 3 * 2 * C * dk * dv + 2 * C * C * dv
    if case["kind"] == "kda":
        per += 9 * C * dk
    return chunks * case["Hv"] * per


def chunked_inputs_np(case, seed=0):
    import numpy as np

    rng = np.random.default_rng(seed)
    T, Hk, Hv, dk, dv = (case[n] for n in ("tokens", "Hk", "Hv", "dk", "dv"))
    f32 = lambda *s: rng.standard_normal(size=s, dtype=np.float32)  # noqa: E731
    g_shape = (T, Hv, dk) if case["kind"] == "kda" else (T, Hv)
    return dict(q=f32(T, Hk, dk), k=f32(T, Hk, dk), v=f32(T, Hv, dv),
                g=-rng.uniform(0.0, 1.0, size=g_shape).astype(np.float32),
                beta=rng.uniform(0.0, 1.0, size=(T, Hv)).astype(np.float32))


def run_chunked_jax(case, allowed=None):
    """Ours (each WGMMA operand dtype gpu_check passed) and ``gdn_chunked`` (GDN) or ``kda_chunked``
    (KDA) under XLA: a jitted chain of ``steps`` prefill calls, each one's final states the next
    one's initial states (donated)."""
    from pallas_kernels.gdn_chunked import gdn_chunked_pallas
    from pallas_kernels.gdn_reference import gdn_chunked
    from pallas_kernels.kda_reference import kda_chunked

    idx, interpret = chunked_indices(case)
    fns, out = {}, {}
    for name, (mm, prep) in CHUNKED_VARIANTS.items():
        if allowed is not None and name not in allowed:
            out[f"ours_{name}"] = dict(error="not run: failed or missing in gpu_check")
            continue
        fns[f"ours_{name}"] = (lambda mm, prep: lambda x, s: gdn_chunked_pallas(
            **x, **idx, initial_state=s, matmul_dtype=mm, prep_precision=prep, interpret=interpret))(mm, prep)
    reference = kda_chunked if case["kind"] == "kda" else gdn_chunked
    fns["jnp"] = lambda x, s: reference(**x, **idx, initial_state=s)
    return time_chunked(case, fns, out, width=20)


def chunked_indices(case):
    """The chunked suites' ragged arguments on the device (``cu_seqlens``, ``start_pos``, one
    snapshot per sequence) and whether to interpret (``KERNELS_SMOKE``, the CPU smoke run)."""
    import jax.numpy as jnp
    import numpy as np

    lens, start, snap = chunked_layout(case)
    idx = dict(cu_seqlens=jnp.asarray(np.concatenate([[0], np.cumsum(lens)]), jnp.int32),
               start_pos=jnp.asarray(start), snapshot_seq=jnp.arange(len(lens), dtype=jnp.int32),
               snapshot_len=jnp.asarray(snap))
    return idx, bool(os.environ.get("KERNELS_SMOKE"))


def time_chunked(case, fns, out, width):
    """Time each of ``fns`` (``(inputs, state) -> (o, state, snapshots)``) into ``out[name]``: a jitted
    chain of ``steps`` prefill calls on the case's bf16 inputs (fp32 g), each one's final states the
    next one's initial states (donated). Returns ``out``; ``width`` aligns the printed names."""
    import jax
    import jax.numpy as jnp

    lens, _, _ = chunked_layout(case)
    steps = 1 if os.environ.get("KERNELS_SMOKE") or case["tokens"] > 16384 else 4
    dt = dict(q=jnp.bfloat16, k=jnp.bfloat16, v=jnp.bfloat16, g=jnp.float32, beta=jnp.bfloat16)
    xd = {n: jnp.asarray(a, dt[n]) for n, a in chunked_inputs_np(case).items()}

    def make_chain(call):
        call = jax.jit(call)

        def chain(state, x):
            outs = []
            for _ in range(steps):
                o, state, snaps = call(x, state)
                outs.append((o, snaps))
            return state, outs
        return jax.jit(chain, donate_argnums=(0,))

    shape = (len(lens), case["Hv"], case["dk"], case["dv"])
    for name, call in fns.items():
        state = jax.random.normal(jax.random.key(1), shape, jnp.float32) * 0.1
        try:
            hlo_name = "-".join(case_key(case)).replace(" ", "_").replace("(", "").replace(")", "") + f"-{name}"
            _, res = time_jax_chain(make_chain(call), state, (xd,), steps, hlo_name=hlo_name)
        except Exception as e:  # noqa: BLE001
            res = dict(error=f"{type(e).__name__}: {str(e)[:600]}")
        res.update(steps=steps, flops=chunked_flops(case))
        if "kernel_ms" in res:
            res["tflops"] = round(res["flops"] / (res["kernel_ms"] * 1e-3) / 1e12, 2)
        out[name] = res
        print(f"  {name:{width}} {json.dumps(res)}", flush=True)
    return out


def run_chunked_fla(case):
    """fla's chunk_gated_delta_rule (GDN) or chunk_kda (KDA, g [1, T, Hv, dk] fp32) (Triton) on the
    case's tokens, in a CUDA graph, called the same way. If this fla has no grouped value heads
    (Hv > Hk), q and k are repeated to Hv heads once, outside the timing."""
    import numpy as np
    import torch

    if case["kind"] == "kda":
        from fla.ops.kda import chunk_kda as chunk_fn
        peer = "fla chunk_kda"
    else:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule as chunk_fn
        peer = "fla chunk_gated_delta_rule"

    lens, _, _ = chunked_layout(case)
    x = chunked_inputs_np(case)
    dev = "cuda"
    dt = dict(q=torch.bfloat16, k=torch.bfloat16, v=torch.bfloat16, g=torch.float32, beta=torch.bfloat16)
    t = {n: torch.from_numpy(a).to(dev, dt[n]).unsqueeze(0) for n, a in x.items()}  # [1, T, H, ...]
    cu = torch.tensor(np.concatenate([[0], np.cumsum(lens)]), device=dev, dtype=torch.long)
    state = torch.randn(len(lens), case["Hv"], case["dk"], case["dv"], device=dev, dtype=torch.float32) * 0.1
    scale = case["dk"] ** -0.5

    def make_call(q, k):
        return lambda i: chunk_fn(q, k, t["v"], t["g"], t["beta"], scale=scale, initial_state=state,
                                  output_final_state=True, cu_seqlens=cu, use_qk_l2norm_in_kernel=True)

    how = "grouped heads"
    call = make_call(t["q"], t["k"])
    try:
        o, _ = call(0)
        assert o.shape == t["v"].shape, f"o {tuple(o.shape)}"
    except Exception as e:  # noqa: BLE001
        group = case["Hv"] // case["Hk"]
        call = make_call(t["q"].repeat_interleave(group, dim=2), t["k"].repeat_interleave(group, dim=2))
        how = f"q/k repeated to Hv heads ({type(e).__name__})"
    torch.cuda.synchronize()
    res = time_torch_graph(call, 1)
    res["peer"] = peer
    res["peer_heads"] = how
    return res


# GDN / KDA chunked prefill as one kernel (pallas_kernels/gdn_chunk_fused.py, kda_chunk_fused.py, the
# UT transform on chip): the chunked suite's GDN / KDA cases (same layouts, inputs, bytes and FLOP
# count, so its rows sit beside gdn_ / kda_chunked_prefill's), bf16 operands, its own kernel name so
# neither suite's rows replace the other's. ``baseline_chunked_bf16mm`` is gdn_chunked_pallas (XLA UT
# transform + the recurrence kernel) timed in the same run, recorded in the detail but never taken as
# ours; no jnp reference (the chunked suite times it). Peer: fla chunk_gated_delta_rule / chunk_kda
# (run_chunked_fla). FUSED_VARIANTS: kind -> the timed variant's name, gated by gpu_check's rows.
FUSED_VARIANTS = {"gdn": "fused_bf16mm", "kda": "kda_fused_bf16mm"}
CHECKED_AS.update(fused_bf16mm="gdn_fused_bf16mm", kda_fused_bf16mm="kda_fused_bf16mm")


# The gdn_prep suite: the split GDN prefill with its intra-chunk terms by pallas_kernels/gdn_chunk_prep.py
# (gdn_chunked_pallas prep="kernel", bf16 operands), the same cases and same-run baseline.
PREP_VARIANT = "prep_bf16mm"
CHECKED_AS[PREP_VARIANT] = "gdn_prep_fused_bf16mm"


def fused_cases(kind, suite=None):
    """The ``{kind}_fused`` suite's cases, or ``suite``'s (``Suite.cases`` takes ``quick``)."""
    return lambda quick=False: [dict(c, suite=suite or f"{kind}_fused") for c in chunked_cases(quick)
                                if c["kind"] == kind]


def fused_case_key(m):
    return f"{m['kind']}_chunked_prefill_{'prep' if m['suite'] == 'gdn_prep' else 'fused'}", chunked_case_key(m)[1]


def fused_kernel(kind):
    """The one-kernel prefill of ``kind``."""
    if kind == "kda":
        from pallas_kernels.kda_chunk_fused import kda_chunk_fused
        return kda_chunk_fused
    from pallas_kernels.gdn_chunk_fused import gdn_chunk_fused
    return gdn_chunk_fused


def run_fused_jax(case, allowed=None):
    """Ours (if gpu_check passed it) and today's split kernel as the same-run baseline: a jitted
    chain of ``steps`` prefill calls, each one's final states the next one's initial states. The
    ``gdn_prep`` suite's ours is the split kernel with its terms by ``gdn_chunk_prep``."""
    import functools

    from pallas_kernels.gdn_chunked import gdn_chunked_pallas

    if case["suite"] == "gdn_prep":
        fused = functools.partial(gdn_chunked_pallas, prep="kernel", matmul_dtype="bfloat16")
        variant = PREP_VARIANT
    else:
        fused, variant = fused_kernel(case["kind"]), FUSED_VARIANTS[case["kind"]]
    idx, interpret = chunked_indices(case)
    fns, out = {}, {}
    if allowed is not None and variant not in allowed:
        out[f"ours_{variant}"] = dict(error="not run: failed or missing in gpu_check")
    else:
        fns[f"ours_{variant}"] = lambda x, s: fused(**x, **idx, initial_state=s, interpret=interpret)
    fns["baseline_chunked_bf16mm"] = lambda x, s: gdn_chunked_pallas(
        **x, **idx, initial_state=s, matmul_dtype="bfloat16", interpret=interpret)
    return time_chunked(case, fns, out, width=24)


# ------------------------------------------------------------------------------------------------
# Causal conv1d (pallas_kernels/conv1d.py): the short conv in front of GDN
# ------------------------------------------------------------------------------------------------

# Qwen3-Next / Qwen3.5 GDN layers: conv dim 2 * Hk * dk + Hv * dv = 2 * 16 * 128 + 32 * 128 = 8192,
# K = 4, bf16 activations, fp32 states. Prefill: one sequence or CONV_RAGGED_SEQS[T] random ones,
# each from a random initial state, its final state and one snapshot (its last x64 boundary)
# asked for. Update: B rows of one token, each from its own state; a chain cycles through enough
# state buffers (CONV_STATE_BYTES) that no step reads a state from L2. Roofline: the bytes a call
# must move (x read, y written, states read and written) over the measured copy bandwidth.
# Peer: fla's Triton causal_conv1d / causal_conv1d_update (fla.modules.convolution) in the child
# process; its states keep K columns (ours K-1: theirs = ours with a zero column in front).
CONV_MODEL = dict(model="Qwen3-Next", C=8192, K=4)
CONV_TOKENS = (8192, 65536)
CONV_RAGGED_SEQS = {8192: 8, 65536: 16}
CONV_BATCHES = (64, 256, 512)
CONV_STATE_BYTES = 256 << 20
if os.environ.get("KERNELS_SMOKE"):
    CONV_MODEL = dict(CONV_MODEL, C=256)
    CONV_TOKENS, CONV_RAGGED_SEQS, CONV_BATCHES, CONV_STATE_BYTES = (256,), {256: 3}, (1, 3), 1 << 16
CHECKED_AS["conv1d"] = "conv1d"  # gpu_check rows with variant "conv1d"


def conv1d_cases(quick=False):
    tokens = CONV_TOKENS[:1] if quick else CONV_TOKENS
    batches = CONV_BATCHES[:2] if quick else CONV_BATCHES
    return ([dict(suite="conv1d", kind="conv_prefill", tokens=T, ragged=ragged, **CONV_MODEL)
             for T in tokens for ragged in (False, True)]
            + [dict(suite="conv1d", kind="conv_update", B=B, **CONV_MODEL) for B in batches])


def conv1d_case_key(m):
    if m["kind"] == "conv_update":
        return "conv1d_update", f"B={m['B']} C={m['C']} K={m['K']} ({m['model']})"
    seqs = f"{CONV_RAGGED_SEQS[m['tokens']]} seqs ragged" if m["ragged"] else "1 seq"
    return "conv1d_prefill", f"T={m['tokens']} {seqs} C={m['C']} K={m['K']} ({m['model']})"


def conv1d_lens(case):
    """Sequence lengths of a prefill case (fixed per case) and each one's last x64 boundary."""
    import numpy as np

    T = case["tokens"]
    lens = random_lens(np.random.default_rng(T + case["ragged"]), T, CONV_RAGGED_SEQS[T] if case["ragged"] else 1)
    return lens, lens // 64 * 64


def conv1d_bytes(case):
    """x read and y written (bf16), and per sequence the fp32 state read and written (prefill:
    the final state and one snapshot)."""
    C, km1 = case["C"], case["K"] - 1
    if case["kind"] == "conv_update":
        return case["B"] * C * (2 * 2 + km1 * 4 * 2)
    return case["tokens"] * C * 2 * 2 + len(conv1d_lens(case)[0]) * C * km1 * 4 * 3


def conv1d_inputs_np(case, seed=0):
    import numpy as np

    rng = np.random.default_rng(seed)
    rows = case["tokens"] if case["kind"] == "conv_prefill" else case["B"]
    f32 = lambda *s: rng.standard_normal(size=s, dtype=np.float32)  # noqa: E731
    return dict(x=f32(rows, case["C"]), weight=f32(case["C"], case["K"]) * np.float32(0.5), bias=f32(case["C"]))


def conv1d_chain_layout(case):
    """(steps, state buffers) of a timed chain: prefill threads its final states through ``steps``
    calls; an update chain cycles through enough buffers that every step reads states not in L2."""
    if os.environ.get("KERNELS_SMOKE"):
        return 2, 2
    if case["kind"] == "conv_prefill":
        return (4 if case["tokens"] <= 16384 else 1), 1
    per = case["B"] * case["C"] * (case["K"] - 1) * 4
    bufs = max(2, -(-CONV_STATE_BYTES // per))
    return max(bufs, 8), bufs


def run_conv1d_jax(case, allowed=None):
    """Ours and the jnp reference under XLA: a jitted chain of ``steps`` calls, states donated."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from pallas_kernels import conv1d
    from pallas_kernels.conv1d_reference import causal_conv1d_prefill, causal_conv1d_update

    steps, bufs = conv1d_chain_layout(case)
    x = conv1d_inputs_np(case)
    xd = dict(x=jnp.asarray(x["x"], jnp.bfloat16), weight=jnp.asarray(x["weight"]), bias=jnp.asarray(x["bias"]))
    interpret = bool(os.environ.get("KERNELS_SMOKE"))
    C, km1 = case["C"], case["K"] - 1
    if case["kind"] == "conv_prefill":
        lens, snap = conv1d_lens(case)
        idx = dict(cu_seqlens=jnp.asarray(np.concatenate([[0], np.cumsum(lens)]), jnp.int32),
                   snapshot_seq=jnp.arange(len(lens), dtype=jnp.int32), snapshot_len=jnp.asarray(snap, jnp.int32))
        ours = lambda x, s: conv1d.causal_conv1d_prefill_pallas(**x, **idx, initial_state=s, interpret=interpret)  # noqa: E731
        ref = lambda x, s: causal_conv1d_prefill(**x, **idx, initial_state=s)  # noqa: E731
        rows = len(lens)
    else:
        ours = lambda x, s: conv1d.causal_conv1d_update_pallas(x["x"], s, x["weight"], x["bias"], interpret=interpret)  # noqa: E731
        ref = lambda x, s: causal_conv1d_update(x["x"], s, x["weight"], x["bias"])  # noqa: E731
        rows = case["B"]
    fns = {"jnp": ref}
    if allowed is None or "conv1d" in allowed:
        fns = {"ours_conv1d": ours, **fns}
    out = {} if "ours_conv1d" in fns else {"ours_conv1d": dict(error="not run: failed or missing in gpu_check")}

    def make_chain(call):
        call = jax.jit(call)

        def chain(states, x):
            states, outs = list(states), []
            for i in range(steps):
                y, states[i % bufs], *snaps = call(x, states[i % bufs])
                outs.append((y, snaps))
            return tuple(states), outs
        return jax.jit(chain, donate_argnums=(0,))

    for name, call in fns.items():
        states = tuple(jax.random.normal(jax.random.key(i), (rows, C, km1), jnp.float32) for i in range(bufs))
        try:
            _, res = time_jax_chain(make_chain(call), states, (xd,), steps)
        except Exception as e:  # noqa: BLE001
            res = dict(error=f"{type(e).__name__}: {str(e)[:600]}")
        res.update(steps=steps, state_buffers=bufs)
        out[name] = res
        print(f"  {name:14} {json.dumps(res)}", flush=True)
    return out


def run_conv1d_fla(case):
    """fla's Triton causal_conv1d (prefill, cu_seqlens, one initial state per sequence) or
    causal_conv1d_update (decode, its cache updated in place) on the case's inputs, in a CUDA graph."""
    import numpy as np
    import torch
    from fla.modules.convolution import causal_conv1d, causal_conv1d_update

    steps, bufs = conv1d_chain_layout(case)
    x = conv1d_inputs_np(case)
    dev = "cuda"
    xt = torch.from_numpy(x["x"]).to(dev, torch.bfloat16)
    w, b = torch.from_numpy(x["weight"]).to(dev), torch.from_numpy(x["bias"]).to(dev)
    C, K = case["C"], case["K"]
    if case["kind"] == "conv_prefill":
        lens, _ = conv1d_lens(case)
        cu = torch.tensor(np.concatenate([[0], np.cumsum(lens)]), device=dev, dtype=torch.long)
        state = torch.randn(len(lens), C, K, device=dev, dtype=torch.float32)

        def call(i):
            return causal_conv1d(xt.unsqueeze(0), weight=w, bias=b, initial_state=state, output_final_state=True,
                                 activation="silu", cu_seqlens=cu)
        peer = "fla causal_conv1d (Triton)"
    else:
        caches = [torch.randn(case["B"], C, K, device=dev, dtype=torch.bfloat16) for _ in range(bufs)]

        def call(i):
            return causal_conv1d_update(xt.unsqueeze(1), caches[i % bufs], weight=w, bias=b, activation="silu")
        peer = "fla causal_conv1d_update"
    res = time_torch_graph(call, steps)
    res["peer"] = peer
    return res


# ------------------------------------------------------------------------------------------------
# MoE routed experts (pallas_kernels/moe.py): grouped GEMM kernel vs lax.ragged_dot vs the gather path
# ------------------------------------------------------------------------------------------------

SMALL_ON = 1 << 30  # small_max_rows of the moe_small* variants: their path whatever SMALL_PATH_ON says
# The target layer: hidden 2048, 64 experts top-8, expert intermediate 512, bf16: gate_up [64, 2048,
# 1024] and down [64, 512, 2048], 384 MiB a layer. A case is n tokens routed uniformly at random
# (k distinct experts each, weights summing to 1), fresh routing at every step of a chain, the steps
# alternating between MOE_LAYERS copies of the weights so no step finds its experts in L2 (a batch-1
# step's 8 experts are 48 MiB, about the L2). Timed: ours (the 64-row grouped kernel through
# ``moe_experts``, its 4- and 2-stage rings, forced at every n; the swap-AB small path, moe_experts'
# default at n * k <= moe.SMALL_MAX_ROWS, at n <= 64: its default 8-row tiles with 4- and 2-stage
# rings, 16-row tiles and its transposed-store variant; the gather path ``moe_experts_gather`` at n <= 32),
# jnp = ``layers.routed_experts`` (``lax.ragged_dot``). Roofline: the bytes a step must move (the
# weights of the distinct experts it uses, x read, the fp32 output written) over the copy bandwidth,
# or, where the step's FLOPs over its bytes exceed MOE_BALANCE, its FLOP floor (2 n k 3 H I) over the
# measured bf16 matmul rate; each record's detail keeps both counts ("cost").
MOE_BENCH_MODEL = dict(model="target MoE", E=64, k=8, H=2048, I=512)
MOE_TOKENS = (1, 8, 32, 512, 4096)
MOE_LAYERS = 2
MOE_GATHER_MAX_TOKENS = 32  # the gather path materialises n * k experts' weights (1.5 GiB at n = 32)
MOE_SMALL_MAX_TOKENS = 64  # moe.SMALL_MAX_ROWS (512) routed rows of top-8
MOE_BALANCE = 230  # FLOP per byte where the H200's bf16 rate (~990 TFLOP/s) meets its copy bandwidth (~4.3 TB/s)
MOE_VARIANTS_TIMED = {"moe_s4": dict(gather_below=0, small_max_rows=0),
                      "moe_s2": dict(gather_below=0, small_max_rows=0, stages=2),
                      "moe_small": dict(gather_below=0, small_max_rows=SMALL_ON),
                      "moe_small_s2": dict(gather_below=0, small_max_rows=SMALL_ON, stages=2),
                      "moe_small_r16": dict(gather_below=0, small_max_rows=SMALL_ON, block_rows=16),
                      "moe_small_tr": dict(gather_below=0, small_max_rows=SMALL_ON, small_transposed_out=True), "moe_gather": None}
if os.environ.get("KERNELS_SMOKE"):
    MOE_BENCH_MODEL = dict(MOE_BENCH_MODEL, E=8, k=2, H=64, I=64)
    MOE_TOKENS, MOE_GATHER_MAX_TOKENS = (1, 40), 1
CHECKED_AS.update({n: n for n in MOE_VARIANTS_TIMED})  # gpu_check rows with the same variant names


def moe_cases(quick=False):
    tokens = (MOE_TOKENS[0], MOE_TOKENS[-1]) if quick else MOE_TOKENS
    return [dict(suite="moe", kind="moe", tokens=n, **MOE_BENCH_MODEL) for n in tokens]


def moe_case_key(m):
    return "moe_experts", f"n={m['tokens']} E={m['E']} top{m['k']} H={m['H']} I={m['I']} ({m['model']})"


def moe_steps(case):
    if os.environ.get("KERNELS_SMOKE"):
        return 2
    return {1: 16, 8: 16, 32: 8, 512: 4}.get(case["tokens"], 2)


def moe_routings(case):
    """Per step of a chain: (top_w [n, k] fp32, top_i [n, k] int32), fixed per case."""
    import numpy as np

    rng = np.random.default_rng(case["tokens"])
    n, E, k = case["tokens"], case["E"], case["k"]
    out = []
    for _ in range(moe_steps(case)):
        top_i = np.argsort(rng.random((n, E)), axis=1)[:, :k].astype(np.int32)
        w = np.exp(rng.normal(size=(n, k)))
        out.append(((w / w.sum(1, keepdims=True)).astype(np.float32), top_i))
    return out


def moe_cost(case):
    """(bytes, FLOPs) a step must move / do, averaged over the chain's steps: each distinct expert's
    gate_up and down once (bf16), x read (bf16) and the fp32 output written; 2 n k (2HI + IH) FLOPs."""
    import numpy as np

    n, H, I = case["tokens"], case["H"], case["I"]
    used = np.mean([len(np.unique(top_i)) for _, top_i in moe_routings(case)])
    nbytes = int(used * 3 * H * I * 2 + n * H * 2 + n * H * 4)
    return nbytes, 2 * n * case["k"] * 3 * H * I


def moe_bytes(case):
    return moe_cost(case)[0]


def moe_flops(case):
    """The FLOP floor where it is the larger one (FLOP / byte above MOE_BALANCE: prefill), else None."""
    nbytes, flops = moe_cost(case)
    return flops if flops > MOE_BALANCE * nbytes else None


def run_moe_jax(case, allowed=None):
    """Ours (each variant the GPU check passed) and ``lax.ragged_dot`` under XLA: a jitted chain of
    ``moe_steps`` layer calls, fresh routing each step, weights alternating between MOE_LAYERS copies."""
    import jax
    import jax.numpy as jnp

    from jaxserve.models.layers import routed_experts
    from pallas_kernels import moe

    n, E, k, H, I = (case[x] for x in ("tokens", "E", "k", "H", "I"))
    steps = moe_steps(case)
    interpret = bool(os.environ.get("KERNELS_SMOKE"))
    keys = jax.random.split(jax.random.key(7), 2 * MOE_LAYERS + 1)
    gate_up = [(jax.random.normal(keys[2 * i], (E, H, 2 * I), jnp.float32) * H ** -0.5).astype(jnp.bfloat16)
               for i in range(MOE_LAYERS)]
    down = [(jax.random.normal(keys[2 * i + 1], (E, I, H), jnp.float32) * I ** -0.5).astype(jnp.bfloat16)
            for i in range(MOE_LAYERS)]
    routes = [(jnp.asarray(w), jnp.asarray(i)) for w, i in moe_routings(case)]
    nbytes, flops = moe_cost(case)
    out = {"cost": dict(bytes=nbytes, flops=flops, steps=steps)}
    fns = {}
    for name, kw in MOE_VARIANTS_TIMED.items():
        if kw is None and n > MOE_GATHER_MAX_TOKENS:
            continue
        if name.startswith("moe_small") and n > MOE_SMALL_MAX_TOKENS:
            continue
        if allowed is not None and name not in allowed:
            out[f"ours_{name}"] = dict(error="not run: failed or missing in gpu_check")
            continue
        fns[f"ours_{name}"] = (moe.moe_experts_gather if kw is None else
                               (lambda kw: lambda *a: moe.moe_experts(*a, interpret=interpret, **kw))(kw))
    fns["jnp"] = lambda x, w, i, g, d: routed_experts(x, w.astype(x.dtype), i, g, d)

    def make_chain(call):
        call = jax.jit(call)

        def chain(x, routes, gate_up, down):
            outs = []
            for s in range(steps):
                outs.append(call(x, *routes[s], gate_up[s % MOE_LAYERS], down[s % MOE_LAYERS]))
            return x, outs
        return jax.jit(chain, donate_argnums=(0,))

    for name, call in fns.items():
        x = jax.random.normal(keys[-1], (n, H), jnp.float32).astype(jnp.bfloat16)
        try:
            _, res = time_jax_chain(make_chain(call), x, (routes, gate_up, down), steps)
        except Exception as e:  # noqa: BLE001  (e.g. ragged_dot's dense temporaries at prefill)
            res = dict(error=f"{type(e).__name__}: {str(e)[:600]}")
        out[name] = res
        print(f"  {name:16} {json.dumps(res)}", flush=True)
    return out


# ------------------------------------------------------------------------------------------------
# Decode-step dense projections (pallas_kernels/linear_small.py) vs XLA's dot
# ------------------------------------------------------------------------------------------------

# The target model's dense weights (bf16 [K, N]) at the decode step's row counts. A chain step
# multiplies by a different copy of the weight (LINEAR_COPIES of them, > 4x the 50 MB L2 for the
# small ones), so no step reads its weight from L2. Roofline: the weight's bytes (plus x and the
# output) over the copy bandwidth. Ours: ``linear_small`` at its default K splits, one split forced
# (4-stage ring) and one split with a 12-stage ring (more bytes in flight per SM, no epilogue); jnp: ``x @ w`` as XLA compiles it (a reduction at M = 1, a GEMM above).
LINEAR_SHAPES = {"in_proj_qkv": (2048, 8192), "in_proj_z": (2048, 4096), "out_proj": (4096, 2048),
                 "k_proj": (2048, 512), "shared_down": (512, 2048), "lm_head": (2048, 151936)}
LINEAR_ROWS = (1, 8, 32)
LINEAR_VARIANTS = {"linear": dict(), "linear_s1": dict(num_splits=1), "linear_deep": dict(num_splits=1, stages=12)}
if os.environ.get("KERNELS_SMOKE"):
    LINEAR_SHAPES, LINEAR_ROWS = {"out_proj": (256, 128)}, (1,)
CHECKED_AS.update({n: n for n in LINEAR_VARIANTS})  # gpu_check rows with the same variant names


def linear_cases(quick=False):
    shapes = {k: LINEAR_SHAPES[k] for k in list(LINEAR_SHAPES)[:2]} if quick else LINEAR_SHAPES
    return [dict(suite="linear", kind="linear", name=n, K=K, N=N, M=m, model="target MoE")
            for n, (K, N) in shapes.items() for m in LINEAR_ROWS]


def linear_case_key(m):
    return "linear_small", f"{m['name']} M={m['M']} K={m['K']} N={m['N']} ({m['model']})"


def linear_copies(case):
    return max(2, -(-(256 << 20) // (case["K"] * case["N"] * 2)))  # >= 256 MiB of distinct weights


def linear_bytes(case):
    return case["K"] * case["N"] * 2 + case["M"] * (case["K"] + case["N"]) * 2


def run_linear_jax(case, allowed=None):
    """Ours (each variant the GPU check passed) and XLA's dot: a jitted chain of ``copies`` products,
    each by a different copy of the weight."""
    import jax
    import jax.numpy as jnp

    from pallas_kernels.linear_small import linear_small, splits

    K, N, M = case["K"], case["N"], case["M"]
    interpret = bool(os.environ.get("KERNELS_SMOKE"))
    dt = jnp.float32 if interpret else jnp.bfloat16
    copies = 2 if interpret else linear_copies(case)
    keys = jax.random.split(jax.random.key(11), copies)
    ws = [(jax.random.normal(k, (K, N), jnp.float32) * K ** -0.5).astype(dt) for k in keys]  # separate buffers
    out = {"cost": dict(bytes=linear_bytes(case), steps=copies, splits=splits(M, K, N, dt))}
    fns = {}
    for name, kw in LINEAR_VARIANTS.items():
        if allowed is not None and name not in allowed:
            out[f"ours_{name}"] = dict(error="not run: failed or missing in gpu_check")
            continue
        fns[f"ours_{name}"] = (lambda kw: lambda x, w: linear_small(x, w, interpret=interpret, **kw))(kw)
    fns["jnp"] = lambda x, w: x @ w

    def make_chain(call):
        call = jax.jit(call)

        def chain(x, ws):
            return x, [call(x, ws[c]) for c in range(copies)]
        return jax.jit(chain, donate_argnums=(0,))

    for name, call in fns.items():
        x = jax.random.normal(jax.random.key(12), (M, K), jnp.float32).astype(dt)
        try:
            _, res = time_jax_chain(make_chain(call), x, (ws,), copies)
        except Exception as e:  # noqa: BLE001
            res = dict(error=f"{type(e).__name__}: {str(e)[:600]}")
        out[name] = res
        print(f"  {name:16} {json.dumps(res)}", flush=True)
    return out


@dataclasses.dataclass
class Suite:
    cases: Callable[[bool], list]
    run_jax: Callable[..., dict]
    state_bytes: Callable[[dict], int]
    has_peer: bool = True  # fla has a kernel to time against (in the child process)
    # run_jax times a peer in this process (it takes ``peer=``) and returns it as its "peer" entry
    in_process_peer: bool = False
    # FLOPs whose floor over the measured matmul rate is a case's roofline (None: the bytes' floor)
    flops: Callable[[dict], int | None] | None = None


SUITES = {"decode": Suite(decode_cases, run_decode_jax, decode_state_bytes),
          "paged_attention": Suite(paged_cases, run_paged_jax, paged_bytes, has_peer=False, in_process_peer=True,
                                   flops=paged_flops),
          "chunked": Suite(chunked_cases, run_chunked_jax, chunked_bytes),
          "gdn_fused": Suite(fused_cases("gdn"), run_fused_jax, chunked_bytes),
          "kda_fused": Suite(fused_cases("kda"), run_fused_jax, chunked_bytes),
          "gdn_prep": Suite(fused_cases("gdn", "gdn_prep"), run_fused_jax, chunked_bytes),
          "conv1d": Suite(conv1d_cases, run_conv1d_jax, conv1d_bytes),
          "moe": Suite(moe_cases, run_moe_jax, moe_bytes, has_peer=False, flops=moe_flops),
          "linear": Suite(linear_cases, run_linear_jax, linear_bytes, has_peer=False)}


def make_record(case, jax_res, peer_res, bandwidth_tbps, suite, matmul_tflops=None):
    """One case's record. A peer timed in this process (paged extend's cuDNN) comes back as
    ``jax_res["peer"]`` and stands in for ``peer_res`` (the fla child's). The roofline is the case's
    FLOP floor over the measured bf16 matmul rate where the suite counts one (``Suite.flops``), else
    its bytes over the measured copy bandwidth; ``roofline_basis`` says which."""
    jax_res = dict(jax_res)
    peer_res = jax_res.pop("peer", peer_res)
    kernel, shape = case_key(case)
    ours = {n: r for n, r in jax_res.items() if n.startswith("ours") and "error" not in r}
    t = lambda r: r.get("kernel_ms", r.get("wall_ms"))  # noqa: E731
    best = min(ours, key=lambda n: t(ours[n])) if ours else None
    nbytes = suite.state_bytes(case)
    flops = suite.flops(case) if suite.flops else None
    if flops and matmul_tflops:
        roofline_ms = flops / (matmul_tflops * 1e12) * 1e3
        basis = f"flops: {flops:.4g} FLOP over the measured bf16 matmul rate ({matmul_tflops:.1f} TFLOP/s)"
    else:
        roofline_ms = nbytes / (bandwidth_tbps * 1e12) * 1e3
        basis = "bytes: state_bytes over the measured copy bandwidth"
    peer_t = peer_res.get("graph_ms", t(peer_res))  # fla: CUDA-graph time; in process: as ours
    rec = dict(kernel=kernel, shape=shape,
               ours_ms=round(t(ours[best]), 5) if best else None,
               peer=peer_res.get("peer", "fla"),
               peer_ms=round(peer_t, 5) if peer_t is not None else None,
               roofline_ms=round(roofline_ms, 5), roofline_basis=basis, date=DATE,
               ours_variant=best, jnp_ms=round(t(jax_res["jnp"]), 5) if "error" not in jax_res.get("jnp", {"error": 1}) else None,
               state_bytes=nbytes, copy_bandwidth_tbps=round(bandwidth_tbps, 3),
               gpu=__import__("jax").devices()[0].device_kind)
    rec["ours_pct_roofline"] = round(100 * roofline_ms / rec["ours_ms"], 1) if rec["ours_ms"] else None
    rec["peer_pct_roofline"] = round(100 * roofline_ms / rec["peer_ms"], 1) if rec["peer_ms"] else None
    rec["jnp_pct_roofline"] = round(100 * roofline_ms / rec["jnp_ms"], 1) if rec["jnp_ms"] else None
    if flops:
        rec.update(flops=flops, matmul_tflops=round(matmul_tflops, 1) if matmul_tflops else None)
    if "error" in peer_res:
        rec["peer_error"] = peer_res["error"]
    notes = [f"roofline: FLOP floor at {matmul_tflops:.0f} TFLOP/s" if flops and matmul_tflops else "",
             peer_res.get("note", "")]
    if any(notes):
        rec["note"] = "; ".join(n for n in notes if n)
    rec["detail"] = dict(jax=jax_res, peer=peer_res)
    return rec


def merge_records(path, records):
    """Replace records with the same (kernel, shape), keep every other kernel's records."""
    old = []
    if os.path.exists(path):
        with open(path) as f:
            old = json.load(f)
    keys = {(r["kernel"], r["shape"]) for r in records}
    merged = [r for r in old if (r["kernel"], r["shape"]) not in keys] + records
    with open(path, "w") as f:
        json.dump(merged, f, indent=1)
    return merged


def table(records):
    fmt = lambda x: "—" if x is None else f"{x:.4f}"  # noqa: E731
    pct = lambda x: "—" if x is None else f"{x:.0f}%"  # noqa: E731
    lines = ["| date | GPU | kernel | shape | ours ms | peer | peer ms | jnp (XLA) ms | roofline ms "
             "| ours / roofline | peer / roofline | jnp / roofline | peer ms / ours ms | note |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in records:
        ratio = f"{r['peer_ms'] / r['ours_ms']:.2f}" if r.get("peer_ms") and r.get("ours_ms") else "—"
        lines.append(f"| {r['date']} | {r.get('gpu', 'H200')} | {r['kernel']} | {r['shape']} | {fmt(r['ours_ms'])} "
                     f"| {r['peer']} | {fmt(r.get('peer_ms'))} | {fmt(r.get('jnp_ms'))} | {fmt(r['roofline_ms'])} "
                     f"| {pct(r.get('ours_pct_roofline'))} | {pct(r.get('peer_pct_roofline'))} "
                     f"| {pct(r.get('jnp_pct_roofline'))} | {ratio} | {r.get('note', '')} |")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default="decode", help="comma-separated suites: " + ",".join(SUITES))
    ap.add_argument("--out", default=os.environ.get("OUT", os.path.join(ROOT, "benchmarks", "results")))
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--no-peer", action="store_true")
    ap.add_argument("--peer-budget", type=float, default=80.0, help="seconds for all fla cases together")
    ap.add_argument("--time-budget", type=float, default=None,
                    help="seconds for the whole run: the peers get what the JAX side leaves (at most --peer-budget)")
    ap.add_argument("--fla-worker", metavar="CASES_JSON")
    ap.add_argument("--table", metavar="JSON")
    args = ap.parse_args()
    if args.fla_worker:
        return fla_worker(args.fla_worker)
    if args.table:
        with open(args.table) as f:
            return print(table(json.load(f)))

    t_start = time.monotonic()
    import jax

    print(jax.devices(), flush=True)
    bw, bw_res = measure_copy_bandwidth()
    print(f"copy bandwidth {bw:.3f} TB/s {json.dumps(bw_res)}", flush=True)
    mm, mm_res = None, None
    if any(SUITES[name].flops for name in args.only.split(",")):
        mm, mm_res = measure_matmul_rate()
        print(f"bf16 matmul {mm:.1f} TFLOP/s {json.dumps(mm_res)}", flush=True)
    records = []
    os.makedirs(args.out, exist_ok=True)
    out_json = os.path.join(args.out, os.path.basename(RESULTS))
    for name in args.only.split(","):
        suite = SUITES[name]
        cases = suite.cases(args.quick)
        jax_results = {}
        allowed = checked_variants(args.out)
        print(f"variants passed by gpu_check: {sorted(allowed)}", flush=True)
        peer_kw = dict(peer=not args.no_peer) if suite.in_process_peer else {}
        for case in cases:
            print(f"{case_key(case)}", flush=True)
            jax_results[case_key(case)] = suite.run_jax(case, allowed, **peer_kw)
            merge_records(out_json, [make_record(case, jax_results[case_key(case)], dict(error="not run yet"),
                                                 bw, suite, mm)])  # partial results survive a timeout
        budget = args.peer_budget
        if args.time_budget is not None:
            budget = min(budget, args.time_budget - (time.monotonic() - t_start) - 8)
        print(f"peer budget {budget:.0f} s", flush=True)
        peer_results = {} if args.no_peer or not suite.has_peer or budget < 10 else run_peers(cases, budget)
        no_peer = dict(error="not run") if suite.has_peer else dict(peer="none", error="no peer kernel timed")
        for case in cases:
            records.append(make_record(case, jax_results[case_key(case)],
                                       peer_results.get(case_key(case), no_peer), bw, suite, mm))
    merged = merge_records(out_json, records)
    summary = dict(date=DATE, copy_bandwidth_tbps=bw, copy_detail=bw_res, matmul_tflops=mm, matmul_detail=mm_res,
                   when=datetime.datetime.now(datetime.timezone.utc).isoformat())
    with open(os.path.join(args.out, "kernels-run.json"), "w") as f:
        json.dump(summary, f, indent=1)
    print(table(merged))


if __name__ == "__main__":
    main()
