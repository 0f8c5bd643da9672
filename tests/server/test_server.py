"""The real server (uvicorn on 127.0.0.1, an ephemeral port) on the shipped tiny hybrid model, driven
by the official ``openai`` client and raw httpx: answers equal the engine's offline ``generate``,
OpenAI's formats, the prefix cache, disconnects, bad input, concurrency, metrics. The served engine
is conftest.py's ``ctx``."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from tests.server.harness import (CHAT, CONCURRENT, GREEDY, KEY, LOGPROB_ABS, LONG_IDS, MODEL, N, aborted,
                                  assert_pools_free, parse_metrics, sse_events, wait_idle)
from tests.server.harness import Server as _Server  # noqa: F401 - tests/test_probe.py and test_bench.py import it here


# ---------------------------------------------------------------------- plain routes


def test_health_models(ctx):
    assert ctx.http.get("/health").json() == {"status": "ok"}
    models = ctx.client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert ctx.client.models.retrieve(MODEL).id == MODEL
    r = ctx.http.get("/v1/models/nope")
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


# ---------------------------------------------------------------------- greedy equals offline generate


@pytest.mark.parametrize("key, prompt", [("hello", "Hello there"), ("ids", [5, 17, 42, 99, 300])])
def test_completion_equals_offline_generate(ctx, key, prompt):
    ref = ctx.ref[key]
    r = ctx.client.completions.create(model=MODEL, prompt=prompt, logprobs=1, **GREEDY)
    c = r.choices[0]
    assert c.text == ref.text and c.finish_reason == "length"
    assert c.logprobs.token_logprobs == pytest.approx(ref.logprobs, abs=LOGPROB_ABS)
    # per-token strings show special tokens (the trained default model may emit <|im_end|> mid-way
    # under ignore_eos); the text skips them
    assert "".join(t for t in c.logprobs.tokens if not (t.startswith("<|") and t.endswith("|>"))) == ref.text
    assert r.usage.prompt_tokens == len(ctx.prompts[key]) and r.usage.completion_tokens == N
    assert r.usage.total_tokens == len(ctx.prompts[key]) + N
    assert r.object == "text_completion" and r.model == MODEL


def test_chat_equals_offline_generate(ctx):
    ref = ctx.ref["chat"]
    r = ctx.client.chat.completions.create(model=MODEL, messages=CHAT, logprobs=True, **GREEDY)
    c = r.choices[0]
    assert c.message.role == "assistant" and c.message.content == ref.text and c.finish_reason == "length"
    assert [t.logprob for t in c.logprobs.content] == pytest.approx(ref.logprobs, abs=LOGPROB_ABS)
    assert r.usage.prompt_tokens == len(ctx.prompts["chat"]) and r.usage.completion_tokens == N
    # max_completion_tokens is chat's newer name for max_tokens
    r2 = ctx.client.chat.completions.create(model=MODEL, messages=CHAT, temperature=0, max_completion_tokens=3,
                                            extra_body={"ignore_eos": True})
    assert r2.usage.completion_tokens == 3 and ref.text.startswith(r2.choices[0].message.content)


def test_chat_stream_with_openai_client(ctx):
    ref = ctx.ref["chat"]
    stream = ctx.client.chat.completions.create(model=MODEL, messages=CHAT, stream=True,
                                                stream_options={"include_usage": True}, **GREEDY)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ref.text
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == N


# ---------------------------------------------------------------------- SSE format, raw


def test_sse_chat_format_raw(ctx):
    body = {"model": MODEL, "messages": CHAT, "stream": True, "stream_options": {"include_usage": True},
            "temperature": 0, "max_tokens": N, "ignore_eos": True}
    with ctx.http.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r.iter_lines())
    ids = {e["id"] for e in events}
    assert len(ids) == 1 and ids.pop().startswith("chatcmpl-")
    for e in events:
        assert e["object"] == "chat.completion.chunk" and e["model"] == MODEL and isinstance(e["created"], int)
        assert "usage" in e
    first, *content, final, usage_chunk = events
    assert first["choices"] == [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                 "finish_reason": None}] and first["usage"] is None
    for e in content:
        (c,) = e["choices"]
        assert set(c["delta"]) == {"content"} and c["finish_reason"] is None and e["usage"] is None
    assert "".join(e["choices"][0]["delta"]["content"] for e in content) == ctx.ref["chat"].text
    assert final["choices"] == [{"index": 0, "delta": {}, "logprobs": None, "finish_reason": "length"}]
    assert usage_chunk["choices"] == []
    u = usage_chunk["usage"]
    assert u["completion_tokens"] == N and u["prompt_tokens"] == len(ctx.prompts["chat"])
    assert u["total_tokens"] == u["prompt_tokens"] + N and "cached_tokens" in u["prompt_tokens_details"]


def test_sse_completion_format_raw(ctx):
    body = {"model": MODEL, "prompt": [5, 17, 42, 99, 300], "stream": True, "temperature": 0, "max_tokens": N,
            "ignore_eos": True, "logprobs": 0}
    with ctx.http.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        events = sse_events(r.iter_lines())
    for e in events:
        assert e["object"] == "text_completion" and e["id"].startswith("cmpl-") and "usage" not in e
    *content, final = events
    assert "".join(e["choices"][0]["text"] for e in content) == ctx.ref["ids"].text
    lps = [lp for e in content for lp in e["choices"][0]["logprobs"]["token_logprobs"]]
    assert lps == pytest.approx(ctx.ref["ids"].logprobs, abs=LOGPROB_ABS)
    assert final["choices"] == [{"index": 0, "text": "", "logprobs": None, "finish_reason": "length"}]


def _stop_inside(ref: str) -> tuple[str, str]:
    """A 2-character stop string first seen after the start of ``ref`` (the model's text may be as
    repetitive as "rarara..."), and the text a stop there leaves; a text with none stops at once on
    its first character."""
    stop = next((ref[i:i + 2] for i in range(1, len(ref) - 1) if ref[i:i + 2].strip() and ref.index(ref[i:i + 2]) == i),
                ref[:1])
    return stop, ref[: ref.index(stop)]


def test_stop_strings_streamed_and_not(ctx):
    stop, want = _stop_inside(ctx.ref["hello"].text)
    args = dict(model=MODEL, prompt="Hello there", stop=[stop, "\u2603never"], **GREEDY)
    r = ctx.client.completions.create(**args)
    assert r.choices[0].text == want and r.choices[0].finish_reason == "stop"
    pieces = [c.choices[0].text for c in ctx.client.completions.create(stream=True, **args)]
    assert "".join(pieces) == want
    stop, want = _stop_inside(ctx.ref["chat"].text)
    assert stop, ctx.ref["chat"].text
    chat = ctx.client.chat.completions.create(model=MODEL, messages=CHAT, stop=stop, **GREEDY)
    assert chat.choices[0].finish_reason == "stop" and chat.choices[0].message.content == want, ctx.ref["chat"].text


def test_top_k_reaches_the_sampler(ctx):
    """top_k 1 leaves only the argmax: hot sampling with it is greedy decoding."""
    r = ctx.client.completions.create(model=MODEL, prompt=ctx.prompts["hello"], max_tokens=N, temperature=1.5, seed=3,
                                      extra_body={"top_k": 1, "ignore_eos": True})
    assert r.choices[0].text == ctx.ref["hello"].text


def test_sampling_with_seed_is_reproducible(ctx):
    args = dict(model=MODEL, prompt="Hello there", max_tokens=8, temperature=0.9, top_p=0.9, seed=7,
                extra_body={"top_k": 50, "ignore_eos": True})
    a, b = (ctx.client.completions.create(**args).choices[0].text for _ in range(2))
    assert a == b


# ---------------------------------------------------------------------- prefix cache


def test_cached_tokens_on_repeated_long_prompt(ctx):
    ids = LONG_IDS
    first = ctx.client.completions.create(model=MODEL, prompt=ids, **GREEDY)
    second = ctx.client.completions.create(model=MODEL, prompt=ids, **GREEDY)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details.cached_tokens == (len(ids) - 1) // 64 * 64 == 128
    assert second.choices[0].text == first.choices[0].text  # hit equals cold
    # multi-turn chat: the follow-up reuses the first turn's prefix
    long_user = " ".join(f"word{i}" for i in range(60))
    turn1 = [{"role": "user", "content": long_user}]
    a = ctx.client.chat.completions.create(model=MODEL, messages=turn1, **GREEDY)
    turn2 = turn1 + [{"role": "assistant", "content": a.choices[0].message.content},
                     {"role": "user", "content": "and more?"}]
    b = ctx.client.chat.completions.create(model=MODEL, messages=turn2, **GREEDY)
    assert a.usage.prompt_tokens > 64 and b.usage.prompt_tokens_details.cached_tokens >= 64


# ---------------------------------------------------------------------- failed steps


@pytest.mark.parametrize("lose_pools", [False, True], ids=["pools-kept", "pools-lost"])
def test_failed_step_fails_its_request_and_the_server_keeps_serving(ctx, lose_pools):
    """A step that raises on the device (here: the next dispatch, after deleting the pools it would
    donate when ``lose_pools``, as an out-of-memory mid-step does) answers its request with a 500
    ``step_failed`` (a streamed one with an error event), and nothing else: /health stays 200, the
    next requests equal the offline reference, and no page or slot leaks."""
    import jax

    def arm(engine):
        ex = engine.executor
        real = ex.dispatch

        def failing(plan):
            ex.dispatch = real  # once
            if lose_pools:
                for x in jax.tree.leaves(ex.pools):
                    x.delete()
            raise RuntimeError("RESOURCE_EXHAUSTED: injected out of memory")
        ex.dispatch = failing

    before = ctx.engine.failed_steps
    ctx.aeng.call_sync(arm)
    r = ctx.http.post("/v1/completions", json={"model": MODEL, "prompt": "Hello there", "max_tokens": 4})
    assert r.status_code == 500 and r.json()["error"]["code"] == "step_failed", r.text
    ctx.aeng.call_sync(arm)
    body = {"model": MODEL, "prompt": "Hello there", "max_tokens": 4, "stream": True}
    with ctx.http.stream("POST", "/v1/completions", json=body) as resp:
        events = [json.loads(line[6:]) for line in resp.iter_lines() if line.startswith("data: {")]
    assert events[-1]["error"]["code"] == "step_failed"
    assert ctx.engine.failed_steps == before + 2
    assert parse_metrics(ctx.http.get("/metrics").text)["jaxserve_step_failures_total"] == before + 2
    assert ctx.http.get("/health").status_code == 200
    out = ctx.client.completions.create(model=MODEL, prompt=ctx.prompts["hello"], **GREEDY)
    assert out.choices[0].text == ctx.ref["hello"].text
    wait_idle(ctx)
    assert_pools_free(ctx)


# ---------------------------------------------------------------------- disconnects


def test_stream_disconnect_aborts_and_frees_pools(ctx):
    before = aborted(ctx)
    body = {"model": MODEL, "prompt": LONG_IDS[:100], "stream": True, "temperature": 0, "max_tokens": 3000,
            "ignore_eos": True}
    with httpx.Client(base_url=ctx.url, timeout=60) as h:
        with h.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            got = 0
            for line in lines:
                if line.startswith("data: "):
                    got += 1
                if got >= 3:
                    break
            # mid-stream: the request is running (3000 tokens to go), and it ends only by the abort
            assert ctx.aeng.call_sync(lambda e: [r.output_ids != [] for r in e.requests.values()]) == [True]
        # leaving the blocks closes the connection mid-stream
    wait_idle(ctx)
    assert aborted(ctx) == before + 1
    assert_pools_free(ctx)


def test_nonstream_disconnect_aborts(ctx):
    before = aborted(ctx)
    body = {"model": MODEL, "prompt": "Hello there", "temperature": 0, "max_tokens": 4000, "ignore_eos": True}
    with pytest.raises(httpx.TimeoutException):
        httpx.post(ctx.url + "/v1/completions", json=body, timeout=1.0)
    wait_idle(ctx)
    assert aborted(ctx) == before + 1
    assert_pools_free(ctx)


# ---------------------------------------------------------------------- bad input


def _chat(**kw):
    return {"model": MODEL, "messages": CHAT, "max_tokens": 2, **kw}


def _cmpl(**kw):
    return {"model": MODEL, "prompt": "hi", "max_tokens": 2, **kw}


BAD = [
    ("malformed json", "/v1/chat/completions", b'{"model": "tiny", "messages": [', 400, None),
    ("not an object", "/v1/completions", b"[1, 2]", 400, None),
    ("wrong type max_tokens", "/v1/completions", _cmpl(max_tokens="many"), 400, "max_tokens"),
    ("wrong type messages", "/v1/chat/completions", _chat(messages="hello"), 400, "messages"),
    ("wrong type prompt", "/v1/completions", _cmpl(prompt={"a": 1}), 400, "prompt"),
    ("unknown model", "/v1/chat/completions", _chat(model="gpt-17"), 404, "model"),
    ("missing messages", "/v1/chat/completions", {"model": MODEL}, 400, "messages"),
    ("missing model", "/v1/completions", {"prompt": "hi"}, 400, "model"),
    ("empty messages", "/v1/chat/completions", _chat(messages=[]), 400, "messages"),
    ("empty prompt", "/v1/completions", _cmpl(prompt=""), 400, "prompt"),
    ("empty prompt ids", "/v1/completions", _cmpl(prompt=[]), 400, "prompt"),
    ("ids out of vocab", "/v1/completions", _cmpl(prompt=[1, 99999]), 400, "prompt"),
    ("negative max_tokens", "/v1/completions", _cmpl(max_tokens=-1), 400, "max_tokens"),
    ("zero max_tokens", "/v1/chat/completions", _chat(max_tokens=0), 400, "max_tokens"),
    ("oversized max_tokens", "/v1/completions", _cmpl(max_tokens=10 ** 7), 400, "max_tokens"),
    ("oversized max_completion_tokens", "/v1/chat/completions", _chat(max_completion_tokens=10 ** 7), 400,
     "max_completion_tokens"),
    ("prompt longer than context", "/v1/completions", _cmpl(prompt=[1] * 5000), 400, "prompt"),
    ("n > 1", "/v1/chat/completions", _chat(n=2), 400, "n"),
    ("best_of", "/v1/completions", _cmpl(best_of=3), 400, "best_of"),
    ("logit_bias", "/v1/completions", _cmpl(logit_bias={"5": 10}), 400, "logit_bias"),
    ("tools", "/v1/chat/completions", _chat(tools=[{"type": "function", "function": {"name": "f"}}]), 400, "tools"),
    ("echo", "/v1/completions", _cmpl(echo=True), 400, "echo"),
    ("presence_penalty", "/v1/completions", _cmpl(presence_penalty=0.5), 400, "presence_penalty"),
    ("batched prompts", "/v1/completions", _cmpl(prompt=["a", "b"]), 400, "prompt"),
    ("temperature", "/v1/completions", _cmpl(temperature=-1), 400, "temperature"),
    ("top_p", "/v1/completions", _cmpl(top_p=0), 400, "top_p"),
    ("top_logprobs without logprobs", "/v1/chat/completions", _chat(top_logprobs=2), 400, "top_logprobs"),
    ("image part", "/v1/chat/completions",
     _chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]), 400,
     "messages.0.content.0"),
    ("audio part", "/v1/chat/completions",
     _chat(messages=[{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}]), 400,
     "messages.0.content.0.type"),
    ("message without role", "/v1/chat/completions", _chat(messages=[{"content": "hi"}]), 400, "messages.0.role"),
    ("unknown route", "/v1/nothing", _cmpl(), 404, None),
]


@pytest.mark.parametrize("name, path, body, status, param", BAD, ids=[b[0] for b in BAD])
def test_bad_input_gets_openai_error_and_server_stays_healthy(ctx, name, path, body, status, param):
    if isinstance(body, bytes):
        r = ctx.http.post(path, content=body, headers={"content-type": "application/json"})
    else:
        r = ctx.http.post(path, json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["type"] == "invalid_request_error"
    if param is not None:
        assert err["param"] == param, err
    if status == 400 and param in ("n", "best_of", "logit_bias", "tools", "echo", "presence_penalty"):
        assert param in err["message"]
    ok = ctx.client.completions.create(model=MODEL, prompt="hi", max_tokens=1)
    assert ok.usage.completion_tokens == 1


def test_openai_client_raises_on_bad_input(ctx):
    with pytest.raises(openai.BadRequestError) as e:
        ctx.client.chat.completions.create(model=MODEL, messages=CHAT, n=3)
    assert e.value.body["param"] == "n"
    with pytest.raises(openai.NotFoundError):
        ctx.client.chat.completions.create(model="nope", messages=CHAT)


def test_api_key_and_body_limit(ctx):
    url = ctx.keyed_url
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        r = httpx.post(url + "/v1/completions", json=_cmpl(), headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(url + "/v1/models").status_code == 401
    assert httpx.get(url + "/health").status_code == 200  # probes stay open
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0).models.list()
    good = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)
    assert good.completions.create(model=MODEL, prompt="hi", max_tokens=1).usage.completion_tokens == 1
    big = {"model": MODEL, "prompt": "x" * (1 << 17), "max_tokens": 1}
    r = httpx.post(url + "/v1/completions", json=big, headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 413 and r.json()["error"]["type"] == "invalid_request_error"
    # chunked upload without Content-Length
    r = httpx.post(url + "/v1/completions", content=iter([json.dumps(big).encode()]),
                   headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 413
    assert good.completions.create(model=MODEL, prompt="hi", max_tokens=1).usage.completion_tokens == 1


def test_oversized_body_on_default_cap(ctx):
    r = ctx.http.post("/v1/completions", content=b"x" * ((8 << 20) + 1), headers={"content-type": "application/json"})
    assert r.status_code == 413
    assert ctx.http.get("/health").status_code == 200


# ---------------------------------------------------------------------- concurrency


def test_16_concurrent_clients(ctx):
    def one(i):
        if i % 2:
            stream = ctx.client.completions.create(model=MODEL, prompt=CONCURRENT[i], stream=True, **GREEDY)
            return "".join(c.choices[0].text for c in stream)
        return ctx.client.completions.create(model=MODEL, prompt=CONCURRENT[i], **GREEDY).choices[0].text

    with ThreadPoolExecutor(16) as pool:
        texts = list(pool.map(one, range(16)))
    assert texts == [ctx.ref[f"c{i}"].text for i in range(16)]
    wait_idle(ctx)
    ctx.aeng.call_sync(lambda e: e.check_invariants())


# ---------------------------------------------------------------------- metrics

def test_metrics_parse_and_move(ctx):
    r = ctx.http.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    m0 = parse_metrics(r.text)
    for name in ("num_requests_running", "num_requests_waiting", "generation_tokens_total", "prompt_tokens_total",
                 "cached_prompt_tokens_total", "kv_pages_used", "kv_pages_total", "state_slots_used",
                 "state_slots_total", "time_to_first_token_seconds_count", "inter_token_latency_seconds_count"):
        assert "jaxserve_" + name in m0, name
    assert m0["jaxserve_kv_pages_total"] == 255 and m0["jaxserve_state_slots_total"] == 31
    ctx.client.completions.create(model=MODEL, prompt=LONG_IDS, **GREEDY)
    m1 = parse_metrics(ctx.http.get("/metrics").text)
    assert m1["jaxserve_generation_tokens_total"] == m0["jaxserve_generation_tokens_total"] + N
    assert m1["jaxserve_prompt_tokens_total"] == m0["jaxserve_prompt_tokens_total"] + len(LONG_IDS)
    assert m1["jaxserve_time_to_first_token_seconds_count"] == m0["jaxserve_time_to_first_token_seconds_count"] + 1
    assert m1["jaxserve_inter_token_latency_seconds_count"] == m0["jaxserve_inter_token_latency_seconds_count"] + N - 1
    assert m1['jaxserve_time_to_first_token_seconds_bucket{le="+Inf"}'] == m1["jaxserve_time_to_first_token_seconds_count"]
    ctx.client.completions.create(model=MODEL, prompt=LONG_IDS, **GREEDY)
    m2 = parse_metrics(ctx.http.get("/metrics").text)
    assert m2["jaxserve_cached_prompt_tokens_total"] >= m1["jaxserve_cached_prompt_tokens_total"] + 128
    assert m2['jaxserve_request_finished_total{reason="length"}'] >= 2
