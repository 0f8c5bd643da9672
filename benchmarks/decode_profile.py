"""Where a decode step's time goes, in-process (no HTTP): the engine on a real-size checkpoint,
decode tok/s at batch 1 and 32 with the step loop synchronous and overlapped, the per-kernel GPU
time of one decode step (CUPTI, ``jaxserve/profiling.py``), for each ``--kernels`` setting (the
first one is the baseline), and the greedy-token agreement of every other setting with the first
on the same prompts (top-1 agreement, compared up to each request's first divergence and counted
over all tokens). Device-only.

    python benchmarks/decode_profile.py --ckpt runs/e2e-ck --out $OUT/decode.json \
        --kernels "auto;gdn_decode,gdn_prefill,paged_attention,conv1d,moe"
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def log(msg: str) -> None:
    print(f"[decode {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def random_ids(rng: random.Random, engine, n: int) -> list[int]:
    """Random ordinary token ids: clear of the low ids and of the specials at the vocabulary's end."""
    v = engine.vocab_size
    return [rng.randrange(v // 8, v - 300) for _ in range(n)]


def decode_rate(engine, batch: int, prompt_len: int, new: int, seed: int, outputs: dict | None = None) -> dict:
    """Serve ``batch`` random prompts together; tok/s over the steps after every prompt is prefilled.
    ``outputs`` (if given) collects each request's output ids by its index."""
    from jaxserve.sampling_params import SamplingParams

    rng = random.Random(seed)
    sp = SamplingParams(max_tokens=new, ignore_eos=True)
    rids = {}
    for i in range(batch):
        rids[engine.add_request(random_ids(rng, engine, prompt_len), sp)] = i
    stamps, produced, phases = [], [], []  # phases: each step's (dispatch s, fetch-wait s, step s)
    ex = engine.executor
    spent = {"dispatch": 0.0, "fetch": 0.0}

    def timed(name, fn):
        def call(*a):
            t = time.perf_counter()
            try:
                return fn(*a)
            finally:
                spent[name] += time.perf_counter() - t
        return call

    ex.dispatch, ex.fetch = timed("dispatch", ex.dispatch), timed("fetch", ex.fetch)
    try:
        while engine.has_work():
            spent["dispatch"] = spent["fetch"] = 0.0
            t = time.perf_counter()
            outs = engine.step()
            stamps.append(time.perf_counter())
            phases.append((spent["dispatch"], spent["fetch"], stamps[-1] - t))
            produced.append(sum(len(o.new_ids) for o in outs))
            for o in outs:
                if o.finished and outputs is not None:
                    outputs[rids[o.request_id]] = list(o.output_ids)
    finally:
        del ex.dispatch, ex.fetch  # the instance attributes shadowed the methods
    # steady state: from the step where every request has its first token to the end
    firsts, seen = 0, 0
    for i, n in enumerate(produced):
        seen += n
        if seen >= batch:
            firsts = i
            break
    toks = sum(produced[firsts + 1:])
    dt = stamps[-1] - stamps[firsts]
    steady = np.array(phases[firsts + 1:] or [(0.0, 0.0, 0.0)]) * 1e3
    # host_ms: the step's time less its wait for the device (the overlapped loop hides it while it
    # stays below the device's step time; fetch_wait_ms near 0 says the loop is host-bound)
    med = {f"{k}_ms": round(float(np.median(v)), 3) for k, v in
           (("dispatch", steady[:, 0]), ("fetch_wait", steady[:, 1]), ("host", steady[:, 2] - steady[:, 1]))}
    return {"batch": batch, "tok_s": round(toks / dt, 1) if dt > 0 else None, "step_ms": round(dt / max(1, len(stamps) - firsts - 1) * 1e3, 3),
            "steps": len(stamps), **med}


def kernel_breakdown(engine, batch: int, prompt_len: int, seed: int, hlo_out: Path | None = None) -> dict | None:
    """The per-kernel GPU time of one decode step of ``batch`` rows (median of 5), its 16 costliest
    kernels each named by the JAX ops it runs (``profiling.hlo_sources`` over the decode program's
    optimised HLO, which is also written to ``hlo_out`` if given)."""
    from jaxserve import profiling
    from jaxserve.sampling_params import SamplingParams

    rng = random.Random(seed)
    for _ in range(batch):
        engine.add_request(random_ids(rng, engine, prompt_len),
                           SamplingParams(max_tokens=40, ignore_eos=True))
    overlap, engine.overlap = engine.overlap, False
    while any(r.num_pending > 1 or not r.output_ids for r in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()
    for _ in range(3):
        engine.step()

    def run():
        engine.step()
        engine.executor.barrier()

    per = profiling.kernel_timings(run, 5)
    engine.overlap = overlap
    while engine.has_work():
        engine.step()
    if not per:
        return None
    ex = engine.executor
    B = next(b for b in ex.buckets.seqs if b >= batch)
    return named_breakdown(engine, per, (B, B, ex.buckets.snapshot_sizes(B, True)[0], True), hlo_out)


def prefill_breakdown(engine, length: int, seed: int, hlo_out: Path | None = None) -> dict | None:
    """One cold prompt of ``length`` random tokens and one output token on an idle engine: its wall
    time (the in-process TTFT, median of 3; the first call's, compiles included, beside it) and the per-kernel GPU time of its prefill steps (one, or
    several of the largest program for a prompt longer than the token budget), named like
    ``kernel_breakdown``'s."""
    from jaxserve import profiling
    from jaxserve.sampling_params import SamplingParams

    rng = random.Random(seed)
    overlap, engine.overlap = engine.overlap, False
    walls = []

    def run():  # a new random prompt each call: never a prefix hit
        t0 = time.perf_counter()
        engine.add_request(random_ids(rng, engine, length), SamplingParams(max_tokens=1, ignore_eos=True))
        while engine.has_work():
            engine.step()
        engine.executor.barrier()
        walls.append(time.perf_counter() - t0)

    t0 = time.perf_counter()
    run()  # compiles
    first_call_s = time.perf_counter() - t0
    walls.clear()
    for _ in range(3):
        run()
    per = profiling.kernel_timings(run, 3)
    engine.overlap = overlap
    engine.scheduler.cache.flush()
    wall = {"length": length, "wall_ms_p50": round(sorted(walls[:3])[1] * 1e3, 2),
            "first_call_s": round(first_call_s, 1)}  # its programs' compile (none cached) included
    if not per:
        return wall
    b = engine.executor.buckets
    T = next((t for t in b.tokens if t >= length), b.tokens[-1])  # longer prompts: steps of the largest
    B = b.row_sizes(T)[0]  # one prompt alone: the one-row program where there is one
    return {**wall, **named_breakdown(engine, per, (T, B, b.snapshot_sizes(T, False, B)[-1], False), hlo_out)}


def named_breakdown(engine, per, program, hlo_out: Path | None) -> dict:
    """``profiling.summarize`` of ``per`` (16 costliest kernels) plus the kernel count per call,
    each costly kernel's JAX ops (``profiling.hlo_sources`` over ``program``'s optimised HLO, which
    is also written to ``hlo_out`` if given) and every kernel's time charged to its model scope
    (``profiling.scope_totals``)."""
    from jaxserve import profiling
    from jaxserve.engine import runner

    res = profiling.summarize(per, top=16)
    res["kernels_per_call"], res["program"] = len(per[0]), list(program)
    ex = engine.executor
    try:  # the same program, from the persistent compilation cache: its kernel names are the profile's
        text = runner.lower_step(ex.params, ex.cfg, ex.pools, ex.buckets, program).compile().as_text()
    except Exception as e:  # noqa: BLE001 - the breakdown stands without names
        log(f"no HLO for {program}: {type(e).__name__}: {e}")
        return res
    if hlo_out is not None:
        hlo_out.write_text(text)
    res["ops"] = profiling.hlo_sources(text, res["kernel_breakdown_ms"])
    res["scopes"] = profiling.scope_totals(text, per)
    # time of kernels no HLO instruction names (cuBLAS, cub, or a naming miss to look into)
    res["unnamed_ms"] = round(sum(v["ms"] for s, v in res["scopes"].items() if s.startswith("library:")), 5)
    res["kernel_names"] = [name for name, _ in per[0]]  # one call's kernels in launch order: to check the naming offline
    res["kernel_us"] = [round(t * 1e3, 2) for _, t in per[0]]  # and their times (µs), to read beside the HLO offline
    return res


def agreement(base: dict, other: dict) -> dict:
    """Greedy top-1 agreement: tokens equal up to each request's first divergence (after it the
    contexts differ, so later tokens are not comparable), over all tokens of ``base``."""
    same = total = diverged = 0
    for i, ref in base.items():
        got = other.get(i, [])
        n = next((j for j, (a, b) in enumerate(zip(ref, got)) if a != b), min(len(ref), len(got)))
        same += n
        total += len(ref)
        diverged += n < len(ref)
    return {"tokens": total, "agree_until_divergence": same, "share": round(same / max(total, 1), 4),
            "requests_diverged": diverged, "requests": len(base)}


def forced_agreement(engine, cfgs: list, rows: int, prompt_len: int, steps: int, seed: int,
                     control: bool = False) -> dict:
    """Teacher-forced greedy top-1 agreement of each of ``cfgs[1:]`` with ``cfgs[0]``: ``rows`` random
    prompts prefilled together, then ``steps`` decode steps in which every setting is fed the
    baseline's argmax token, so each position compares the settings on the same context. (The
    free-running ``agreement`` stops at a request's first divergence, which on a random-weight
    model's flat logits is often a near-tie within bf16 rounding.) Per setting: the share of
    positions (prefill's last token included) whose argmax agrees, the baseline's top-2 logit gap at
    each disagreement, and the largest |logit| difference. Runs the engine's step programs directly
    on the idle engine's pools (pages 1.., slots 1..rows) and a copy per other setting.

    ``control``: also the baseline against itself computed another way, as the floor the others'
    agreement is read against: the same setting with each prompt prefilled alone (another batch,
    so other chunk grids, expert groups and reduction orders; the same math), then fed the same
    tokens. Its entry is last in ``per_setting``, named ``control``."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxserve.engine import runner

    ex = engine.executor
    engine.scheduler.cache.flush()
    b, rng = ex.buckets, random.Random(seed)
    n_pages = -(-(prompt_len + steps) // b.page_size)
    prompts = [random_ids(rng, engine, prompt_len) for _ in range(rows)]
    pages = [list(range(1 + i * n_pages, 1 + (i + 1) * n_pages)) for i in range(rows)]
    runs = cfgs + ([cfgs[0]] if control else [])  # the control: the baseline's setting, its own pools
    pools = [ex.pools] + [jax.tree.map(jnp.copy, ex.pools) for _ in runs[1:]]
    stats = [{"positions": 0, "agree": 0, "gaps_at_disagreement": [], "max_abs_logit_diff": 0.0} for _ in runs[1:]]

    def one(k, specs):
        """Logits of ``specs``' rows after one step of setting ``k`` on its pools."""
        out, pools[k] = runner.step(ex.params, runs[k], pools[k], runner.make_batch(specs, b),
                                    feed_tokens=runner.feed_buffer(b.seqs[-1]), return_logits=True,
                                    placement=ex.placement)
        return out.logits[:len(specs)]

    def compare(logits) -> np.ndarray:
        """Tally every setting's argmax against the baseline's (``logits[0]``); returns the latter."""
        top2 = jax.lax.top_k(logits[0], 2)[0]
        base = np.asarray(jnp.argmax(logits[0], -1))
        gap = np.asarray(top2[:, 0] - top2[:, 1])
        for st, lo in zip(stats, logits[1:]):
            got = np.asarray(jnp.argmax(lo, -1))
            st["positions"] += len(got)
            st["agree"] += int((got == base).sum())
            st["gaps_at_disagreement"] += [round(float(g), 4) for g in gap[got != base]]
            st["max_abs_logit_diff"] = max(st["max_abs_logit_diff"], float(jnp.max(jnp.abs(lo - logits[0]))))
        return base

    def run(specs) -> np.ndarray:
        """One step of ``specs`` under every setting; returns the baseline's argmax per row."""
        return compare([one(k, specs) for k in range(len(runs))])

    fed = []
    per_step = b.chunked_rows or rows  # rows of several tokens a step may hold
    prefill = lambda i: runner.RowSpec(tokens=prompts[i], start=0, pages=pages[i], slot=1 + i)  # noqa: E731
    for lo in range(0, rows, per_step):
        ids = range(lo, min(rows, lo + per_step))
        logits = [one(k, [prefill(i) for i in ids]) for k in range(len(cfgs))]
        if control:  # each prompt alone: another batch of the same math
            logits.append(jnp.concatenate([one(len(runs) - 1, [prefill(i)]) for i in ids]))
        fed += compare(logits).tolist()
    for j in range(steps - 1):
        fed = run([runner.RowSpec(tokens=[fed[i]], start=prompt_len + j, pages=pages[i], slot=1 + i)
                   for i in range(rows)]).tolist()
    ex.pools = pools[0]
    for st, name in zip(stats, [c.kernels for c in cfgs[1:]] + (["control"] if control else [])):
        st["setting"] = name
        st["share"] = round(st["agree"] / max(1, st["positions"]), 4)
        st["max_abs_logit_diff"] = round(st["max_abs_logit_diff"], 4)
    return {"rows": rows, "prompt_len": prompt_len, "steps": steps, "per_setting": stats}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ckpt", type=Path, default=ROOT / "runs/e2e-ck")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--kernels", default="auto", help="';'-separated settings of EngineArgs.kernels")
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--prefill-lens", default="", help="prompt lengths whose cold prefill step to break down first")
    ap.add_argument("--scan-layers", action=argparse.BooleanOptionalAction, default=True,
                    help="the engine's stacked layout (EngineArgs.scan_layers); --no-scan-layers: the layers as a list")
    ap.add_argument("--one-row-programs", action=argparse.BooleanOptionalAction, default=True,
                    help="EngineArgs.one_row_programs: a prompt alone in its step runs the one-row program")
    ap.add_argument("--compile-all", action=argparse.BooleanOptionalAction, default=False,
                    help="compile every program at build (EngineArgs.compile_all, as the server does): the steps "
                         "then call those executables directly (runner.Executables) instead of jax.jit; only "
                         "the first --kernels setting has them")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--new", type=int, default=128, help="tokens generated per request")
    ap.add_argument("--forced-steps", type=int, default=0,
                    help="teacher-forced agreement of the settings over this many positions of each of 32 rows, first")
    ap.add_argument("--forced-control", action="store_true",
                    help="with --forced-steps: also the first setting against itself with each prompt prefilled "
                         "alone (the agreement floor)")
    args = ap.parse_args()
    from jaxserve.engine.llm import EngineArgs, build_engine

    import dataclasses

    import jax

    settings = args.kernels.split(";")
    t0 = time.time()
    engine = build_engine(EngineArgs(model=str(args.ckpt), dtype="bfloat16", max_running_requests=32,
                                     max_prefill_length=4096, num_pages=4096, num_slots=96, kernels=settings[0],
                                     scan_layers=args.scan_layers, one_row_programs=args.one_row_programs,
                                     compile_all=args.compile_all))
    log(f"built in {time.time() - t0:.0f}s on {jax.devices()[0].device_kind}")
    res = {"device": jax.devices()[0].device_kind, "settings": settings, "scan_layers": args.scan_layers,
           "one_row_programs": args.one_row_programs,
           "rows": [], "breakdown": {},
           "agreement": {}}
    base_cfg, tokens = engine.executor.cfg, {}
    if args.forced_steps and (len(settings) > 1 or args.forced_control):
        cfgs = [dataclasses.replace(base_cfg, kernels=k) for k in settings]
        res["forced_agreement"] = forced_agreement(engine, cfgs, 32, args.prompt_len, args.forced_steps, seed=400,
                                                   control=args.forced_control)
        log(f"forced agreement: {json.dumps(res['forced_agreement'])[:2000]}")
        args.out.write_text(json.dumps(res, indent=1))
    for n in [int(x) for x in args.prefill_lens.split(",") if x]:
        for k, kernels in enumerate(settings):  # every setting's prefill (other settings: jit programs)
            engine.executor.cfg = dataclasses.replace(base_cfg, kernels=kernels)
            bd = prefill_breakdown(engine, n, seed=300 + n,
                                   hlo_out=args.out.with_name(f"{args.out.stem}-prefill{n}-{k}.hlo.txt"))
            res["breakdown"][f"{kernels} prefill {n}"] = bd
            log(f"{kernels} prefill {n}: {json.dumps(bd, indent=1)[:4000]}")
            args.out.write_text(json.dumps(res, indent=1))
        engine.executor.cfg = base_cfg
    for b in [int(x) for x in args.batches.split(",") if x]:  # batch outermost: a cut-short run still compares settings
        for k, kernels in enumerate(settings):
            engine.executor.cfg = dataclasses.replace(base_cfg, kernels=kernels)  # static under jit: new programs
            for overlap in ((False, True) if k == 0 else (True,)):
                engine.overlap = overlap
                t0 = time.time()
                decode_rate(engine, b, args.prompt_len, args.new, seed=b)  # compiles every program the timed pass uses
                compile_s = time.time() - t0
                t0 = time.time()
                outs = {}
                row = {"kernels": kernels, "overlap": overlap, **decode_rate(engine, b, args.prompt_len, args.new, 100 + b, outs)}
                row["wall_s"], row["first_pass_s"] = round(time.time() - t0, 1), round(compile_s, 1)
                if (k, b) in tokens:  # the baseline's overlapped run against its synchronous one
                    res["agreement"][f"{kernels} b{b} overlap vs sync"] = agreement(tokens[(k, b)], outs)
                tokens.setdefault((k, b), outs)
                res["rows"].append(row)
                log(json.dumps(row))
                engine.scheduler.cache.flush()
            if k > 0:
                res["agreement"][f"{kernels} b{b}"] = agreement(tokens[(0, b)], tokens[(k, b)])
                log(f"agreement {kernels} b{b}: {res['agreement'][f'{kernels} b{b}']}")
            bd = kernel_breakdown(engine, b, args.prompt_len, seed=200 + b,
                                  hlo_out=args.out.with_name(f"{args.out.stem}-b{b}-{k}.hlo.txt"))
            res["breakdown"][f"{kernels} b{b}"] = bd
            log(f"{kernels} b={b} kernels: {json.dumps(bd, indent=1)[:4000]}")
            engine.scheduler.cache.flush()
            args.out.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
