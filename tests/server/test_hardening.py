"""The server against hostile or careless clients, over real HTTP (issue 26's defects 1-8 and the
server's part of 10): out-of-range numbers, mistyped values, lone surrogates, huge prompts and stop
lists, bytes that are not HTTP, slow clients, too many connections, the API-key comparison, and the
metrics an operator reads. Each test would have failed before its fix; after each, the server
still serves (``_still_serving``)."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import select
import socket
import threading
import time

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jaxserve.sampling_params import SamplingParams
from server.app import create_app
from server.limits import HTTPLimits
from server.protocol import INT32_MAX, MAX_STOP
from tests.server.harness import GREEDY, KEY, LONG_IDS, MODEL, Server, metric_types, parse_metrics, wait_idle


def _still_serving(ctx):
    """/health is 200 and a greedy request equals the offline reference."""
    assert ctx.http.get("/health").status_code == 200
    out = ctx.client.completions.create(model=MODEL, prompt=ctx.prompts["hello"], **GREEDY)
    assert out.choices[0].text == ctx.ref["hello"].text


def _post(ctx, path: str, body) -> httpx.Response:
    if isinstance(body, bytes):
        return ctx.http.post(path, content=body, headers={"content-type": "application/json"})
    return ctx.http.post(path, json=body)


def _assert_400(r: httpx.Response, param: str | None) -> dict:
    """An OpenAI 400 naming ``param`` (or an element of it: ``stop_token_ids.0``)."""
    assert r.status_code == 400, r.text
    assert r.headers["content-type"] == "application/json"
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"
    assert err["param"] == param or (param and err["param"].startswith(param + ".")), err
    return err


def _cmpl(**kw) -> dict:
    return {"model": MODEL, "prompt": "hi", "max_tokens": 2, **kw}


def _chat(**kw) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **kw}


# ---------------------------------------------------------------------- 1: numbers out of range


def test_top_k_beyond_int32_is_a_400_and_the_engine_serves_on(ctx):
    """top_k 2**31 used to reach the device batch (int32) and fail the step (before that: kill
    the engine thread, 503 for everyone after)."""
    for top_k in (2**31, 10**30):
        err = _assert_400(_post(ctx, "/v1/completions", _cmpl(top_k=top_k, temperature=1.0)), "top_k")
        assert str(INT32_MAX) in err["message"]
    _still_serving(ctx)


# Per numeric field: values outside what it can hold (JSON text, so 1e400 is a literal).
OUT_OF_RANGE = {
    "top_k": ["2147483648", "-2", "1e30"], "temperature": ["1e400", "-0.5", "2.5"], "top_p": ["0", "1.5", "-1e400"],
    "seed": ["9223372036854775808", "-9223372036854775809"], "max_tokens": ["2147483648", "0", "-1"],
    "n": ["0", "99999999999999999999"], "logprobs": ["21", "-1", "1e3"], "best_of": ["0"],
    "presence_penalty": ["1e400", "3"], "frequency_penalty": ["-3"], "repetition_penalty": ["0", "1e400"],
}


@pytest.mark.parametrize("field, text", [(f, t) for f, ts in OUT_OF_RANGE.items() for t in ts])
def test_numbers_out_of_range_are_400_naming_the_field(ctx, field, text):
    body = json.dumps(_cmpl())[:-1] + f', "{field}": {text}}}'
    _assert_400(_post(ctx, "/v1/completions", body.encode()), field)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(field=st.sampled_from(["top_k", "max_tokens", "seed", "logprobs", "n", "best_of"]),
       value=st.one_of(st.integers(min_value=2**63), st.integers(max_value=-(2**63) - 1)))
def test_any_huge_integer_is_a_400(ctx, field, value):
    _assert_400(_post(ctx, "/v1/completions", _cmpl(**{field: value})), field)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(stop_ids=st.lists(st.integers(min_value=0, max_value=2**40), min_size=1, max_size=3))
def test_stop_token_ids_are_checked_against_the_vocabulary(ctx, stop_ids):
    r = _post(ctx, "/v1/completions", _cmpl(stop_token_ids=stop_ids, max_tokens=1))
    if max(stop_ids) < ctx.engine.vocab_size:
        assert r.status_code == 200, r.text
    else:
        _assert_400(r, "stop_token_ids")


def test_the_engine_refuses_what_the_sampler_cannot_hold(ctx):
    """A caller of the engine that bypasses the API (offline generate, a test) gets a ValueError at
    add_request, not a failed step that takes other requests with it."""
    bad = [SamplingParams(top_k=2**31), SamplingParams(temperature=float("nan")),
           SamplingParams(temperature=1e39), SamplingParams(stop_token_ids=(ctx.engine.vocab_size,))]
    for sp in bad:
        with pytest.raises(ValueError):
            ctx.aeng.call_sync(lambda e: e.add_request([5, 6, 7], sp))
    assert ctx.aeng.call_sync(lambda e: dict(e.requests)) == {}
    _still_serving(ctx)


# ---------------------------------------------------------------------- 6: strict types


MISTYPED = [
    ("/v1/completions", _cmpl(stream="yes"), "stream"),
    ("/v1/completions", _cmpl(logprobs="yes"), "logprobs"),
    ("/v1/chat/completions", _chat(logprobs="yes"), "logprobs"),
    ("/v1/completions", _cmpl(max_tokens="10"), "max_tokens"),
    ("/v1/completions", _cmpl(max_tokens=10.0), "max_tokens"),
    ("/v1/completions", _cmpl(temperature="0.5"), "temperature"),
    ("/v1/completions", _cmpl(top_k=1.5), "top_k"),
    ("/v1/completions", _cmpl(ignore_eos="true"), "ignore_eos"),
    ("/v1/completions", _cmpl(ignore_eos=1), "ignore_eos"),
    ("/v1/completions", _cmpl(echo="no"), "echo"),
    ("/v1/completions", _cmpl(seed="7"), "seed"),
    ("/v1/completions", _cmpl(prompt=[1, "2"]), "prompt"),
    ("/v1/completions", _cmpl(stream=True, stream_options={"include_usage": "yes"}), "stream_options.include_usage"),
    ("/v1/chat/completions", _chat(top_logprobs="2", logprobs=True), "top_logprobs"),
    ("/v1/chat/completions", _chat(messages=[{"role": 1, "content": "hi"}]), "messages.0.role"),
]


@pytest.mark.parametrize("path, body, param", MISTYPED, ids=[f"{p[-16:]}-{m}" for p, _, m in MISTYPED])
def test_mistyped_values_are_400_naming_the_field(ctx, path, body, param):
    err = _assert_400(_post(ctx, path, body), param)
    assert param in err["message"]


# ---------------------------------------------------------------------- 2: lone surrogates, unknown model


SURROGATE = [
    ("/v1/completions", r'{"model": "tiny", "prompt": "a\ud800b", "max_tokens": 2}'),
    ("/v1/completions", r'{"model": "tiny\udc00", "prompt": "hi"}'),
    ("/v1/completions", r'{"model": "tiny", "prompt": "hi", "stop": ["\ud800"]}'),
    ("/v1/completions", r'{"model": "tiny", "prompt": "hi", "user": "\udfff"}'),
    ("/v1/chat/completions", r'{"model": "tiny", "messages": [{"role": "user", "content": "\ud800"}]}'),
    ("/v1/chat/completions", r'{"model": "tiny", "messages": [{"role": "us\ud800er", "content": "hi"}]}'),
    ("/v1/chat/completions",
     r'{"model": "tiny", "messages": [{"role": "user", "content": [{"type": "text", "text": "\ud800"}]}]}'),
    ("/v1/chat/completions", r'{"model": "tiny", "messages": [{"role": "user", "content": "hi", "\ud800": 1}]}'),
]


@pytest.mark.parametrize("path, raw", SURROGATE)
def test_lone_surrogates_anywhere_are_400(ctx, path, raw):
    err = _assert_400(_post(ctx, path, raw.encode()), None)
    assert err["code"] == "invalid_json" and "surrogate" in err["message"]


def test_surrogate_pairs_are_text(ctx):
    raw = r'{"model": "tiny", "prompt": "smile \ud83d\ude00", "max_tokens": 2, "temperature": 0}'
    r = _post(ctx, "/v1/completions", raw.encode())
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == len(ctx.engine.tokenizer.encode("smile 😀"))


def test_unknown_model_is_404_before_any_tokenizing(ctx):
    """The model is what the client must fix first, and no time is spent on its prompt."""
    # a 404, not the prompt's 400 (it is far too long), and at once (tokenizing 7.8 MB takes seconds)
    t0 = time.perf_counter()
    r = _post(ctx, "/v1/completions", {"model": "gpt-17", "prompt": "x" * 7_800_000})
    assert r.status_code == 404 and time.perf_counter() - t0 < 2
    # the tokenizer (here one that fails if used) is never reached
    with _served_with_tokenizer(ctx, _Tokenizer(ctx.engine.tokenizer, fail=True)) as url:
        for path, body in (("/v1/completions", {"model": "gpt-17", "prompt": "hi"}),
                           ("/v1/chat/completions", {"model": "gpt-17", "messages": [{"role": "user"}]})):
            r = httpx.post(url + path, json=body, timeout=30)
            assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found", r.text


# ---------------------------------------------------------------------- 3: huge prompts, tokenizing off the loop


def test_prompt_too_long_to_fit_is_refused_before_tokenizing(ctx):
    """7.8 MB (under the 8 MiB body cap) used to be tokenized on the event loop for 11-15 s."""
    t0 = time.perf_counter()
    r = _post(ctx, "/v1/completions", {"model": MODEL, "prompt": "x" * 7_800_000})
    err = _assert_400(r, "prompt")
    assert err["code"] == "context_length_exceeded" and "characters" in err["message"]
    r = _post(ctx, "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "y" * 7_800_000}]})
    assert _assert_400(r, "messages")["code"] == "context_length_exceeded"
    assert time.perf_counter() - t0 < 5  # parsing 2 x 7.8 MB; tokenizing them took 10 s and more
    _still_serving(ctx)


class _Tokenizer:
    """The real tokenizer, but ``encode`` and chat rendering sleep ``delay`` seconds first, or fail."""

    def __init__(self, tok, delay: float = 0.0, fail: bool = False):
        self._tok, self.delay, self.fail = tok, delay, fail

    def _enter(self):
        if self.fail:
            raise AssertionError("the tokenizer was used")
        time.sleep(self.delay)

    def encode(self, text):
        self._enter()
        return self._tok.encode(text)

    def apply_chat_template(self, *a, **kw):
        self._enter()
        return self._tok.apply_chat_template(*a, **kw)


@contextlib.contextmanager
def _served_with_tokenizer(ctx, tokenizer):
    """The shared engine behind an app whose routes use ``tokenizer``; yields its URL."""
    app = create_app(ctx.aeng, served_model_name=MODEL)
    app.state.server = dataclasses.replace(app.state.server, tokenizer=tokenizer)
    srv = Server(app)
    try:
        yield srv.url
    finally:
        srv.close()


def test_tokenizing_and_templating_run_off_the_event_loop(ctx):
    """While a request's prompt is prepared (here: made to take 1 s), /health answers at once."""
    with _served_with_tokenizer(ctx, _Tokenizer(ctx.engine.tokenizer, delay=1.0)) as url:
        for path, body in (("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 1}),
                           ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                                                     "max_tokens": 1})):
            result = {}
            t = threading.Thread(target=lambda: result.update(r=httpx.post(url + path, json=body, timeout=30)))
            t.start()
            time.sleep(0.3)  # the request is in the tokenizer now
            t0 = time.perf_counter()
            assert httpx.get(url + "/health", timeout=30).status_code == 200
            health_s = time.perf_counter() - t0
            t.join()
            assert result["r"].status_code == 200, result["r"].text
            assert health_s < 0.5, f"/health took {health_s:.2f}s while a prompt was tokenized"


def test_tokenizing_lets_the_event_loop_run(ctx):
    """The tokenizer releases the GIL, so a worker thread tokenizing 2 MB leaves the other threads
    (the event loop's) running; holding it, the loop stopped for the whole encode (1-2 s here)."""
    text = "hello world, the quick brown fox; " * 60_000
    ticks, done = [], threading.Event()
    worker = threading.Thread(target=lambda: (ctx.engine.tokenizer.encode(text), done.set()))
    worker.start()
    while not done.is_set():
        ticks.append(time.perf_counter())
        time.sleep(0.005)
    worker.join()
    gap = max(b - a for a, b in zip(ticks, ticks[1:]))
    assert len(ticks) > 10 and gap < 0.5, (len(ticks), gap)


# ---------------------------------------------------------------------- 4: stop lists


def test_stop_is_capped_at_openais_limit(ctx):
    err = _assert_400(_post(ctx, "/v1/completions", _cmpl(stop=[f"s{i}" for i in range(MAX_STOP + 1)])), "stop")
    assert f"at most {MAX_STOP}" in err["message"]
    t0 = time.perf_counter()
    _assert_400(_post(ctx, "/v1/completions", _cmpl(stop=["zz"] * 650_000)), "stop")
    assert time.perf_counter() - t0 < 5
    r = _post(ctx, "/v1/completions", _cmpl(stop=[f"s{i}" for i in range(MAX_STOP)]))
    assert r.status_code == 200, r.text


# ---------------------------------------------------------------------- 5: bytes that are not HTTP


def _raw_exchange(url: str, data: bytes, timeout: float = 10) -> tuple[int, dict[str, str], bytes]:
    """Send ``data`` on a fresh connection; read until the server closes it. (status, headers, body)."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=timeout) as s:
        s.sendall(data)
        chunks = []
        while chunk := s.recv(65536):
            chunks.append(chunk)
    head, _, body = b"".join(chunks).partition(b"\r\n\r\n")
    status_line, *header_lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.split(": ", 1) for line in header_lines)
    return int(status_line.split()[1]), {k.lower(): v for k, v in headers.items()}, body


NOT_HTTP = [
    ("bad content-length", b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n{}"),
    ("bad chunk size",
     b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n{}\r\n0\r\n\r\n"),
    ("1 MiB url", b"GET /" + b"a" * (1 << 20) + b" HTTP/1.1\r\nHost: x\r\n\r\n"),
    ("missing host", b"GET /health HTTP/1.1\r\n\r\n"),
    ("garbage", b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03 not http at all\r\n\r\n"),
    ("bad header", b"GET /health HTTP/1.1\r\nHost: x\r\nno colon here\r\n\r\n"),
]


@pytest.mark.parametrize("name, data", NOT_HTTP, ids=[n for n, _ in NOT_HTTP])
def test_http_parser_errors_are_openai_json(ctx, name, data):
    status, headers, body = _raw_exchange(ctx.url, data)
    assert 400 <= status < 500 and headers["content-type"] == "application/json", (status, headers, body)
    err = json.loads(body)["error"]
    assert err["code"] == "invalid_http" and err["message"].startswith("Invalid HTTP request: ")
    assert ctx.http.get("/health").status_code == 200


# ---------------------------------------------------------------------- 7: slow clients, too many connections


@pytest.fixture(scope="module")
def strict_server(ctx):
    """The same engine behind tight limits: 0.5 s to send a request, 1 s idle keep-alive, 3 connections."""
    srv = Server(create_app(ctx.aeng, served_model_name=MODEL),
                 HTTPLimits(timeout_keep_alive=1, request_read_timeout=0.5, limit_concurrency=3))
    yield srv
    srv.close()


SLOW = [
    ("no bytes", b""),
    ("partial headers", b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-"),
    ("partial body", b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{\"model\": "),
]


@pytest.mark.parametrize("name, data", SLOW, ids=[n for n, _ in SLOW])
def test_slowloris_gets_408_after_the_read_timeout(strict_server, name, data):
    t0 = time.perf_counter()
    status, headers, body = _raw_exchange(strict_server.url, data, timeout=10)
    elapsed = time.perf_counter() - t0
    assert status == 408 and json.loads(body)["error"]["code"] == "request_timeout", (status, body)
    assert 0.4 < elapsed < 3, elapsed


def test_a_slow_client_that_keeps_sending_is_still_timed(strict_server):
    """Dripping one header byte every 0.1 s does not reset the clock (the timeout is per request)."""
    host, port = strict_server.url.removeprefix("http://").split(":")
    t0 = time.perf_counter()
    with socket.create_connection((host, int(port)), timeout=10) as s:
        for b in b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 100:
            s.sendall(bytes([b]))
            if select.select([s], [], [], 0.1)[0]:  # an answer (wait 0.1 s for one between bytes)
                break
        else:
            raise AssertionError("no answer after 10 s of dripping")
        assert s.recv(65536).startswith(b"HTTP/1.1 408 ")
    assert time.perf_counter() - t0 < 2


def test_streams_and_kept_alive_connections_under_the_limits(strict_server, ctx):
    """Reading a long response is not timed; a kept-alive connection serves several requests and is
    closed once idle for timeout_keep_alive."""
    # 800 tokens: a stream that lasts well past the 0.5 s read timeout (~2 ms a token here)
    body = {"model": MODEL, "prompt": LONG_IDS[:20], "max_tokens": 800, "temperature": 0, "ignore_eos": True,
            "stream": True}
    with httpx.Client(base_url=strict_server.url, timeout=30) as h:
        t0 = time.perf_counter()
        with h.stream("POST", "/v1/completions", json=body) as r:
            events = [line for line in r.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]" and time.perf_counter() - t0 > 0.5  # longer than the read timeout
        assert h.get("/health").status_code == 200  # the same connection, kept alive
    host, port = strict_server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        t0 = time.perf_counter()
        data = b""
        while chunk := s.recv(65536):
            data += chunk
        assert data.startswith(b"HTTP/1.1 200") and 0.8 < time.perf_counter() - t0 < 3


def test_connections_beyond_the_limit_get_a_json_503(strict_server):
    host, port = strict_server.url.removeprefix("http://").split(":")
    idle = [socket.create_connection((host, int(port))) for _ in range(3)]
    try:
        time.sleep(0.1)
        r = httpx.get(strict_server.url + "/health", timeout=10)
        assert r.status_code == 503 and r.json()["error"]["code"] == "too_many_connections"
        assert "3" in r.json()["error"]["message"]
    finally:
        for s in idle:
            s.close()
    time.sleep(0.1)
    assert httpx.get(strict_server.url + "/health", timeout=10).status_code == 200


# ---------------------------------------------------------------------- 8: the API key


def test_api_key_is_compared_in_constant_time(ctx, monkeypatch):
    import server.app

    seen = []
    real = server.app.hmac.compare_digest
    monkeypatch.setattr(server.app.hmac, "compare_digest", lambda a, b: seen.append((a, b)) or real(a, b))
    url = ctx.keyed_url + "/v1/models"
    for auth, status in ((f"Bearer {KEY}", 200), (f"Bearer {KEY[:-1]}x", 401), ("Bearer ", 401),
                         (f"Bearer {KEY}\u00e9", 401)):
        r = httpx.get(url, headers={"Authorization": auth.encode("latin-1").strip()})
        assert r.status_code == status, (auth, r.text)
    assert len(seen) == 4 and all(b == f"Bearer {KEY}".encode() for _, b in seen)


# ---------------------------------------------------------------------- 10: metrics an operator reads


def test_counters_are_counters_and_cache_and_barrier_stats_are_exported(ctx):
    wait_idle(ctx)
    text = ctx.http.get("/metrics").text
    types = metric_types(text)
    for name in ("num_preemptions", "step_failures", "prompt_tokens", "generation_tokens", "request_finished",
                 "prefix_cache_queries", "prefix_cache_hits", "prefix_cache_hit_tokens", "barriers", "barrier_seconds"):
        assert types[f"jaxserve_{name}_total"] == "counter", name
    m0 = parse_metrics(text)
    sched = ctx.aeng.call_sync(lambda e: (e.scheduler.num_preemptions, e.scheduler.cache.stats.hits))
    assert m0["jaxserve_num_preemptions_total"] == sched[0] and m0["jaxserve_prefix_cache_hits_total"] == sched[1]
    ids = [(11 * i + 5) % 700 + 3 for i in range(140)]
    for _ in range(2):  # cold, then a hit (128 tokens: the x64 boundary below 140 - 1)
        assert _post(ctx, "/v1/completions", {"model": MODEL, "prompt": ids, "max_tokens": 1}).status_code == 200
    wait_idle(ctx)
    m1 = parse_metrics(ctx.http.get("/metrics").text)
    assert m1["jaxserve_prefix_cache_hits_total"] >= m0["jaxserve_prefix_cache_hits_total"] + 1
    assert m1["jaxserve_prefix_cache_hit_tokens_total"] >= m0["jaxserve_prefix_cache_hit_tokens_total"] + 128
    site = 'jaxserve_barriers_total{site="admission"}'
    assert m1[site] >= m0[site] + 1  # a hit's admission waits for the device
    assert m1['jaxserve_barrier_seconds_total{site="admission"}'] > 0
