"""The ``jaxserve`` command line.

    jaxserve serve [--model DIR] [--host 127.0.0.1] [--port 8000] [--api-key KEY] [--served-model-name NAME]
                   [engine flags: --dtype, --page-size, --max-prefill-length, --max-running-requests, ...]
                   [HTTP limits: --timeout-keep-alive S, --request-read-timeout S, --limit-concurrency N,
                    --max-body-bytes N] [images: --image-max-pixels N, --allow-image-urls,
                    --max-images-per-request N, --image-fetch-timeout S]
    jaxserve generate [--model DIR] (--prompt TEXT | --prompt-ids 1,2,3 | --prompts-file F) [--max-tokens N]
                      [--temperature T] [--top-p P] [--top-k K] [--seed S] [--stop S] [--dtype float32|bfloat16]
                      [--chat] [--image FILE ...] [--image-max-pixels N] [--ignore-eos] [--json]
                      [engine flags: --page-size, --max-prefill-length, ...]
                      [several hosts: --coordinator-address HOST:PORT --num-processes N --process-id I]
    jaxserve serve ... --coordinator-address HOST:PORT --num-processes N --process-id I  (likewise)
    jaxserve probe --url URL [--reference-url URL2] [--n 500] [--concurrency 8] [--abort-fraction 0.3]
                   [--seed S] [--needle-tokens MIN MAX] [--json] [--api-key K] [--model NAME]

Prompts run through the full engine (continuous batching, prefix cache). ``--json`` prints one
JSON object per prompt: output_ids, text, logprobs (the chosen token's logprob at each step),
finish_reason, prompt_tokens, cached_tokens (prompt tokens served from the prefix cache).

``serve`` starts the OpenAI-compatible HTTP server (server/): it prints its config, binds the port
(a busy one is an error at once, not after minutes of compiling), loads the checkpoint, sizes
memory from the largest compiled step, compiles every step program the server can run (a progress
bar; JAX's persistent cache makes a second start load them), sends one warm-up request, and only
then listens, so a 200 from ``/health`` means no request waits for a compile (``/metrics``: ``jaxserve_compiles_after_ready_total`` stays 0). Every user error (bad
folder, bad flag value, prompt too long) goes to stderr as one line and exits with code 2.

``generate`` and ``serve`` over several processes (hosts): every process runs the same command with
its own ``--process-id`` (jaxserve/parallel/distributed.py says how they stay in step). ``generate``:
process 0 prints the results, the others print only errors. ``serve``: process 0 serves HTTP and
the others follow its engine's steps, listening on no port, and exit 0 when it stops (text-only
models).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import sys
import traceback
from pathlib import Path

from jaxserve.engine.flags import UsageError, add_engine_flags, engine_args
from jaxserve.sampling_params import SamplingParams

# The small model the project ships; `jaxserve generate` / `serve` use it when --model is not given.


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
    from jaxserve.engine.llm import LLM

    if args.prompt_ids is not None:
        prompts = [_parse_ids(args.prompt_ids)]
    elif args.prompts_file is not None:
        prompts = _read_prompts_file(args.prompts_file)
    else:
        prompts = [args.prompt]
    files = [_read_image_file(f) for f in args.image or ()]  # unreadable files fail before the model loads
    llm = LLM.from_args(engine_args(args, progress=not args.json))
    engine = llm.engine
    images = _load_images(llm, files) if files else None
    if images:  # one placeholder per image before a text prompt's text, unless the text already has them
        mark = llm.images.placeholder
        if mark is None and any(isinstance(p, str) for p in prompts):
            raise UsageError(f"--image: the model's tokenizer has no image placeholder token "
                             f"({llm.images.no_placeholder}); pass --prompt-ids with one image token "
                             f"({llm.images.vision.image_token_id}) per image")
        prompts = [p if not isinstance(p, str) or mark in p else mark * len(images) + p for p in prompts]
    if args.chat:
        prompts = [engine.tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True)
                   if isinstance(p, str) else p for p in prompts]
    sampling = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                              top_k=args.top_k, seed=args.seed, ignore_eos=args.ignore_eos)
    outs = llm.generate(prompts, sampling, stop=tuple(args.stop or ()),
                        images=[images] * len(prompts) if images else None)
    return [{"output_ids": o.output_ids, "text": o.text, "logprobs": o.logprobs, "finish_reason": o.finish_reason,
             "prompt_tokens": len(o.prompt_token_ids), "cached_tokens": o.cached_tokens} for o in outs]


@contextlib.contextmanager
def _stdout_to_stderr():
    """Send what native code writes to stdout (gloo's connection lines over several processes) to
    stderr while the engine runs, so stdout holds only ``generate``'s results."""
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def _read_image_file(path: str) -> tuple[str, bytes]:
    try:
        return path, Path(path).read_bytes()
    except OSError as e:
        raise UsageError(f"--image {path}: cannot read it: {e.strerror or e}") from None


def _load_images(llm, files: list[tuple[str, bytes]]) -> list:
    """``--image`` files (path, bytes), decoded and preprocessed for ``llm``'s tower (they go with
    every prompt)."""
    from jaxserve.multimodal.preprocess import ImageError

    if llm.images is None:
        raise UsageError("--image: this model has no vision tower; it takes no images")
    out = []
    for path, data in files:
        try:
            out.append(llm.images.load(data))
        except ImageError as e:
            raise UsageError(f"--image {path}: {e}") from None
    return out


def _serve(args: argparse.Namespace) -> int:
    """``serve``: check the flags, take the port, build the engine, then ``_serve_engine``. Over
    several processes only process 0 does the last two; the others follow it (``_follow``)."""
    import time

    from jaxserve.engine.llm import build_engine

    try:
        from server import http
        from server.limits import HTTPLimits, ImageLimits
    except ImportError as e:
        raise UsageError(f"the server needs the 'server' extra (pip install -e '.[server]'): {e}") from None
    if not 0 < args.port < 65536:
        raise UsageError(f"--port must be in 1..65535, got {args.port}")
    from jaxserve.parallel.distributed import DistributedSpec

    spec = DistributedSpec.resolve(args.coordinator_address, args.num_processes, args.process_id)
    try:
        limits = HTTPLimits(timeout_keep_alive=args.timeout_keep_alive, request_read_timeout=args.request_read_timeout,
                            limit_concurrency=args.limit_concurrency)
    except ValueError as e:
        raise UsageError(f"--{str(e).replace('_', '-')}") from None
    if args.max_images_per_request < 1:
        raise UsageError(f"--max-images-per-request must be >= 1, got {args.max_images_per_request}")
    if not args.image_fetch_timeout > 0:
        raise UsageError(f"--image-fetch-timeout must be > 0, got {args.image_fetch_timeout}")
    if args.max_body_bytes is not None and args.max_body_bytes < 1:
        raise UsageError(f"--max-body-bytes must be >= 1, got {args.max_body_bytes}")
    image_limits = ImageLimits(max_images=args.max_images_per_request, allow_urls=args.allow_image_urls,
                               fetch_timeout=args.image_fetch_timeout)
    eargs = engine_args(args, progress=True)
    if spec is not None:
        _refuse_images_over_processes(eargs.model)
        if spec.process_id != 0:
            return _follow(eargs)
    try:  # take the port before the model loads and compiles: a busy port fails now, not minutes later
        sock = http.bind_socket(args.host, args.port)
    except OSError as e:
        raise UsageError(f"cannot listen on {args.host}:{args.port}: {e.strerror or e}") from None
    name = args.served_model_name or (args.model if args.model else "jaxserve-default")
    log = lambda msg: print(f"jaxserve: {msg}", file=sys.stderr, flush=True)  # noqa: E731
    log("serve config: " + ", ".join(f"{k}={v}" for k, v in [
        ("model", eargs.model), ("served_model_name", name), ("host", args.host), ("port", args.port),
        ("api_key", "set" if args.api_key else "none"), ("dtype", eargs.dtype), ("page_size", eargs.page_size),
        ("max_prefill_length", eargs.max_prefill_length), ("max_running_requests", eargs.max_running_requests),
        ("max_model_len", eargs.max_model_len), ("num_pages", eargs.num_pages), ("num_slots", eargs.num_slots),
        ("policy", eargs.policy), ("kernels", eargs.kernels), ("scan_layers", eargs.scan_layers), ("tensor_parallel_size", eargs.tensor_parallel_size),
        ("expert_parallel", eargs.expert_parallel), ("debug_snapshot_checksums", eargs.debug_snapshot_checksums),
        ("mem_fraction", eargs.mem_fraction), ("compile_cache", eargs.compile_cache),
        ("compile_workers", eargs.compile_workers or "auto"), ("max_body_bytes", args.max_body_bytes or "default"),
        *dataclasses.asdict(limits).items(), ("image_max_pixels", eargs.image_max_pixels or "default"),
        ("allow_image_urls", image_limits.allow_urls), ("max_images_per_request", image_limits.max_images),
        ("image_fetch_timeout", image_limits.fetch_timeout)]))
    t0 = time.perf_counter()
    log(f"loading {eargs.model} and compiling every step program ...")
    engine = build_engine(eargs)  # compile_all: every program the server can run exists after this
    with _leading(engine, spec is not None):
        return _serve_engine(args, eargs, engine, sock, limits, image_limits, name, t0)


def _serve_engine(args: argparse.Namespace, eargs, engine, sock, limits, image_limits, name: str, t0: float) -> int:
    """Warm ``engine`` up with one request, then serve HTTP on ``sock`` until SIGINT / SIGTERM."""
    import time

    from jaxserve.engine import startup
    from jaxserve.engine.llm import image_input
    from server import http
    from server.app import create_app
    from server.async_engine import AsyncEngine
    from server.metrics import Metrics

    log = lambda msg: print(f"jaxserve: {msg}", file=sys.stderr, flush=True)  # noqa: E731
    log(f"loaded and compiled in {time.perf_counter() - t0:.1f}s; one warm-up request through the engine ...")
    t1, steps = time.perf_counter(), startup.step_compiles()
    warm = engine.tokenizer.encode("Hello") or [0]
    engine.generate([warm], SamplingParams(max_tokens=2, ignore_eos=True))
    images = image_input(eargs, engine)  # says the resize clamp once
    if images is not None:  # one image through the tower and the scatter (compiles the tower's smallest bucket)
        _warm_up_image(engine, images, warm)
    engine.scheduler.cache.flush()  # the warm-up leaves nothing behind
    engine.check_invariants()
    if startup.step_compiles() > steps:
        log(f"WARNING: the warm-up request compiled {startup.step_compiles() - steps} step programs that "
            f"Buckets.programs() does not list: requests will wait for compiles")
    log(f"warm-up request in {time.perf_counter() - t1:.1f}s; ready in {time.perf_counter() - t0:.1f}s; starting "
        f"the HTTP server on http://{args.host}:{args.port}")
    ready = startup.backend_compiles()
    metrics = Metrics()
    metrics.observe("step_compiles", "XLA compiles (or compile-cache loads) of the serving step in this process; a "
                    "server makes all of them before it is ready.", startup.step_compiles)
    metrics.observe("compiles_after_ready", "XLA compiles (or compile-cache loads) of any program after the server "
                    "became ready; stays 0 when no request waits for a compile.",
                    lambda: startup.backend_compiles() - ready)
    async_engine = AsyncEngine(engine, metrics).start()
    app = create_app(async_engine, served_model_name=name, api_key=args.api_key, max_body_bytes=args.max_body_bytes,
                     images=images, image_limits=image_limits)
    config = http.uvicorn_config(app, args.host, args.port, limits, log_level=args.log_level)
    try:
        http.serve(config, sock)
    finally:
        async_engine.stop()
        sock.close()
    return 0


def _refuse_images_over_processes(model: str) -> None:
    """``serve`` over several processes takes text only: an image's tower runs on process 0 alone,
    and its table would have to reach the followers (``jaxserve.engine.llm.lead`` sends host
    arrays only). Checked on config.json before any process loads the weights."""
    from pathlib import Path

    from jaxserve.config import ModelConfig

    if ModelConfig.from_file(Path(model) / "config.json").vision is not None:
        raise UsageError(f"serve over several processes takes text-only models; {model} has a vision tower "
                         f"(serve it in one process, or one server per host behind the router)")


def _follow(eargs) -> int:
    """``serve`` on a process other than 0: load and compile the same engine, then run every
    device program process 0's server runs (``jaxserve.engine.llm.follow``) until it stops."""
    from jaxserve.engine.llm import build_engine, follow

    follow(build_engine(eargs))
    return 0


@contextlib.contextmanager
def _leading(engine, several: bool):
    """Process 0 of ``serve`` over several processes: ``engine`` leads the followers for the body,
    whose end sends them "stop" (or "fail" when it raises). One process: nothing."""
    if not several:
        yield
        return
    from jaxserve.engine.llm import lead

    channel = lead(engine)
    try:
        yield
    except BaseException:
        channel.send("fail")
        raise
    channel.send("stop")


def _warm_up_image(engine, images, text_ids: list[int]) -> None:
    """One small image request through the engine: it runs a step's image path once (the tower's
    patch buckets themselves are compiled when the engine's image input is built, ``compile_buckets``)."""
    from PIL import Image

    v = images.vision
    ids = [v.vision_start_token_id, v.image_token_id, v.vision_end_token_id] + list(text_ids)
    expanded, keys, prompt = images.prepare(ids, [Image.new("RGB", (images.processing.factor,) * 2, (128, 128, 128))])
    engine.add_request(expanded, SamplingParams(max_tokens=2, ignore_eos=True), cache_ids=keys, images=prompt)
    engine.run_until_done()


def build_parser() -> argparse.ArgumentParser:
    from server.limits import HTTPLimits

    ap = argparse.ArgumentParser(prog="jaxserve", description="JAX/Pallas serving engine for hybrid linear-attention LLMs")
    sub = ap.add_subparsers(dest="command", required=True)
    sv = sub.add_parser("serve", help="serve the OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, ...)")
    add_engine_flags(sv)
    sv.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    sv.add_argument("--port", type=int, default=8000,
                    help="port to listen on; taken before the model loads, so a busy port fails at once "
                         "(default: %(default)s)")
    sv.add_argument("--api-key", default=None, metavar="KEY",
                    help="require 'Authorization: Bearer KEY' on /v1/* routes (default: none, open)")
    sv.add_argument("--served-model-name", default=None, metavar="NAME",
                    help="the model name clients send (default: the --model argument, or 'jaxserve-default')")
    sv.add_argument("--max-model-len", type=int, default=None, metavar="N",
                    help="context length (default: the model's)")
    sv.add_argument("--timeout-keep-alive", type=int, default=HTTPLimits.timeout_keep_alive, metavar="S",
                    help="close an idle kept-alive connection after S seconds (default: %(default)s)")
    sv.add_argument("--request-read-timeout", type=float, default=HTTPLimits.request_read_timeout, metavar="S",
                    help="answer 408 and close a connection whose request headers and body have not all arrived "
                         "S seconds after its first byte (slow clients cannot hold connections; streaming a "
                         "response is not timed) (default: %(default)s)")
    sv.add_argument("--limit-concurrency", type=int, default=HTTPLimits.limit_concurrency, metavar="N",
                    help="answer 503 beyond N open connections or requests in progress (default: %(default)s)")
    from server.limits import ImageLimits

    sv.add_argument("--max-body-bytes", type=int, default=None, metavar="N",
                    help="answer 413 to a request body over N bytes (default: 8 MiB, 32 MiB for a model that takes "
                         "images)")
    sv.add_argument("--allow-image-urls", action="store_true",
                    help="fetch http(s) image URLs in chat requests (default: off, a 400 asks for a data: URL; on, "
                         "clients can make the server fetch any URL it can reach)")
    sv.add_argument("--max-images-per-request", type=int, default=ImageLimits.max_images, metavar="N",
                    help="answer 400 to a chat request with more than N images (default: %(default)s)")
    sv.add_argument("--image-fetch-timeout", type=float, default=ImageLimits.fetch_timeout, metavar="S",
                    help="with --allow-image-urls: seconds one image's fetch may take in all (default: %(default)s)")
    sv.add_argument("--debug-snapshot-checksums", action="store_true",
                    help="checksum every prefix-cache snapshot on donation and before each hit (metric: "
                         "jaxserve_snapshot_checksum_mismatches)")
    sv.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"),
                    help="uvicorn's log level (default: %(default)s)")
    g = sub.add_parser("generate", help="generate a completion offline for one prompt")
    add_engine_flags(g)
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text")
    src.add_argument("--prompt-ids", help="prompt as comma-separated token ids")
    src.add_argument("--prompts-file", help="several prompts, one per line (text or JSON {prompt|prompt_ids}); "
                                            "they run together through the engine and share its prefix cache")
    g.add_argument("--chat", action="store_true", help="wrap text prompts as a user message with the chat template")
    g.add_argument("--image", action="append", metavar="FILE",
                   help="a PNG / JPEG / WebP image for a model with a vision tower (repeatable; in order, with every "
                        "prompt): a text prompt gets one image placeholder per image before its text unless it holds "
                        "them (<|vision_start|><|image_pad|><|vision_end|>); --prompt-ids must hold one image token "
                        "per image")
    g.add_argument("--stop", action="append", help="stop string (repeatable)")
    sampling = SamplingParams()  # the flags' defaults are SamplingParams'
    g.add_argument("--max-tokens", type=int, default=sampling.max_tokens)
    g.add_argument("--temperature", type=float, default=sampling.temperature)
    g.add_argument("--top-p", type=float, default=sampling.top_p)
    g.add_argument("--top-k", type=int, default=sampling.top_k)
    g.add_argument("--seed", type=int, default=sampling.seed)
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
    sub.add_parser("sim", add_help=False, help="scheduling research: the real scheduler and prefix cache on a "
                   "virtual clock (`jaxserve sim --help`; sweep, gen, calibrate, validate)")
    sub.add_parser("serve-replicas", add_help=False, help="data parallelism: N `serve` replicas behind SGLang's "
                   "router with prefix-cache-aware routing (`jaxserve serve-replicas --help`)")
    b = sub.add_parser("bench", help="serving benchmark (TTFT, TPOT, ITL, latency, throughput, prefix-cache hits) "
                                     "against any OpenAI-compatible server, like `vllm bench serve`")
    b.add_argument("--url", default="http://127.0.0.1:8000",
                   help="the server's root; an OpenAI base URL ending in /v1 works too (default: %(default)s)")
    b.add_argument("--api-key", metavar="KEY", default=None, help="sent as 'Authorization: Bearer KEY'")
    b.add_argument("--model", metavar="NAME", default=None,
                   help="model name to send (default: the server's first listed model)")
    b.add_argument("--timeout", metavar="S", type=float, default=600.0,
                   help="seconds an HTTP connect or read may wait (default: 600)")
    b.add_argument("--workload", default="random", choices=("random", "shared-prefix", "multi-turn"),
                   help="random: prompts of random tokens; shared-prefix: --num-groups groups sharing a --prefix-len "
                        "prefix, each prompt with its own --input-len tail; multi-turn: sessions of --turns requests, "
                        "each adding --input-len tokens to the conversation so far (default: random)")
    b.add_argument("--api", choices=("completions", "chat"), default=None,
                   help="endpoint: /v1/completions or /v1/chat/completions (default: chat for multi-turn, "
                        "completions otherwise)")
    b.add_argument("--prompt-format", choices=("ids", "text"), default=None,
                   help="ids: random token ids as the prompt list (servers that accept them, e.g. jaxserve, vLLM); "
                        "text: random words sized with the server's tokens per word (measured first with two "
                        "requests). Default: ids on completions, text for chat and multi-turn")
    b.add_argument("--num-prompts", metavar="N", type=int, default=200, help="requests per run (default: 200)")
    b.add_argument("--input-len", metavar="N", type=int, default=1024,
                   help="prompt tokens (shared-prefix: the tail after the prefix; multi-turn: the new user part of "
                        "each turn) (default: 1024)")
    b.add_argument("--output-len", metavar="N", type=int, default=128, help="max_tokens of each request (default: 128)")
    b.add_argument("--range-ratio", metavar="R", type=float, default=0.0,
                   help="input and output lengths vary uniformly within +-R times --input-len / --output-len, "
                        "in [0, 1) (default: 0, fixed lengths)")
    b.add_argument("--prefix-len", metavar="N", type=int, default=1024,
                   help="shared-prefix: tokens of each group's prefix (default: 1024)")
    b.add_argument("--num-groups", metavar="G", type=int, default=8,
                   help="shared-prefix: number of distinct prefixes (default: 8)")
    b.add_argument("--turns", metavar="T", type=int, default=4, help="multi-turn: requests per session (default: 4)")
    b.add_argument("--token-ids", type=int, nargs=2, default=(10, 1000), metavar=("LOW", "HIGH"),
                   help="ids prompts draw token ids from [LOW, HIGH): keep them inside the server's vocabulary and "
                        "clear of its special tokens (default: 10 1000)")
    b.add_argument("--seed", metavar="S", type=int, default=0, help="workload and arrival seed (default: 0)")
    b.add_argument("--request-rate", metavar="R", type=float, default=float("inf"),
                   help="Poisson arrivals per second (sessions, for multi-turn); inf sends all at once (default: inf)")
    b.add_argument("--max-concurrency", metavar="C", type=int, default=None,
                   help="at most C requests in flight (default: no limit)")
    b.add_argument("--concurrency-sweep", default=None, metavar="C1,C2,...",
                   help="run the workload once per max concurrency (e.g. 1,4,16,32; a fresh seed each, so no run "
                        "hits the cache of the one before) and report throughput vs concurrency")
    b.add_argument("--no-ignore-eos", action="store_true",
                   help="do not send vLLM's ignore_eos: requests may stop before --output-len")
    b.add_argument("--no-logprobs", action="store_true",
                   help="do not ask for the sampled tokens' logprobs; then a token whose text the server holds back "
                        "(part of a multi-byte character) is timed when its text arrives")
    b.add_argument("--json", default=None, metavar="PATH",
                   help="write the full result (config, summary per run, one row per request) to PATH; "
                        "'-' prints it on stdout instead of the table")
    b.add_argument("--plot", default=None, metavar="PATH.png",
                   help="write latency CDFs (TTFT, TPOT, E2E) and, when sweeping, throughput vs concurrency")
    b.add_argument("--quiet", action="store_true", help="no progress bar on stderr")
    return ap


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["sim"]:  # its own parsers (jaxserve/sim/cli.py)
        from jaxserve.sim.cli import main as sim_main

        return sim_main(argv[1:])
    if argv[:1] == ["serve-replicas"]:  # its own parser; the flags it does not know go to each replica's serve
        from jaxserve.replicas import main as replicas_main

        return replicas_main(argv[1:])
    args = build_parser().parse_args(argv)
    try:
        if args.command == "serve":
            return _or_leave(_serve, args)
        if args.command == "probe":
            from jaxserve import probe

            return probe.main(args)
        if args.command == "bench":
            from jaxserve import bench

            return bench.main(args)
        if args.command == "generate":
            return _generate_and_print(args)
    except USER_ERRORS as e:
        return _user_error(e)
    return 1


# ConfigError, CheckpointError and SamplingParams' checks are ValueErrors.
USER_ERRORS = (UsageError, ValueError, FileNotFoundError)


def _user_error(e: Exception) -> int:
    print(f"jaxserve: error: {e}", file=sys.stderr)
    return 2


def _or_leave(run, args: argparse.Namespace):
    """``run(args)``. Over several processes, a process that fails leaves at once
    (``distributed.leave_now``) instead of returning: the others would wait for it in their next
    collective (or message), and it for them in JAX's shutdown barrier."""
    from jaxserve.parallel import distributed

    try:
        return run(args)
    except Exception as e:
        if not distributed.is_initialized():
            raise
        if isinstance(e, USER_ERRORS):
            code = _user_error(e)
        else:
            traceback.print_exc()
            code = 1
        distributed.leave_now(code)


def _generate_and_print(args: argparse.Namespace) -> int:
    """``generate``: over several processes every one runs it and process 0 prints the results
    (a process that fails leaves at once: ``_or_leave``)."""
    from jaxserve.parallel import distributed

    with _stdout_to_stderr():
        outs = _or_leave(_generate, args)
    if distributed.is_main_process():
        for out in outs:
            print(json.dumps(out) if args.json else out["text"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
