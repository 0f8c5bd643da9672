"""Per-request records, the folding of streamed chunks into them, and the statistics (pure)."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from jaxserve.bench.workload import Item

STATS = ("mean", "p50", "p90", "p99")


@dataclasses.dataclass
class Record:
    """What one request measured; times in seconds from its send (``start``: from the run start)."""
    item: Item
    start: float = 0.0
    ttft: float | None = None
    itl: list[float] = dataclasses.field(default_factory=list)
    e2e: float | None = None
    last: float = 0.0             # arrival of the latest chunk that carried a token
    chunks: int = 0               # chunks that carried a token (content or its logprobs)
    text: str = ""                # the answer (a multi-turn conversation carries it on)
    finish_reason: str | None = None
    usage_output: int | None = None
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def output_tokens(self) -> int:
        return self.usage_output if self.usage_output is not None else self.chunks

    @property
    def tpot(self) -> float | None:
        if self.ttft is None or self.e2e is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)

    def row(self) -> dict[str, Any]:
        ms = lambda s: None if s is None else s * 1000  # noqa: E731
        it = self.item
        return {"index": it.index, "session": it.session, "turn": it.turn, "group": it.group, "start_s": self.start,
                "input_len": it.input_len, "output_len": it.output_len, "prompt_tokens": self.prompt_tokens,
                "output_tokens": self.output_tokens, "cached_tokens": self.cached_tokens, "ttft_ms": ms(self.ttft),
                "tpot_ms": ms(self.tpot), "e2e_ms": ms(self.e2e), "itl_ms": [x * 1000 for x in self.itl],
                "finish_reason": self.finish_reason, "error": self.error}


def apply_event(rec: Record, obj: dict, t: float) -> None:
    """Fold one decoded SSE event (a completion or chat completion chunk, received ``t`` s after
    the send) into ``rec``. Text, chat content and reasoning all count as content for the timings;
    only text and content go into the answer. A chunk whose tokens decode to no text yet (part of
    a multi-byte character, random token ids) counts too when it carries them (its ``logprobs``):
    the token was generated then, and a TTFT taken at the first visible character would not be
    the server's."""
    if obj.get("error"):
        rec.error = f"stream error: {error_message(obj)}"
        return
    if obj.get("usage"):
        u = obj["usage"]
        rec.prompt_tokens, rec.usage_output = u.get("prompt_tokens"), u.get("completion_tokens")
        rec.cached_tokens = (u.get("prompt_tokens_details") or {}).get("cached_tokens")
    for ch in obj.get("choices") or []:
        delta = ch.get("delta") or {}
        answer = ch.get("text") or delta.get("content") or ""
        lp = ch.get("logprobs") or {}
        if answer or delta.get("reasoning_content") or delta.get("reasoning") or lp.get("tokens") or lp.get("content"):
            if rec.ttft is None:
                rec.ttft = t
            else:
                rec.itl.append(t - rec.last)
            rec.last, rec.chunks, rec.text = t, rec.chunks + 1, rec.text + answer
        if ch.get("finish_reason"):
            rec.finish_reason = ch["finish_reason"]


def percentile(xs: list[float], q: float) -> float:
    """The ``q``-th percentile (0..100) of sorted, non-empty ``xs``, interpolated linearly between
    closest ranks (numpy's default)."""
    pos = (len(xs) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def describe(values: list[float]) -> dict[str, float | None]:
    """mean, p50, p90, p99 (all None without values)."""
    xs = sorted(values)
    if not xs:
        return dict.fromkeys(STATS)
    return {"mean": sum(xs) / len(xs), "p50": percentile(xs, 50), "p90": percentile(xs, 90), "p99": percentile(xs, 99)}


def summarize(records: list[Record], duration: float) -> dict[str, Any]:
    """One run's totals, throughputs (per second of ``duration``, completed requests only) and
    latency statistics in ms. The prefix-cache hit share is over requests whose usage reports
    cached tokens (None when none does)."""
    done = [r for r in records if r.ok]
    errors = [r for r in records if not r.ok]
    prompt = sum(r.prompt_tokens or 0 for r in done)
    output = sum(r.output_tokens for r in done)
    cached_rows = [r for r in done if r.cached_tokens is not None and r.prompt_tokens]
    cached = sum(r.cached_tokens for r in cached_rows)
    per_s = lambda x: x / duration if duration > 0 else 0.0  # noqa: E731
    ms = lambda xs: describe([x * 1000 for x in xs if x is not None])  # noqa: E731
    return {
        "requests": len(records), "completed": len(done), "errors": len(errors),
        "error_sample": errors[0].error if errors else None, "duration_s": duration,
        "request_throughput": per_s(len(done)), "output_throughput": per_s(output),
        "total_token_throughput": per_s(prompt + output), "prompt_tokens": prompt, "output_tokens": output,
        "cached_tokens": cached,
        "prefix_cache_hit_share": cached / sum(r.prompt_tokens for r in cached_rows) if cached_rows else None,
        "short_outputs": sum(r.output_tokens < r.item.output_len for r in done),
        "ttft_ms": ms([r.ttft for r in done]), "tpot_ms": ms([r.tpot for r in done]),
        "itl_ms": ms([x for r in done for x in r.itl]), "e2e_ms": ms([r.e2e for r in done]),
    }


def error_message(obj: Any) -> str:
    """The message of an error body: OpenAI's ``{"error": {"message"}}``, FastAPI's ``{"detail"}``
    (``transformers serve``), else the object itself; at most 200 characters."""
    err = obj.get("error", obj.get("detail")) if isinstance(obj, dict) else obj
    if isinstance(err, dict) and err.get("message"):
        err = err["message"]
    return str(err)[:200]
