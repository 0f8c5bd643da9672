"""``jaxserve probe``: ground-truth probes and the seed's hammer against any OpenAI-compatible endpoint.

    jaxserve probe --url http://127.0.0.1:8000 [--reference-url URL2] [--n 500] [--concurrency 8]
                   [--abort-fraction 0.3] [--seed S] [--needle-tokens 1000 4000] [--json]

What it sends (``plan``): ``n`` streamed greedy chat completions over a set of distinct prompts
built from ``weights/groundtruth/tasks.py`` (arithmetic, needle, recall; half the needles are
siblings of another one -- same context, another name -- so they share a long prefix and hit the
cache part way). Each distinct prompt is sent once cold and then ``repeats - 1`` more times; a
repeat waits until its prompt's cold answer has finished, so it can hit the prefix cache.
``abort_fraction`` of the requests are abandoned streams (closed after 0-3 tokens, before or
during decode) scattered among them, and ``concurrency`` streams are in flight at all times.

What it checks (``analyze``), ARCHITECTURE.md invariant 6, "hit equals cold": every later completion of
a prompt must equal its cold (first) completion -- token by token when the server returns
logprobs tokens, else by text. A difference is a **hit-vs-cold mismatch**; with
``--reference-url`` every completion is also compared with the other server's answer to the
same prompt (**reference mismatch**), by tokens where both servers return them, else by text
(``transformers serve`` ignores ``logprobs``, so against it the comparison is by text; the name
sent to it is the one model it lists). Exact-match scores (right / wrong, and wrong-on-hit:
wrong on a repeat while right cold) measure the model, not corruption. The server's Prometheus
``/metrics`` adds its snapshot checksum mismatches and how many pages / slots requests still hold
once the run is over (invariant 7: zero).

``--kinds image`` runs the image probe instead (``image_plan``, ``analyze_images``): two fresh
random images at the same place after the same long text, alternated with repeats, one request at a
time; it counts **cross-hits** (a first send of a fresh image that hits further than the text before
it: the cache took another image's tokens) and hit-vs-cold mismatches. It needs a model with a vision
tower and no trained one: it checks the cache, not the answers.

Exit code: 0 no corruption found, 1 corruption found (a hit-vs-cold or reference mismatch, or a
non-zero snapshot checksum mismatch count), 2 usage or connection errors.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import random
import sys
import time
from typing import Any

from weights.groundtruth import tasks

REPEATS = 4  # sends of each distinct prompt that are not aborted: one cold, the rest hits
# The server metrics the report quotes, matched by suffix (jaxserve's are prefixed "jaxserve_").
METRICS = ("snapshot_checksum_mismatches", "kv_pages_used", "kv_pages_total", "state_slots_used",
           "state_slots_total", "prefix_cache_pages", "prefix_cache_snapshots", "num_requests_running",
           "num_requests_waiting")


class ProbeError(ValueError):
    """A usage or connection error: reported as one line, exit code 2."""


# ---------------------------------------------------------------------------------------------
# The plan: which prompt each request sends, and how it ends.
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Job:
    idx: int
    key: int          # the distinct prompt
    kind: str
    messages: tuple   # the conversation without its answer
    answer: str
    role: str         # "cold" (the prompt's first full send), "repeat", or "abort"
    abort_after: int = 0  # abort: close the stream after this many token chunks


def needle_sibling(probe: tasks.Probe, rng: random.Random) -> tasks.Probe | None:
    """The same needle context asking for another name (a long shared prefix, a partial hit)."""
    context, question = probe.messages[-1]["content"].rsplit("\n\n", 1)
    target = question[len("What is the code for "):-1]
    names = [ln[len("The code for "):].split(" is ")[0] for ln in context.split("\n")]
    others = [n for n in names if n != target]
    if not others:
        return None
    msgs = [{"role": "user", "content": f"{context}\n\nWhat is the code for {rng.choice(others)}?"}]
    return tasks.Probe("needle", msgs, tasks.answer_of(msgs + [{"role": "assistant", "content": ""}]))


def distinct_prompts(count: int, seed: int, needle_tokens: tuple[int, int],
                     kinds: tuple[str, ...] = tasks.KINDS) -> list[tasks.Probe]:
    """``count`` prompts, kinds in turn; every second needle is a sibling of the one before."""
    per_kind = -(-count // len(kinds))
    by_kind = {k: [p for p in tasks.probes(per_kind, seed, needle_tokens) if p.kind == k] for k in kinds}
    rng = random.Random(seed)
    needles = by_kind.get("needle", [])
    for i in range(1, len(needles), 2):
        needles[i] = needle_sibling(needles[i - 1], rng) or needles[i]
    out = [by_kind[k][i] for i in range(per_kind) for k in kinds]
    return out[:count]


def plan(n: int, abort_fraction: float, seed: int, needle_tokens: tuple[int, int] = (1000, 4000),
         repeats: int = REPEATS, kinds: tuple[str, ...] = tasks.KINDS) -> list[Job]:
    """``n`` jobs in sending order: round 0 sends every distinct prompt cold, later rounds repeat
    them (shuffled), aborted streams of random prompts are scattered everywhere."""
    n_abort = min(n - 1, round(n * abort_fraction))
    n_full = n - n_abort
    count = -(-n_full // repeats)
    prompts = distinct_prompts(count, seed, needle_tokens, kinds)
    rng = random.Random(seed + 1)
    order: list[tuple[int, str]] = []
    for r in range(repeats):
        keys = list(range(count))
        if r:
            rng.shuffle(keys)
        order += [(k, "cold" if r == 0 else "repeat") for k in keys]
    order = order[:n_full]
    for _ in range(n_abort):
        order.insert(rng.randint(0, len(order)), (rng.randrange(count), "abort"))
    jobs = []
    for i, (k, role) in enumerate(order):
        p = prompts[k]
        jobs.append(Job(i, k, p.kind, tuple(p.messages), p.answer, role,
                        rng.randint(0, 3) if role == "abort" else 0))
    return jobs


# ---------------------------------------------------------------------------------------------
# Results and the analysis (pure: unit-tested without a server).
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Result:
    job: Job
    text: str = ""
    tokens: list[str] | None = None  # the generated tokens (from logprobs), when the server gives them
    finish_reason: str | None = None
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    ttft: float | None = None
    total: float | None = None
    aborted: bool = False
    error: str | None = None
    done_at: float = 0.0

    @property
    def completed(self) -> bool:
        return not self.aborted and self.error is None


def same_answer(a: Result, b: Result) -> bool:
    """Token by token where both carry tokens, else by text."""
    if a.tokens is not None and b.tokens is not None:
        return a.tokens == b.tokens
    return a.text == b.text


def percentiles(values: list[float]) -> dict[str, float | None]:
    """Nearest-rank p50 / p90 / p99 (None without values)."""
    xs = sorted(values)
    pick = lambda q: xs[max(0, math.ceil(q * len(xs)) - 1)] if xs else None  # noqa: E731
    return {"p50": pick(0.50), "p90": pick(0.90), "p99": pick(0.99)}


def cold_of(results: list[Result]) -> Result | None:
    """The reference answer of one prompt: its cold send if that completed, else the first
    completion to finish."""
    done = [r for r in results if r.completed]
    cold = [r for r in done if r.job.role == "cold"]
    return cold[0] if cold else min(done, key=lambda r: r.done_at, default=None)


def analyze(results: list[Result], reference: dict[int, Result] | None = None) -> dict[str, Any]:
    """Per-kind counts, totals, cached-token share, latency percentiles, mismatch examples."""
    zero = dict(requests=0, completed=0, right=0, wrong=0, hits_compared=0, hit_vs_cold_mismatches=0,
                wrong_on_hit=0, reference_compared=0, reference_mismatches=0, errors=0, aborted=0)
    kinds: dict[str, dict[str, int]] = {}
    by_key: dict[int, list[Result]] = {}
    for r in results:
        by_key.setdefault(r.job.key, []).append(r)
    examples = []
    for key, rs in by_key.items():
        c = kinds.setdefault(rs[0].job.kind, dict(zero))
        cold = cold_of(rs)
        ref = (reference or {}).get(key)
        for r in rs:
            c["requests"] += 1
            if r.error is not None:
                c["errors"] += 1
                continue
            if r.aborted:
                c["aborted"] += 1
                continue
            c["completed"] += 1
            right = tasks.score(r.job.answer, r.text)
            c["right" if right else "wrong"] += 1
            if r is not cold:
                c["hits_compared"] += 1
                if not same_answer(r, cold):
                    c["hit_vs_cold_mismatches"] += 1
                    examples.append({"what": "hit vs cold", "kind": r.job.kind, "prompt": key, "request": r.job.idx,
                                     "cold": cold.text, "got": r.text, "cached_tokens": r.cached_tokens})
                if not right and tasks.score(r.job.answer, cold.text):
                    c["wrong_on_hit"] += 1
            if ref is not None and ref.completed:
                c["reference_compared"] += 1
                if not same_answer(r, ref):
                    c["reference_mismatches"] += 1
                    examples.append({"what": "vs reference", "kind": r.job.kind, "prompt": key, "request": r.job.idx,
                                     "reference": ref.text, "got": r.text})
    kinds = {k: kinds[k] for k in sorted(kinds, key=lambda k: (tasks.KINDS + (k,)).index(k))}
    totals = {f: sum(c[f] for c in kinds.values()) for f in zero}
    done = [r for r in results if r.completed]
    with_usage = [r for r in done if r.prompt_tokens]
    prompt = sum(r.prompt_tokens for r in with_usage)
    cached = sum(r.cached_tokens or 0 for r in with_usage)
    return {
        "kinds": kinds, "totals": totals,
        "cached_tokens": cached, "prompt_tokens": prompt,
        "cached_token_share": cached / prompt if prompt else None,
        "latency_s": {"total": percentiles([r.total for r in done if r.total is not None]),
                      "ttft": percentiles([r.ttft for r in done if r.ttft is not None])},
        "mismatch_examples": examples[:10],
    }


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text format -> {metric name: value}, label sets summed; comments skipped."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        name_labels, _, rest = line.rpartition("}") if "}" in line else line.partition(" ")
        name = name_labels.split("{", 1)[0].strip()
        try:
            value = float(rest.split()[0])
        except (IndexError, ValueError):
            continue
        out[name] = out.get(name, 0.0) + value
    return out


def server_state(metrics: dict[str, float]) -> dict[str, float | None]:
    """The metrics of ``METRICS`` (by suffix), plus what requests still hold beyond the tree."""
    pick = {}
    for suffix in METRICS:
        hits = [v for k, v in metrics.items() if k.endswith(suffix)]
        pick[suffix] = hits[0] if hits else None
    held = lambda used, tree: None if pick[used] is None or pick[tree] is None else pick[used] - pick[tree]  # noqa: E731
    pick["kv_pages_held_by_requests"] = held("kv_pages_used", "prefix_cache_pages")
    pick["state_slots_held_by_requests"] = held("state_slots_used", "prefix_cache_snapshots")
    return pick


def verdict(analysis: dict[str, Any], server: dict[str, float | None] | None) -> bool:
    """True when corruption was found."""
    t = analysis["totals"]
    checksums = (server or {}).get("snapshot_checksum_mismatches") or 0
    return t["hit_vs_cold_mismatches"] > 0 or t["reference_mismatches"] > 0 or checksums > 0


def render(report: dict[str, Any]) -> str:
    """The human report."""
    a = report
    lines = [f"probe of {a['url']} (model {a['model']}): {a['requests']} requests, concurrency {a['concurrency']}, "
             f"{a['elapsed_s']:.1f}s"
             + (f", reference {a['reference_url']} (compared by {a.get('reference_compared_by')})"
                if a.get("reference_url") else "")]
    cols = ("requests", "completed", "right", "wrong", "hit_vs_cold_mismatches", "wrong_on_hit",
            "reference_mismatches", "errors", "aborted")
    heads = ("sent", "done", "right", "wrong", "hit!=cold", "wrong-on-hit", "ref!=", "errors", "aborted")
    lines.append(f"  {'kind':<11}" + "".join(f"{h:>13}" for h in heads))
    for k, c in list(a["kinds"].items()) + [("total", a["totals"])]:
        lines.append(f"  {k:<11}" + "".join(f"{c[f]:>13}" for f in cols))
    share = a["cached_token_share"]
    lines.append(f"  hits compared with their cold answer: {a['totals']['hits_compared']}; cached-token share: "
                 + (f"{share:.1%} ({a['cached_tokens']}/{a['prompt_tokens']} prompt tokens)" if share is not None
                    else "n/a (no usage reported)"))
    fmt = lambda p: " ".join(f"{q} {v * 1000:.0f}ms" if v is not None else f"{q} n/a" for q, v in p.items())  # noqa: E731
    lines.append(f"  latency: total {fmt(a['latency_s']['total'])}; time to first token {fmt(a['latency_s']['ttft'])}")
    s = a.get("server")
    if s:
        show = lambda k: "n/a" if s.get(k) is None else f"{s[k]:g}"  # noqa: E731
        lines.append(f"  server: snapshot checksum mismatches {show('snapshot_checksum_mismatches')}; KV pages used "
                     f"{show('kv_pages_used')}/{show('kv_pages_total')} (tree {show('prefix_cache_pages')}, requests "
                     f"{show('kv_pages_held_by_requests')}); state slots used {show('state_slots_used')}/"
                     f"{show('state_slots_total')} (tree {show('prefix_cache_snapshots')}, requests "
                     f"{show('state_slots_held_by_requests')})")
    else:
        lines.append("  server: no /metrics (checksums and pool use not checked)")
    for ex in a["mismatch_examples"][:5]:
        want = ex.get("cold", ex.get("reference"))
        lines.append(f"  mismatch ({ex['what']}, {ex['kind']}, prompt {ex['prompt']}, request {ex['request']}): "
                     f"expected {want!r}, got {ex['got']!r}")
    lines.append("CORRUPTION FOUND" if a["corruption"] else "no corruption found")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# The image probe (``--kinds image``): content-keyed cache keys (ARCHITECTURE.md invariant 5).
# ---------------------------------------------------------------------------------------------

IMAGE_SIDE = 384  # pixels: >= 128 soft tokens for any Qwen-style processor (32 px a token or less)
SLACK = 64  # tokens a legitimate first send may hit past the anchor (one snapshot boundary)
IMAGE_QUESTION = "Describe the image."
_WORDS = ("the", "red", "house", "stands", "near", "a", "river", "and", "every", "morning", "birds", "sing",
          "over", "green", "fields", "while", "people", "walk", "to", "work")


def probe_png(seed: int, side: int = IMAGE_SIDE) -> bytes:
    """A ``side`` x ``side`` PNG of random pixels: two seeds, two images no cache key may confuse."""
    import io

    import numpy as np
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, (side, side, 3), dtype=np.uint8)).save(buf, "PNG")
    return buf.getvalue()


def image_plan(rounds: int, repeats: int, seed: int, prefix_words: int = 300, side: int = IMAGE_SIDE) -> list[Job]:
    """The image probe's jobs, sent one at a time in this order: a warm-up (the shared text and the
    question without an image: it caches the text and no image), then per round two fresh images A
    and B of one size at the same place after that text, sent A, B, A, B, ... ``repeats`` times each.
    ``key``: 0 the warm-up, 2r + 1 round r's A, 2r + 2 its B; an image's first send is ``cold``."""
    import base64

    rng = random.Random(seed)
    prefix = " ".join(rng.choice(_WORDS) for _ in range(prefix_words)) + "\n"
    question = {"type": "text", "text": IMAGE_QUESTION}

    def messages(key: int) -> tuple:
        if key == 0:
            return ({"role": "user", "content": [{"type": "text", "text": prefix}, question]},)
        url = "data:image/png;base64," + base64.b64encode(probe_png(seed * 1_000_003 + key, side)).decode()
        return ({"role": "user", "content": [{"type": "text", "text": prefix},
                                             {"type": "image_url", "image_url": {"url": url}}, question]},)

    order = [(0, "warmup")] + [(2 * r + ab, "cold" if i == 0 else "repeat")
                               for r in range(rounds) for i in range(repeats) for ab in (1, 2)]
    return [Job(i, key, "image", messages(key), "", role) for i, (key, role) in enumerate(order)]


def analyze_images(results: list[Result]) -> dict[str, Any]:
    """Cross-hits and hit-vs-cold mismatches of ``image_plan``'s results.

    The anchor: round 0's A, the first image ever sent after the text, can only hit the text the
    warm-up cached (no image came before it). Every later image is fresh too when first sent, so it
    may hit that text plus at most the few tokens that open an image (``SLACK`` covers one cache
    boundary) and nothing of the image itself, which spans more than ``SLACK`` tokens. A **cross-hit**
    is a first send that hits further: the cache took another image's tokens for its own. A
    **mismatch**: a later send of an image whose answer (tokens, else text) differs from its first,
    cold send. The model's accuracy plays no part: no answer is scored. Eviction only shortens hits,
    so it never makes a cross-hit."""
    by_key: dict[int, list[Result]] = {}
    for r in results:
        by_key.setdefault(r.job.key, []).append(r)
    counts = dict(requests=len(results), completed=sum(r.completed for r in results),
                  errors=sum(r.error is not None for r in results), first_sends_compared=0, cross_hits=0,
                  hits_compared=0, hit_vs_cold_mismatches=0)
    examples = []
    firsts = {k: cold_of(rs) for k, rs in by_key.items() if k > 0}
    anchor = firsts.get(1)
    anchor_tokens = anchor.cached_tokens if anchor is not None and anchor.job.role == "cold" else None
    for key in sorted(firsts):
        first = firsts[key]
        if first is None:
            continue
        for r in by_key[key]:
            if r is first or not r.completed:
                continue
            counts["hits_compared"] += 1
            if not same_answer(r, first):
                counts["hit_vs_cold_mismatches"] += 1
                examples.append({"what": "hit vs cold", "image": key, "request": r.job.idx, "cold": first.text,
                                 "got": r.text, "cached_tokens": r.cached_tokens})
        if key == 1 or anchor_tokens is None or first.job.role != "cold" or first.cached_tokens is None:
            continue
        counts["first_sends_compared"] += 1
        if first.cached_tokens > anchor_tokens + SLACK:
            counts["cross_hits"] += 1
            examples.append({"what": "cross-hit", "image": key, "request": first.job.idx,
                             "anchor": anchor_tokens, "cached_tokens": first.cached_tokens})
    return {**counts, "anchor_cached_tokens": anchor_tokens, "mismatch_examples": examples[:10]}


def render_images(report: dict[str, Any]) -> str:
    """The human report of the image probe."""
    a = report
    lines = [f"image probe of {a['url']} (model {a['model']}): {a['requests']} requests in {a['rounds']} rounds of "
             f"two images, {a['elapsed_s']:.1f}s",
             f"  completed {a['completed']}, errors {a['errors']}; first sends compared {a['first_sends_compared']} "
             f"(the text's hit: {a['anchor_cached_tokens']} tokens); cross-hits {a['cross_hits']}; hits compared "
             f"{a['hits_compared']}, hit != cold {a['hit_vs_cold_mismatches']}"]
    s = a.get("server")
    if s:
        lines.append(f"  server: snapshot checksum mismatches {s.get('snapshot_checksum_mismatches')}")
    for ex in a["mismatch_examples"][:5]:
        lines.append(f"  {ex['what']} (image {ex['image']}, request {ex['request']}): "
                     + (f"cached {ex['cached_tokens']} tokens, the text's hit is {ex['anchor']}"
                        if ex["what"] == "cross-hit" else f"expected {ex['cold']!r}, got {ex['got']!r}"))
    lines.append("CORRUPTION FOUND" if a["corruption"] else "no corruption found")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# HTTP.
# ---------------------------------------------------------------------------------------------


class Client:
    """One OpenAI-compatible endpoint: streamed greedy chat completions."""

    def __init__(self, http, url: str, api_key: str | None, model: str | None, max_tokens: int):
        self.http, self.url, self.model, self.max_tokens = http, url.rstrip("/"), model, max_tokens
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.logprobs = True  # dropped if the server refuses it

    async def connect(self) -> None:
        """Check the server answers and pick the model (the first listed, unless given)."""
        import httpx

        try:
            resp = await self.http.get(self.url + "/v1/models", headers=self.headers)
        except httpx.HTTPError as e:
            raise ProbeError(f"cannot reach {self.url}: {e!r}") from None
        if resp.status_code != 200:
            raise ProbeError(f"{self.url}/v1/models answered HTTP {resp.status_code}: {_error_message(resp.text)}")
        if self.model is None:
            try:
                self.model = resp.json()["data"][0]["id"]
            except (ValueError, KeyError, IndexError, TypeError):
                raise ProbeError(f"{self.url}/v1/models lists no model; pass --model") from None

    async def metrics(self) -> dict[str, float] | None:
        import httpx

        try:
            resp = await self.http.get(self.url + "/metrics", headers=self.headers)
        except httpx.HTTPError:
            return None
        return parse_metrics(resp.text) if resp.status_code == 200 else None

    async def send(self, job: Job) -> Result:
        res = Result(job)
        t0 = time.perf_counter()
        body = {"model": self.model, "messages": list(job.messages), "stream": True, "temperature": 0,
                "max_tokens": self.max_tokens, "stream_options": {"include_usage": True}}
        try:
            for attempt in range(2):
                if self.logprobs:
                    body["logprobs"] = True
                else:
                    body.pop("logprobs", None)
                async with self.http.stream("POST", self.url + "/v1/chat/completions", json=body,
                                            headers=self.headers) as resp:
                    if resp.status_code != 200:
                        msg = _error_message((await resp.aread()).decode("utf-8", "replace"))
                        if resp.status_code == 400 and self.logprobs and "logprobs" in msg and attempt == 0:
                            self.logprobs = False
                            continue
                        res.error = f"HTTP {resp.status_code}: {msg}"
                        break
                    await self._read_stream(resp, res, t0)
                    break
        except Exception as e:  # noqa: BLE001 - any failure of one request is that request's error
            res.error = f"{type(e).__name__}: {e}"
        if res.error is None and not res.aborted and res.finish_reason is None:
            res.error = "stream ended without a finish_reason"
        res.total = time.perf_counter() - t0
        res.done_at = time.monotonic()
        return res

    async def _read_stream(self, resp, res: Result, t0: float) -> None:
        chunks = 0
        async for line in resp.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            obj = json.loads(data)
            if obj.get("error"):
                res.error = f"stream error: {_error_message(data)}"
                return
            if obj.get("usage"):
                u = obj["usage"]
                res.prompt_tokens = u.get("prompt_tokens")
                res.cached_tokens = (u.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
            for ch in obj.get("choices") or []:
                piece = (ch.get("delta") or {}).get("content") or ""
                lp = (ch.get("logprobs") or {}).get("content")
                if piece or lp:
                    chunks += 1
                    if res.ttft is None:
                        res.ttft = time.perf_counter() - t0
                res.text += piece
                if lp is not None:
                    res.tokens = (res.tokens or []) + [e.get("token") for e in lp]
                if ch.get("finish_reason"):
                    res.finish_reason = ch["finish_reason"]
            if res.job.role == "abort" and res.finish_reason is None and chunks >= res.job.abort_after:
                res.aborted = True  # leaving the ``async with`` closes the connection mid-stream
                return


def _error_message(text: str) -> str:
    try:
        return str(json.loads(text)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return text.strip()[:200]


async def _hammer(client: Client, jobs: list[Job], concurrency: int, progress) -> list[Result]:
    """Send ``jobs`` in order with ``concurrency`` in flight; a repeat waits for its cold send."""
    cold_done = {j.key: asyncio.Event() for j in jobs}
    for key in {j.key for j in jobs} - {j.key for j in jobs if j.role == "cold"}:
        cold_done[key].set()
    queue = list(reversed(jobs))
    results: list[Result] = []

    async def worker():
        while queue:
            job = queue.pop()
            if job.role == "repeat":
                await cold_done[job.key].wait()
            try:
                res = await client.send(job)
            finally:
                if job.role == "cold":
                    cold_done[job.key].set()
            results.append(res)
            progress(len(results), len(jobs), sum(r.error is not None for r in results))

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return sorted(results, key=lambda r: r.job.idx)


async def _idle_metrics(client: Client, wait_s: float = 10.0) -> dict[str, float] | None:
    """/metrics once no request runs or waits (aborted streams are noticed by the server within
    its disconnect poll), or after ``wait_s``."""
    deadline = time.monotonic() + wait_s
    while True:
        m = await client.metrics()
        if m is None:
            return None
        s = server_state(m)
        if (not s["num_requests_running"] and not s["num_requests_waiting"]) or time.monotonic() > deadline:
            return m
        await asyncio.sleep(0.2)


async def probe(url: str, *, n: int = 500, concurrency: int = 8, abort_fraction: float = 0.3, seed: int = 0,
                needle_tokens: tuple[int, int] = (1000, 4000), reference_url: str | None = None,
                api_key: str | None = None, model: str | None = None, max_tokens: int = 16,
                repeats: int = REPEATS, kinds: tuple[str, ...] = tasks.KINDS, timeout: float = 600.0,
                show_progress: bool = False) -> dict[str, Any]:
    """Run the whole probe; returns the report (``render`` prints it)."""
    import httpx

    jobs = plan(n, abort_fraction, seed, needle_tokens, repeats, kinds)

    tty = sys.stderr.isatty()

    def progress(done: int, total: int, errors: int) -> None:
        """A counter on stderr: rewritten in place on a terminal, every 10% otherwise."""
        if not show_progress or not (tty or done == total or done % max(1, total // 10) == 0):
            return
        print(f"{chr(13) if tty else ''}probe: {done}/{total} requests" + (f" ({errors} errors)" if errors else ""),
              end="" if tty and done < total else "\n", file=sys.stderr, flush=True)

    limits = httpx.Limits(max_connections=concurrency + 2, max_keepalive_connections=concurrency + 2)
    t0 = time.perf_counter()
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as http:
        main = Client(http, url, api_key, model, max_tokens)
        await main.connect()
        results = await _hammer(main, jobs, concurrency, progress)
        elapsed = time.perf_counter() - t0
        metrics = await _idle_metrics(main)
        reference, ref_by = None, None
        if reference_url:
            ref = Client(http, reference_url, api_key, None, max_tokens)
            await ref.connect()
            firsts = {}
            for j in jobs:
                firsts.setdefault(j.key, dataclasses.replace(j, role="cold"))
            refs = await _hammer(ref, list(firsts.values()), concurrency, lambda *a: None)
            reference = {r.job.key: r for r in refs}
            ref_by = "tokens" if main.logprobs and all(r.tokens is not None for r in refs if r.completed) else "text"
    if not any(r.completed for r in results):
        first = next((r.error for r in results if r.error), "every stream was aborted")
        raise ProbeError(f"no request to {url} completed: {first}")
    report = {"url": url, "model": main.model, "reference_url": reference_url, "requests": n,
              "concurrency": concurrency, "abort_fraction": abort_fraction, "seed": seed, "max_tokens": max_tokens,
              "needle_tokens": list(needle_tokens), "kinds": list(kinds),
              "compared_by": "tokens" if main.logprobs else "text", "reference_compared_by": ref_by,
              "elapsed_s": elapsed}
    report.update(analyze(results, reference))
    report["server"] = server_state(metrics) if metrics is not None else None
    report["corruption"] = verdict(report, report["server"])
    return report


async def image_probe(url: str, *, rounds: int = 8, repeats: int = REPEATS, seed: int = 0, api_key: str | None = None,
                      model: str | None = None, max_tokens: int = 16, timeout: float = 600.0) -> dict[str, Any]:
    """Run the image probe (``image_plan``, one request at a time: the cross-hit check needs A's
    first send done before B's); returns the report (``render_images`` prints it)."""
    import httpx

    jobs = image_plan(rounds, repeats, seed)
    t0 = time.perf_counter()
    async with httpx.AsyncClient(timeout=timeout) as http:
        client = Client(http, url, api_key, model, max_tokens)
        await client.connect()
        results = await _hammer(client, jobs, 1, lambda *a: None)
        metrics = await _idle_metrics(client)
    elapsed = time.perf_counter() - t0
    if not any(r.completed for r in results):
        first = next((r.error for r in results if r.error), "no request completed")
        raise ProbeError(f"no image request to {url} completed: {first}")
    report = {"url": url, "model": client.model, "requests": len(jobs), "rounds": rounds, "repeats": repeats,
              "seed": seed, "max_tokens": max_tokens, "compared_by": "tokens" if client.logprobs else "text",
              "elapsed_s": elapsed}
    report.update(analyze_images(results))
    report["server"] = server_state(metrics) if metrics is not None else None
    checksums = (report["server"] or {}).get("snapshot_checksum_mismatches") or 0
    report["corruption"] = bool(report["cross_hits"] or report["hit_vs_cold_mismatches"] or checksums)
    return report


def main(args) -> int:
    """``jaxserve probe`` (args from cli.py's parser)."""
    try:
        import httpx  # noqa: F401
    except ImportError as e:
        raise ProbeError(f"the probe needs httpx (pip install -e '.[server]'): {e}") from None
    lo, hi = args.needle_tokens
    kinds = tuple(k.strip() for k in args.kinds.split(",") if k.strip())
    checks = [(args.n >= 1, "--n must be >= 1"), (args.concurrency >= 1, "--concurrency must be >= 1"),
              (0 <= args.abort_fraction < 1, "--abort-fraction must be in [0, 1)"),
              (12 < lo <= hi, "--needle-tokens needs 12 < MIN <= MAX"),
              (args.max_tokens >= 1, "--max-tokens must be >= 1"), (args.repeats >= 1, "--repeats must be >= 1"),
              (kinds and (set(kinds) <= set(tasks.KINDS) or kinds == ("image",)),
               f"--kinds must name some of {','.join(tasks.KINDS)}, or be image (alone)"),
              (args.url.startswith(("http://", "https://")), f"--url must start with http:// or https://, got {args.url!r}")]
    for ok, why in checks:
        if not ok:
            raise ProbeError(why)
    if kinds == ("image",):  # --n requests: two images a round, --repeats sends each
        report = asyncio.run(image_probe(
            args.url, rounds=max(1, args.n // (2 * args.repeats)), repeats=args.repeats, seed=args.seed,
            api_key=args.api_key, model=args.model, max_tokens=args.max_tokens, timeout=args.timeout))
        print(json.dumps(report) if args.json else render_images(report))
        return 1 if report["corruption"] else 0
    report = asyncio.run(probe(
        args.url, n=args.n, concurrency=args.concurrency, abort_fraction=args.abort_fraction, seed=args.seed,
        needle_tokens=(lo, hi), reference_url=args.reference_url, api_key=args.api_key, model=args.model,
        max_tokens=args.max_tokens, repeats=args.repeats, kinds=kinds, timeout=args.timeout, show_progress=not args.json))
    print(json.dumps(report) if args.json else render(report))
    return 1 if report["corruption"] else 0
