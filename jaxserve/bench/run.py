"""Running a benchmark: the checked config, the load (arrivals, concurrency gate), one run per
concurrency level, and ``main`` for cli.py."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import datetime
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

from jaxserve.bench.client import Client, Conversation, request_body
from jaxserve.bench.metrics import Record, summarize
from jaxserve.bench.report import plot, render
from jaxserve.bench.workload import WORKLOADS, BenchError, Item, arrival_times, make_workload


@dataclasses.dataclass(frozen=True)
class Config:
    """Every setting of a benchmark, checked (``config_from_args``); ``concurrency`` holds one
    entry per run (None: no limit)."""
    url: str
    workload: str = "random"
    api: str = "completions"
    prompt_format: str = "ids"
    num_prompts: int = 200
    input_len: int = 1024
    output_len: int = 128
    range_ratio: float = 0.0
    prefix_len: int = 1024
    num_groups: int = 8
    turns: int = 4
    token_ids: tuple[int, int] = (10, 1000)
    seed: int = 0
    request_rate: float = math.inf
    concurrency: tuple[int | None, ...] = (None,)  # one run per entry; None: no limit
    ignore_eos: bool = True
    token_logprobs: bool = True
    model: str | None = None
    api_key: str | None = dataclasses.field(default=None, repr=False)
    timeout: float = 600.0

    def public(self) -> dict[str, Any]:
        """The config as the JSON result stores it (no API key; rate inf as "inf")."""
        d = dataclasses.asdict(self)
        d.pop("api_key")
        d["request_rate"] = "inf" if math.isinf(self.request_rate) else self.request_rate
        return d


async def run_once(client: Client, cfg: Config, model: str, sessions: list[list[Item]],
                   concurrency: int | None, progress) -> tuple[list[Record], float]:
    """Send every session (turns in order, each turn after the previous answer) and return the
    records in item order and the run's duration (first arrival to last answer). A turn after a
    failed one is not sent and counts as an error."""
    starts = arrival_times(len(sessions), cfg.request_rate, cfg.seed)
    gate = asyncio.Semaphore(concurrency) if concurrency else contextlib.nullcontext()
    records: list[Record] = []
    t0 = time.perf_counter()

    async def session(start: float, items: list[Item]) -> None:
        await asyncio.sleep(max(0.0, t0 + start - time.perf_counter()))
        conv, failed = Conversation(cfg.api), None
        for item in items:
            rec = Record(item)
            if failed is not None:
                rec.error = f"not sent: turn {failed} of this session failed"
            else:
                prompt = conv.prompt(item)
                async with gate:
                    body = request_body(cfg.api, model, prompt, item.output_len, cfg.ignore_eos,
                                        token_logprobs=cfg.token_logprobs)
                    await client.send(rec, body, t0)
                if rec.prompt_tokens is None and isinstance(item.user, tuple) and item.turn == 0:
                    rec.prompt_tokens = len(item.user)
                if rec.ok:
                    conv.answered(prompt, rec.text)
                else:
                    failed = item.turn
            records.append(rec)
            progress(rec)

    await asyncio.gather(*(session(s, items) for s, items in zip(starts, sessions)))
    return sorted(records, key=lambda r: r.item.index), time.perf_counter() - t0


async def benchmark(cfg: Config, show_progress: bool = False) -> dict[str, Any]:
    """Every run of ``cfg`` (one per concurrency level; level k uses seed + k, so no level's
    prompts are cached by the one before): {"config", "runs": [{"max_concurrency", "summary",
    "requests"}]}."""
    import httpx
    from tqdm import tqdm

    limit = None if None in cfg.concurrency else max(cfg.concurrency)
    limits = httpx.Limits(max_connections=limit, max_keepalive_connections=limit)
    async with httpx.AsyncClient(timeout=cfg.timeout, limits=limits) as http:
        client = Client(http, cfg.url, cfg.api_key, cfg.api)
        model = await client.model(cfg.model)
        tpw = await client.tokens_per_word(model) if cfg.prompt_format == "text" else None
        runs = []
        for level, conc in enumerate(cfg.concurrency):
            sessions = make_workload(
                cfg.workload, num_prompts=cfg.num_prompts, input_len=cfg.input_len, output_len=cfg.output_len,
                range_ratio=cfg.range_ratio, seed=cfg.seed + level, prompt_format=cfg.prompt_format,
                token_ids=cfg.token_ids, tokens_per_word=tpw or 1.0, prefix_len=cfg.prefix_len,
                num_groups=cfg.num_groups, turns=cfg.turns)
            bar = tqdm(total=cfg.num_prompts, desc=f"bench c={conc or 'inf'}", unit="req", file=sys.stderr,
                       disable=not show_progress, dynamic_ncols=True)
            errors = 0

            def progress(rec: Record) -> None:
                nonlocal errors
                errors += not rec.ok
                bar.update(1)
                if errors:
                    bar.set_postfix(errors=errors)

            with bar:
                records, duration = await run_once(client, cfg, model, sessions, conc, progress)
            runs.append({"max_concurrency": conc, "summary": summarize(records, duration),
                         "requests": [r.row() for r in records]})
    config = dict(cfg.public(), model=model, text_tokens_per_word=tpw,
                  started_at=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))
    return {"config": config, "runs": runs}


def parse_sweep(text: str) -> tuple[int, ...]:
    """``--concurrency-sweep C1,C2,...``: the levels (each >= 1), in the order given."""
    try:
        levels = tuple(int(t) for t in text.replace(" ", "").split(",") if t)
    except ValueError:
        raise BenchError(f"--concurrency-sweep must be comma-separated integers, got {text!r}") from None
    if not levels or min(levels) < 1:
        raise BenchError(f"--concurrency-sweep needs integers >= 1, got {text!r}")
    return levels


def config_from_args(args) -> Config:
    """Check the flags (a BenchError names the first bad one) and build the Config."""
    api = args.api or ("chat" if args.workload == "multi-turn" else "completions")
    fmt = args.prompt_format or ("ids" if api == "completions" and args.workload != "multi-turn" else "text")
    lo, hi = args.token_ids
    checks = [
        (args.url.startswith(("http://", "https://")), f"--url must start with http:// or https://, got {args.url!r}"),
        (args.workload in WORKLOADS, f"--workload must be one of {', '.join(WORKLOADS)}"),
        (args.num_prompts >= 1, "--num-prompts must be >= 1"),
        (args.input_len >= 1 and args.output_len >= 1, "--input-len and --output-len must be >= 1"),
        (0 <= args.range_ratio < 1, "--range-ratio must be in [0, 1)"),
        (args.prefix_len >= 1, "--prefix-len must be >= 1"),
        (args.workload != "shared-prefix" or 1 <= args.num_groups <= args.num_prompts,
         "--num-groups must be in 1..--num-prompts"),
        (args.turns >= 1, "--turns must be >= 1"),
        (0 <= lo < hi, "--token-ids needs 0 <= LOW < HIGH"),
        (args.request_rate > 0, "--request-rate must be > 0 (inf: all at once)"),
        (args.max_concurrency is None or args.max_concurrency >= 1, "--max-concurrency must be >= 1"),
        (args.max_concurrency is None or args.concurrency_sweep is None,
         "--max-concurrency and --concurrency-sweep exclude each other"),
        (args.timeout > 0, "--timeout must be > 0"),
        (fmt == "text" or (api == "completions" and args.workload != "multi-turn"),
         "--prompt-format ids needs the completions API and a one-turn workload (chat and multi-turn send text)"),
        (args.plot is None or args.plot.lower().endswith(".png"), "--plot must name a .png file"),
    ]
    for ok, why in checks:
        if not ok:
            raise BenchError(why)
    for flag, path in (("--json", args.json), ("--plot", args.plot)):
        if path not in (None, "-") and not Path(path).resolve().parent.is_dir():
            raise BenchError(f"{flag}: no such folder {str(Path(path).parent)!r}")
    levels = parse_sweep(args.concurrency_sweep) if args.concurrency_sweep is not None else (args.max_concurrency,)
    return Config(url=args.url, workload=args.workload, api=api, prompt_format=fmt, num_prompts=args.num_prompts,
                  input_len=args.input_len, output_len=args.output_len, range_ratio=args.range_ratio,
                  prefix_len=args.prefix_len, num_groups=args.num_groups, turns=args.turns, token_ids=(lo, hi),
                  seed=args.seed, request_rate=args.request_rate, concurrency=levels,
                  ignore_eos=not args.no_ignore_eos, token_logprobs=not args.no_logprobs, model=args.model, api_key=args.api_key, timeout=args.timeout)


def main(args) -> int:
    """``jaxserve bench`` (args from cli.py's parser)."""
    cfg = config_from_args(args)
    try:
        import httpx  # noqa: F401
        if args.plot:
            import matplotlib  # noqa: F401
    except ImportError as e:
        raise BenchError(f"bench needs httpx (and matplotlib for --plot): pip install -e '.[server]' ({e})") from None
    to_stdout = args.json == "-"
    result = asyncio.run(benchmark(cfg, show_progress=not (args.quiet or to_stdout)))
    print(json.dumps(result) if to_stdout else render(result), flush=True)
    try:
        if args.json and not to_stdout:
            Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
        if args.plot:
            plot(result, args.plot)
    except OSError as e:
        raise BenchError(f"cannot write the result: {e}") from None
    return 1 if any(run["summary"]["errors"] for run in result["runs"]) else 0
