"""The seed's hammer against the whole engine, on whatever device JAX has (meant for the H200).

A mid-size random qwen3_5 checkpoint in bf16 (written with numpy: weights/random_checkpoint.py).
Rounds alternate identical prompts (cold, then repeated so they hit the cache) with abandoned
(aborted mid-stream) and saturating concurrent streams; every hit's greedy tokens are compared
token by token with the cold answer of the same prompt. Reports mismatches, snapshot-checksum
mismatches, leaks (the invariant check after every step, pools free after a flush), cached-token
share, the cost of the barriers at hit admission and donation, and step times.

    python benchmarks/engine_hammer.py --out results.json [--rounds 6] [--time-budget 300]
        [--dtype float32 --precision highest] [--control]

``--control`` flushes the cache before each round, so the repeated prompt is served cold in the same
busy batches a hit would see: the divergences it reports are what batch composition alone does
(the rounding floor), to compare hit-vs-cold divergences against. In fp32 at highest matmul
precision a hit must equal the cold answer exactly.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402

from jaxserve.engine.llm import EngineArgs, build_engine  # noqa: E402
from jaxserve.sampling_params import SamplingParams  # noqa: E402
from weights.random_checkpoint import write_random_checkpoint  # noqa: E402

MID_QWEN3_5 = {
    "model_type": "qwen3_5_text", "vocab_size": 8192, "hidden_size": 1024, "intermediate_size": 3072,
    "num_hidden_layers": 8, "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 128,
    "layer_types": ["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 3 + ["full_attention"],
    "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
    "linear_num_key_heads": 8, "linear_num_value_heads": 16, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
    "max_position_embeddings": 32768, "eos_token_id": 511,
}


NEAR_TIE_NATS = 0.1  # bf16 logits of a random model carry ~0.05 nats of shape-dependent rounding noise


def compare(cold_ids, cold_lp, hit_ids, hit_lp) -> tuple[str, dict]:
    """``exact``; ``near-tie``: the first differing token is a near-tie (the logprobs agree up to it
    within NEAR_TIE_NATS and the two chosen tokens were within it of each other) — rounding, not
    corruption; or ``mismatch``: the distributions differ before or at the divergence — a corrupt hit."""
    drift_all = max(abs(a - b) for a, b in zip(cold_lp, hit_lp))
    if cold_ids == hit_ids:
        return "exact", {"max_logprob_drift": drift_all}
    j = next(k for k, (a, b) in enumerate(zip(cold_ids, hit_ids)) if a != b)
    drift = max((abs(a - b) for a, b in zip(cold_lp[:j], hit_lp[:j])), default=0.0)
    detail = {"first_divergence": j, "drift_before": drift, "cold_lp": cold_lp[j], "hit_lp": hit_lp[j],
              "cold_lps": cold_lp[: j + 1], "hit_lps": hit_lp[: j + 1]}
    near = drift <= NEAR_TIE_NATS and abs(cold_lp[j] - hit_lp[j]) <= NEAR_TIE_NATS
    return ("near-tie" if near else "mismatch"), detail


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--time-budget", type=float, default=300.0, help="stop starting rounds after this many seconds")
    ap.add_argument("--prompt-len", type=int, default=1200)
    ap.add_argument("--new-tokens", type=int, default=24)
    ap.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    ap.add_argument("--precision", choices=("default", "highest"), default="default",
                    help="jax_default_matmul_precision (highest: fp32 matmuls without TF32/bf16 passes)")
    ap.add_argument("--kernels", default="auto", help="EngineArgs.kernels (jaxserve/models/backends.py)")
    ap.add_argument("--control", action="store_true",
                    help="flush the cache before each round: cold-in-a-busy-batch vs cold-alone (the rounding floor)")
    ap.add_argument("--smoke", action="store_true", help="a tiny model and short prompts: checks the script on a CPU")
    args = ap.parse_args()
    if args.precision == "highest":
        jax.config.update("jax_default_matmul_precision", "highest")
    config = dict(MID_QWEN3_5)
    if args.smoke:
        config.update(hidden_size=64, intermediate_size=96, num_attention_heads=4, head_dim=16, linear_key_head_dim=16,
                      linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, vocab_size=512)
    t_start = time.perf_counter()
    rng = random.Random(0)
    folder = write_random_checkpoint(config, Path(tempfile.mkdtemp()) / "mid-qwen3_5", dtype=args.dtype, seed=0,
                                     init_std=0.5)
    engine = build_engine(EngineArgs(model=str(folder), dtype=args.dtype, page_size=16, max_prefill_length=1024,
                                     max_running_requests=16, mem_fraction=0.3, debug_snapshot_checksums=True, kernels=args.kernels,
                                     num_pages=2048 if args.smoke else None, num_slots=96 if args.smoke else None))
    sched = engine.scheduler
    vocab = config["vocab_size"] - 8
    greedy = SamplingParams(max_tokens=args.new_tokens, ignore_eos=True)
    step_ms: list[float] = []
    decode_ms: list[float] = []

    def drive(abort_after: dict[str, int]) -> dict:
        outs, steps = {}, 0
        while engine.has_work():
            t0 = time.perf_counter()
            plan_size = len(sched.running)
            done = engine.step()
            jax.block_until_ready(engine.executor.pools)
            dt = (time.perf_counter() - t0) * 1e3
            step_ms.append(dt)
            if plan_size and all(r.num_pending == 1 for r in sched.running):
                decode_ms.append(dt)
            for o in done:
                if o.finished:
                    outs[o.request_id] = o
            engine.check_invariants()
            steps += 1
            for rid, at in list(abort_after.items()):
                if steps == at:
                    engine.abort(rid)
                    del abort_after[rid]
        return outs

    bases = [[rng.randrange(vocab) for _ in range(args.prompt_len)] for _ in range(3)]
    record = {"rounds": [], "hit_mismatches": 0, "hit_near_ties": 0, "hits": 0}
    # Cold answers: each prompt alone on an empty cache.
    cold_answers = {}
    for i, base in enumerate(bases):
        out = engine.generate([base], greedy)[0]
        assert out.cached_tokens == 0
        cold_answers[i] = (out.output_ids, out.logprobs)
    prompt_tokens = cached_tokens = 0
    for rnd in range(args.rounds):
        if time.perf_counter() - t_start > args.time_budget:
            break
        i = rnd % len(bases)
        if args.control:
            sched.cache.flush()
        target = engine.add_request(bases[i], greedy)
        saturating = [engine.add_request([rng.randrange(vocab) for _ in range(rng.randrange(200, 700))],
                                         SamplingParams(max_tokens=48, ignore_eos=True)) for _ in range(6)]
        # Abandoned streams: copies of the same prompt and of another one, cut off after a few steps.
        abandoned = {engine.add_request(bases[j], SamplingParams(max_tokens=64, ignore_eos=True)): rng.randrange(1, 6)
                     for j in (i, i, (i + 1) % 3)}
        t0 = time.perf_counter()
        outs = drive(dict(abandoned))
        out = outs[target]
        prompt_tokens += len(bases[i])
        cached_tokens += out.cached_tokens
        verdict, detail = compare(*cold_answers[i], out.output_ids, out.logprobs)
        entry = {"round": rnd, "prompt": i, "cached_tokens": out.cached_tokens, "verdict": verdict, **detail,
                 "seconds": time.perf_counter() - t0, "saturating_done": sum(r in outs for r in saturating),
                 "aborted": sum(r not in outs for r in abandoned)}
        assert (out.cached_tokens == 0) == args.control, "control rounds are cold, hammer rounds are hits"
        record["hits"] += int(out.cached_tokens > 0)
        record["hit_mismatches"] += int(verdict == "mismatch")
        record["hit_near_ties"] += int(verdict == "near-tie")
        record["rounds"].append(entry)
        print(json.dumps(entry), flush=True)

    sched.cache.flush()
    engine.check_invariants()
    leaks = {"pages_in_use": sched.pages.capacity - sched.pages.num_free,
             "slots_in_use": (sched.slots.capacity - sched.slots.num_free) if sched.slots else 0}
    adm, don = sched.admission_barriers, sched.donation_barriers
    record.update({
        "device": str(jax.devices()[0]), "date": time.strftime("%Y-%m-%d"),
        "model": f"random qwen3_5, 8 layers (6 GDN + 2 gated attention), hidden 1024, {args.dtype}",
        "matmul_precision": args.precision, "control_cold_in_batch": args.control, "kernels": args.kernels,
        "snapshot_checksum_mismatches": engine.snapshot_checksum_mismatches,
        "leaks_after_flush": leaks,
        "cached_token_share_of_target_prompts": cached_tokens / max(1, prompt_tokens),
        "admission_barrier": {"count": adm.count, "mean_ms": 1e3 * adm.seconds / max(1, adm.count)},
        "donation_barrier": {"count": don.count, "mean_ms": 1e3 * don.seconds / max(1, don.count)},
        "steps": len(step_ms),
        "step_ms_median": statistics.median(step_ms) if step_ms else None,
        "decode_step_ms_median": statistics.median(decode_ms) if decode_ms else None,
        "preemptions": sched.num_preemptions,
        "wall_seconds": time.perf_counter() - t_start,
    })
    Path(args.out).write_text(json.dumps(record, indent=2))
    print(json.dumps({k: v for k, v in record.items() if k != "rounds"}, indent=2))


if __name__ == "__main__":
    main()
