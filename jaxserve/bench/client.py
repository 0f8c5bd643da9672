"""HTTP against one OpenAI-compatible endpoint (httpx, imported lazily): request bodies, the
conversation a multi-turn session carries, streaming one request into a ``Record``."""

from __future__ import annotations

import json
import random
import time

from jaxserve.bench.metrics import Record, apply_event, error_message
from jaxserve.bench.workload import BenchError, Item, random_text

CALIBRATION_WORDS = (40, 120)  # two text lengths: the prompt-token difference over the word difference


def request_body(api: str, model: str, prompt, max_tokens: int, ignore_eos: bool, stream: bool = True,
                 token_logprobs: bool = True) -> dict:
    """A greedy (streamed) request: ``prompt`` is a message list for chat, ids or text otherwise.

    ``token_logprobs`` (streamed requests only) asks for the sampled tokens' logprobs (``logprobs:
    0`` on completions, ``logprobs: true`` on chat; no alternatives), so every generated token
    arrives in a chunk of its own that ``apply_event`` can time: without them an OpenAI-style
    server sends nothing for a token whose text is held back (part of a multi-byte character,
    which random token ids produce often), and TTFT / ITL would be those of the visible text."""
    body = {"model": model, "messages" if api == "chat" else "prompt": prompt, "max_tokens": max_tokens,
            "temperature": 0, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
        if token_logprobs:
            body["logprobs"] = True if api == "chat" else 0
    if ignore_eos:
        body["ignore_eos"] = True
    return body


class Conversation:
    """One session's context: ``prompt(item)`` is what the next request sends, ``answered`` adds
    its answer. Chat keeps the messages; completions keep the previous prompt + answer as text
    (an answer comes back as text, so only one-turn sessions send token ids)."""

    def __init__(self, api: str):
        self.api, self.messages, self.context = api, [], None

    def prompt(self, item: Item):
        if self.api == "chat":
            return self.messages + [{"role": "user", "content": item.user}]
        if self.context is None:
            return list(item.user) if isinstance(item.user, tuple) else item.user
        return f"{self.context}\n{item.user}"

    def answered(self, prompt, answer: str) -> None:
        if self.api == "chat":
            self.messages = prompt + [{"role": "assistant", "content": answer}]
        elif isinstance(prompt, str):
            self.context = prompt + answer


class Client:
    """One OpenAI-compatible endpoint."""

    def __init__(self, http, url: str, api_key: str | None, api: str):
        """``url``: the server's root; an OpenAI-style base URL ending in /v1 is taken as its root."""
        self.http, self.url, self.api = http, url.rstrip("/").removesuffix("/v1"), api
        self.path = "/v1/chat/completions" if api == "chat" else "/v1/completions"
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    async def _call(self, method: str, path: str, **kw):
        """One plain request; a failure to connect or a non-200 answer is a BenchError."""
        import httpx

        try:
            resp = await self.http.request(method, self.url + path, headers=self.headers, **kw)
        except httpx.HTTPError as e:
            raise BenchError(f"cannot reach {self.url}: {e!r}") from None
        if resp.status_code != 200:
            raise BenchError(f"{self.url}{path} answered HTTP {resp.status_code}: {error_text(resp.text)}")
        try:
            return resp.json()
        except ValueError:
            raise BenchError(f"{self.url}{path} answered something that is not JSON: {resp.text[:100]!r}") from None

    async def model(self, name: str | None) -> str:
        """``name``, once the server answers /v1/models; without one, the first model it lists."""
        listing = await self._call("GET", "/v1/models")
        try:
            return name or listing["data"][0]["id"]
        except (KeyError, IndexError, TypeError):
            raise BenchError(f"{self.url}/v1/models lists no model; pass --model") from None

    async def tokens_per_word(self, model: str) -> float:
        """The server's prompt tokens per word of ``random_text``: the prompt-token difference of
        two non-streamed one-token requests over their word difference (a chat template's fixed
        cost cancels out). 1.0 when the server reports no usage."""
        counts = []
        for n in CALIBRATION_WORDS:
            text = random_text(random.Random(f"calibration-{n}"), n, 1.0)
            prompt = [{"role": "user", "content": text}] if self.api == "chat" else text
            out = await self._call("POST", self.path, json=request_body(self.api, model, prompt, 1, False, False))
            counts.append((out.get("usage") or {}).get("prompt_tokens"))
        if None in counts or counts[1] <= counts[0]:
            return 1.0
        return (counts[1] - counts[0]) / (CALIBRATION_WORDS[1] - CALIBRATION_WORDS[0])

    async def send(self, rec: Record, body: dict, run_t0: float) -> None:
        """Stream one request into ``rec``; every failure becomes ``rec.error``."""
        t0 = time.perf_counter()
        rec.start = t0 - run_t0
        try:
            async with self.http.stream("POST", self.url + self.path, json=body, headers=self.headers) as resp:
                if resp.status_code != 200:
                    text = (await resp.aread()).decode("utf-8", "replace")
                    rec.error = f"HTTP {resp.status_code}: {error_text(text)}"
                else:
                    async for line in resp.aiter_lines():
                        data = line[5:].strip() if line.startswith("data:") else None
                        if data == "[DONE]":
                            break
                        if data:
                            apply_event(rec, json.loads(data), time.perf_counter() - t0)
                        if rec.error:
                            break
        except Exception as e:  # noqa: BLE001 - any failure of one request is that request's error
            rec.error = f"{type(e).__name__}: {str(e) or repr(e)}"
        rec.e2e = time.perf_counter() - t0
        if rec.error is None and rec.finish_reason is None:
            rec.error = "stream ended without a finish_reason"


def error_text(text: str) -> str:
    """``error_message`` of a response body, or the body's text when it is not JSON."""
    try:
        return error_message(json.loads(text))
    except ValueError:
        return text.strip()[:200]
