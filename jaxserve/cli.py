"""The ``jaxserve`` command line.

    jaxserve serve [--model DIR] [--host 127.0.0.1] [--port 8000] [--api-key KEY] [--served-model-name NAME]
                   [engine flags: --dtype, --page-size, --max-prefill-length, --max-running-requests, ...]
    jaxserve generate [--model DIR] (--prompt TEXT | --prompt-ids 1,2,3 | --prompts-file F) [--max-tokens N]
                      [--temperature T] [--top-p P] [--top-k K] [--seed S] [--stop S] [--dtype float32|bfloat16]
                      [--chat] [--ignore-eos] [--json] [engine flags: --page-size, --max-prefill-length, ...]
    jaxserve probe --url URL [--reference-url URL2] [--n 500] [--concurrency 8] [--abort-fraction 0.3]
                   [--seed S] [--needle-tokens MIN MAX] [--json] [--api-key K] [--model NAME]

Prompts run through the full engine (continuous batching, prefix cache). ``--json`` prints one
JSON object per prompt: output_ids, text, logprobs (the chosen token's logprob at each step),
finish_reason, prompt_tokens, cached_tokens (prompt tokens served from the prefix cache).

``serve`` starts the OpenAI-compatible HTTP server (server/): it prints its config, loads the
checkpoint, compiles the first step with a warm-up request, and only then opens the port, so a
200 from ``/health`` means requests are served without a compile stall on the first one. Every user error (bad folder, bad flag value, prompt too long)
goes to stderr as one line and exits with code 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

# The small model the project ships; `jaxserve generate` / `serve` use it when --model is not given.
DEFAULT_MODEL_DIR = Path(__file__).resolve().parents[1] / "weights" / "default"


class UsageError(Exception):
    pass


def _parse_ids(text: str) -> list[int]:
    try:
        ids = [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        raise UsageError(f"--prompt-ids must be comma-separated integers, got {text!r}") from None
    if not ids:
        raise UsageError("--prompt-ids is empty")
    return ids


def _read_prompts_file(path: str) -> list:
    """One prompt per line: plain text, or JSON ``{"prompt": "..."}`` / ``{"prompt_ids": [...]}``."""
    try:
        lines = [ln for ln in Path(path).read_text().splitlines() if ln.strip()]
    except OSError as e:
        raise UsageError(f"cannot read --prompts-file: {e}") from None
    prompts = []
    for n, line in enumerate(lines, 1):
        if line.lstrip().startswith("{"):
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise UsageError(f"{path}:{n}: invalid JSON ({e})") from None
            if "prompt_ids" in obj:
                prompts.append([int(t) for t in obj["prompt_ids"]])
            elif isinstance(obj.get("prompt"), str):
                prompts.append(obj["prompt"])
            else:
                raise UsageError(f"{path}:{n}: expected a \"prompt\" string or \"prompt_ids\" list")
        else:
            prompts.append(line)
    if not prompts:
        raise UsageError(f"{path}: no prompts")
    return prompts


def _generate(args: argparse.Namespace) -> list[dict]:
    from jaxserve.engine.llm import build_engine
    from jaxserve.generate import SamplingParams

    engine = build_engine(_engine_args(args, progress=not args.json))
    if args.prompt_ids is not None:
        prompts = [_parse_ids(args.prompt_ids)]
    elif args.prompts_file is not None:
        prompts = _read_prompts_file(args.prompts_file)
    else:
        prompts = [args.prompt]
    if args.chat:
        prompts = [engine.tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True)
                   if isinstance(p, str) else p for p in prompts]
    sampling = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                              top_k=args.top_k, seed=args.seed, ignore_eos=args.ignore_eos)
    outs = engine.generate(prompts, sampling, stop=tuple(args.stop or ()))
    return [{"output_ids": o.output_ids, "text": o.text, "logprobs": o.logprobs, "finish_reason": o.finish_reason,
             "prompt_tokens": len(o.prompt_token_ids), "cached_tokens": o.cached_tokens} for o in outs]


def _engine_args(args: argparse.Namespace, progress: bool):
    from jaxserve.engine.llm import EngineArgs

    return EngineArgs(
        model=args.model or str(DEFAULT_MODEL_DIR), dtype=args.dtype, page_size=args.page_size,
        max_prefill_length=args.max_prefill_length, max_running_requests=args.max_running_requests,
        num_pages=args.num_pages, num_slots=args.num_slots, policy=args.policy, kernels=args.kernels,
        progress=progress, **({"max_model_len": args.max_model_len, "debug_snapshot_checksums": args.debug_snapshot_checksums,
            "debug_fault": args.debug_inject_fault} if args.command == "serve" else {}))


def _serve(args: argparse.Namespace) -> int:
    import time

    from jaxserve.engine.llm import build_engine
    from jaxserve.generate import SamplingParams

    try:
        import uvicorn

        from server.app import create_app
        from server.async_engine import AsyncEngine
    except ImportError as e:
        raise UsageError(f"the server needs the 'server' extra (pip install -e '.[server]'): {e}") from None
    if not 0 < args.port < 65536:
        raise UsageError(f"--port must be in 1..65535, got {args.port}")
    eargs = _engine_args(args, progress=True)
    name = args.served_model_name or (args.model if args.model else "jaxserve-default")
    log = lambda msg: print(f"jaxserve: {msg}", file=sys.stderr, flush=True)  # noqa: E731
    log("serve config: " + ", ".join(f"{k}={v}" for k, v in [
        ("model", eargs.model), ("served_model_name", name), ("host", args.host), ("port", args.port),
        ("api_key", "set" if args.api_key else "none"), ("dtype", eargs.dtype), ("page_size", eargs.page_size),
        ("max_prefill_length", eargs.max_prefill_length), ("max_running_requests", eargs.max_running_requests),
        ("max_model_len", eargs.max_model_len), ("num_pages", eargs.num_pages), ("num_slots", eargs.num_slots),
        ("policy", eargs.policy), ("kernels", eargs.kernels), ("debug_snapshot_checksums", eargs.debug_snapshot_checksums)]))
    if eargs.debug_fault:
        log(f"WARNING: --debug-inject-fault {eargs.debug_fault}: cache hits are corrupted on purpose (tests only)")
    t0 = time.perf_counter()
    log(f"loading {eargs.model} ...")
    engine = build_engine(eargs)
    log(f"loaded in {time.perf_counter() - t0:.1f}s; compiling the first prefill and decode steps (warm-up request) ...")
    t1 = time.perf_counter()
    warm = engine.tokenizer.encode("Hello") or [0]
    engine.generate([warm], SamplingParams(max_tokens=2, ignore_eos=True))
    engine.scheduler.cache.flush()  # the warm-up leaves nothing behind
    engine.check_invariants()
    log(f"compiled in {time.perf_counter() - t1:.1f}s; starting the HTTP server on http://{args.host}:{args.port}")
    async_engine = AsyncEngine(engine).start()
    app = create_app(async_engine, served_model_name=name, api_key=args.api_key)
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, timeout_keep_alive=30)
    finally:
        async_engine.stop()
    return 0


def _add_engine_flags(p: argparse.ArgumentParser, dtype_default: str) -> None:
    p.add_argument("--model", default=None, help="Hugging Face checkpoint folder (default: the model shipped in weights/default)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default=dtype_default)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--max-prefill-length", type=int, default=8192, help="tokens per step (chunked prefill)")
    p.add_argument("--max-running-requests", type=int, default=64)
    p.add_argument("--num-pages", type=int, help="KV pages (default: from the memory budget)")
    p.add_argument("--num-slots", type=int, help="linear-state slots (default: from the memory budget)")
    p.add_argument("--policy", choices=("fcfs", "lpm"), default="fcfs")
    p.add_argument("--kernels", default="auto",
                   help="mixer backends: auto (on a GPU, the kernels verified there), jnp, pallas (the Pallas "
                        "Mosaic GPU kernels), or a list of them: gdn_prefill,gdn_decode,paged_attention")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="jaxserve", description="JAX/Pallas serving engine for hybrid linear-attention LLMs")
    sub = ap.add_subparsers(dest="command", required=True)
    sv = sub.add_parser("serve", help="serve the OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, ...)")
    _add_engine_flags(sv, "bfloat16")
    sv.add_argument("--host", default="127.0.0.1")
    sv.add_argument("--port", type=int, default=8000)
    sv.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1/* routes")
    sv.add_argument("--served-model-name", default=None,
                    help="the model name clients send (default: the --model argument, or 'jaxserve-default')")
    sv.add_argument("--max-model-len", type=int, default=None, help="context length (default: the model's)")
    sv.add_argument("--debug-snapshot-checksums", action="store_true",
                    help="checksum every prefix-cache snapshot on donation and before each hit (metric: "
                         "jaxserve_snapshot_checksum_mismatches)")
    # Test-only: corrupt every prefix-cache hit on purpose, to prove `jaxserve probe` catches it.
    sv.add_argument("--debug-inject-fault", choices=("stale-snapshot", "wrong-snapshot"), default=None,
                    help=argparse.SUPPRESS)
    sv.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"))
    g = sub.add_parser("generate", help="generate a completion offline for one prompt")
    _add_engine_flags(g, "bfloat16")
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text")
    src.add_argument("--prompt-ids", help="prompt as comma-separated token ids")
    src.add_argument("--prompts-file", help="several prompts, one per line (text or JSON {prompt|prompt_ids}); "
                                            "they run together through the engine and share its prefix cache")
    g.add_argument("--chat", action="store_true", help="wrap text prompts as a user message with the chat template")
    g.add_argument("--stop", action="append", help="stop string (repeatable)")
    g.add_argument("--max-tokens", type=int, default=16)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-sequence tokens")
    g.add_argument("--json", action="store_true", help="print one JSON object per prompt")
    pr = sub.add_parser("probe", help="ground-truth probes and a cache hammer against any OpenAI-compatible server; "
                                      "exit 1 when a cache hit differs from its cold answer")
    pr.add_argument("--url", required=True, help="the server, e.g. http://127.0.0.1:8000")
    pr.add_argument("--reference-url", default=None, help="a second server: every answer is also compared with its answer")
    pr.add_argument("--n", type=int, default=500, help="requests to send (aborted streams included)")
    pr.add_argument("--concurrency", type=int, default=8, help="streams in flight at once")
    pr.add_argument("--abort-fraction", type=float, default=0.3, help="share of streams closed after 0-3 tokens")
    pr.add_argument("--seed", type=int, default=0)
    pr.add_argument("--needle-tokens", type=int, nargs=2, default=(1000, 4000), metavar=("MIN", "MAX"),
                    help="needle context length range (about 12 tokens per line)")
    pr.add_argument("--max-tokens", type=int, default=16)
    pr.add_argument("--kinds", default="arithmetic,needle,recall", help="probe kinds to send (comma-separated)")
    pr.add_argument("--repeats", type=int, default=4, help="full sends of each distinct prompt (one cold, the rest hits)")
    pr.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    pr.add_argument("--api-key", default=None)
    pr.add_argument("--model", default=None, help="model name to send (default: the server's first listed model)")
    pr.add_argument("--json", action="store_true", help="print the report as one JSON object (no progress)")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "serve":
            return _serve(args)
        if args.command == "probe":
            from jaxserve import probe

            return probe.main(args)
        if args.command == "generate":
            for out in _generate(args):
                print(json.dumps(out) if args.json else out["text"])
            return 0
    except (UsageError, ValueError, FileNotFoundError) as e:
        # ConfigError, CheckpointError and SamplingParams' checks are ValueErrors.
        print(f"jaxserve: error: {e}", file=sys.stderr)
        return 2
    return 1


if __name__ == "__main__":
    sys.exit(main())
