"""``jaxserve bench``: the workloads, arrivals, stream folding and statistics without a server, then
the command against one in-process server on the shipped model (uvicorn in a thread, as
tests/server/test_server.py does). Tiny workloads: a few requests of 16-150 prompt tokens and
2-8 output tokens. The engine takes 16-token prefill chunks and runs one request at a time, so it
compiles just two step programs (about 30 s of the module's ~35 s on two CPU cores); the client
still keeps two requests in flight where the tests ask for concurrency 2.
"""

from __future__ import annotations

import json
import math
import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxserve.bench.client import Conversation, error_text, request_body
from jaxserve.bench.metrics import STATS, Record, apply_event, describe, percentile, summarize
from jaxserve.bench.report import render
from jaxserve.bench.workload import WORDS, BenchError, Item, arrival_times, draw_len, make_workload, random_text
from jaxserve.cli import main
from jaxserve.engine.flags import DEFAULT_MODEL_DIR

LATENCIES = ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms")
SUMMARY_KEYS = {"requests", "completed", "errors", "error_sample", "duration_s", "request_throughput",
                "output_throughput", "total_token_throughput", "prompt_tokens", "output_tokens", "cached_tokens",
                "prefix_cache_hit_share", "short_outputs", *LATENCIES}
ROW_KEYS = {"index", "session", "turn", "group", "start_s", "input_len", "output_len", "prompt_tokens", "output_tokens",
            "cached_tokens", "ttft_ms", "tpot_ms", "e2e_ms", "itl_ms", "finish_reason", "error"}


# ---------------------------------------------------------------------- statistics


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(0, 1e6, allow_nan=False), min_size=1, max_size=50), st.floats(0, 100))
def test_percentile_matches_numpy(xs, q):
    assert percentile(sorted(xs), q) == pytest.approx(float(np.percentile(xs, q)), rel=1e-9, abs=1e-9)


@given(st.lists(st.floats(0, 1e6, allow_nan=False), max_size=50))
def test_describe_is_ordered(xs):
    d = describe(xs)
    if not xs:
        assert d == dict.fromkeys(STATS)
        return
    assert min(xs) <= d["p50"] <= d["p90"] <= d["p99"] <= max(xs)
    assert min(xs) - 1e-6 <= d["mean"] <= max(xs) + 1e-6


def _item(i, out=4, user=(1, 2, 3)):
    return Item(i, i, 0, user, len(user), out)


def test_summarize_counts_throughput_and_cache_share():
    a = Record(_item(0), ttft=0.1, itl=[0.02, 0.03, 0.05], e2e=0.2, usage_output=4, prompt_tokens=100, cached_tokens=64)
    b = Record(_item(1), ttft=0.3, itl=[0.1], e2e=0.5, chunks=2, prompt_tokens=28)   # no usage: 2 chunks, no cache info
    bad = Record(_item(2), error="HTTP 500: boom")
    s = summarize([a, b, bad], duration=2.0)
    assert set(s) == SUMMARY_KEYS
    assert (s["requests"], s["completed"], s["errors"], s["error_sample"]) == (3, 2, 1, "HTTP 500: boom")
    assert (s["prompt_tokens"], s["output_tokens"], s["short_outputs"]) == (128, 6, 1)
    assert s["request_throughput"] == 1.0 and s["output_throughput"] == 3.0 and s["total_token_throughput"] == 67.0
    assert s["prefix_cache_hit_share"] == pytest.approx(64 / 100)  # b reports no cached tokens: left out
    assert a.tpot == pytest.approx((0.2 - 0.1) / 3) and b.tpot == pytest.approx(0.2)
    assert s["ttft_ms"]["mean"] == pytest.approx(200) and s["e2e_ms"]["p50"] == pytest.approx(350)
    assert s["itl_ms"]["p50"] == pytest.approx(40)
    assert Record(_item(3), ttft=0.1, e2e=0.1, usage_output=1).tpot is None  # one token: no TPOT
    empty = summarize([bad], duration=0.0)
    assert empty["request_throughput"] == 0.0 and empty["prefix_cache_hit_share"] is None
    assert empty["ttft_ms"] == dict.fromkeys(STATS)


def test_apply_event_folds_chat_and_completion_chunks():
    rec = Record(_item(0))
    apply_event(rec, {"choices": [{"delta": {"role": "assistant", "content": ""}}]}, 0.05)
    assert rec.ttft is None                                        # the role chunk carries no content
    apply_event(rec, {"choices": [{"delta": {"content": "He"}, "finish_reason": None}]}, 0.1)
    apply_event(rec, {"choices": [{"delta": {"content": "llo"}}]}, 0.15)
    apply_event(rec, {"choices": [{"delta": {"reasoning_content": "hmm"}}]}, 0.25)
    apply_event(rec, {"choices": [{"delta": {}, "finish_reason": "length"}]}, 0.26)
    apply_event(rec, {"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 5,
                                               "prompt_tokens_details": {"cached_tokens": 0}}}, 0.27)
    assert (rec.ttft, rec.text, rec.chunks, rec.finish_reason) == (0.1, "Hello", 3, "length")
    assert rec.itl == pytest.approx([0.05, 0.1])
    assert (rec.prompt_tokens, rec.output_tokens, rec.cached_tokens) == (9, 5, 0)
    comp = Record(_item(1))
    apply_event(comp, {"choices": [{"text": " a", "finish_reason": None}]}, 0.2)
    apply_event(comp, {"choices": [{"text": "", "finish_reason": "stop"}], "usage": None}, 0.3)
    assert (comp.ttft, comp.text, comp.output_tokens, comp.finish_reason) == (0.2, " a", 1, "stop")
    assert comp.cached_tokens is None
    # tokens that decode to no text yet (half a multi-byte character) arrive with their logprobs:
    # the first token's time is when it came, not when the first visible character did
    ids = Record(_item(3))
    apply_event(ids, {"choices": [{"text": "", "logprobs": {"tokens": ["\ufffd"]}, "finish_reason": None}]}, 0.04)
    apply_event(ids, {"choices": [{"text": "é", "logprobs": {"tokens": ["\ufffd"]}, "finish_reason": None}]}, 0.06)
    apply_event(ids, {"choices": [{"text": "", "logprobs": None, "finish_reason": "length"}]}, 0.07)
    assert (ids.ttft, ids.text, ids.chunks) == (0.04, "é", 2) and ids.itl == pytest.approx([0.02])
    chat = Record(_item(4))
    apply_event(chat, {"choices": [{"delta": {"content": ""}, "logprobs": {"content": [{"token": "x"}]}}]}, 0.03)
    assert chat.ttft == 0.03
    err = Record(_item(2))
    apply_event(err, {"error": {"message": "engine died", "type": "server_error"}}, 0.1)
    assert err.error == "stream error: engine died" and not err.ok


def test_error_messages_and_failed_run_report():
    assert error_text('{"error": {"message": "bad model", "code": "model_not_found"}}') == "bad model"
    assert error_text('{"detail": "Unexpected fields in the request: {\'ignore_eos\'}"}').startswith("Unexpected")
    assert error_text("<html>502 Bad Gateway</html>\n") == "<html>502 Bad Gateway</html>"
    failed = Record(_item(0), error="HTTP 422: Unexpected fields in the request: {'ignore_eos'}")
    config = {"workload": "random", "url": "http://x", "model": "m", "num_prompts": 1, "api": "completions",
              "prompt_format": "ids", "request_rate": 2.0, "seed": 0}
    text = render({"config": config, "runs": [{"max_concurrency": None, "summary": summarize([failed], 1.0)}]})
    assert "0 ok, 1 errors" in text and "pass --no-ignore-eos" in text and "Poisson arrivals at 2.0/s" in text
    assert text.count("n/a") == 17  # no latency, no cache share


# ---------------------------------------------------------------------- workloads and arrivals


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 30), inp=st.integers(1, 80), out=st.integers(1, 20), ratio=st.floats(0, 0.95),
       seed=st.integers(0, 100))
def test_random_workload_lengths_and_ids(n, inp, out, ratio, seed):
    sessions = make_workload("random", num_prompts=n, input_len=inp, output_len=out, range_ratio=ratio, seed=seed,
                             token_ids=(10, 50))
    items = [s[0] for s in sessions]
    assert all(len(s) == 1 for s in sessions) and [it.index for it in items] == list(range(n))
    for it in items:
        assert len(it.user) == it.input_len and all(10 <= t < 50 for t in it.user)
        assert max(1, round(inp * (1 - ratio))) <= it.input_len <= max(1, round(inp * (1 + ratio)))
        assert max(1, round(out * (1 - ratio))) <= it.output_len <= max(1, round(out * (1 + ratio)))
    again = make_workload("random", num_prompts=n, input_len=inp, output_len=out, range_ratio=ratio, seed=seed,
                          token_ids=(10, 50))
    assert again == sessions                                               # deterministic in the seed
    if ratio == 0:
        assert {it.input_len for it in items} == {inp} and {it.output_len for it in items} == {out}


def test_draw_len_spans_its_range():
    rng = random.Random(0)
    assert {draw_len(rng, 10, 0.5) for _ in range(400)} == set(range(5, 16))
    assert {draw_len(rng, 1, 0.9) for _ in range(50)} == {1, 2}


def test_shared_prefix_groups_share_exactly_their_prefix():
    sessions = make_workload("shared-prefix", num_prompts=12, input_len=8, output_len=4, prefix_len=64, num_groups=3,
                             seed=1)
    items = [s[0] for s in sessions]
    assert sorted(it.group for it in items) == [g for g in range(3) for _ in range(4)]
    assert [it.group for it in items] != [i % 3 for i in range(12)]        # shuffled
    prefix = {}
    for it in items:
        assert len(it.user) == it.input_len == 72
        assert prefix.setdefault(it.group, it.user[:64]) == it.user[:64]
    assert len(set(prefix.values())) == 3
    assert len({it.user[64:] for it in items}) == 12                       # own tails
    text = make_workload("shared-prefix", num_prompts=4, input_len=5, output_len=2, prefix_len=20, num_groups=1,
                         prompt_format="text", tokens_per_word=2.0)
    heads = {tuple(s[0].user.split()[:10]) for s in text}
    assert len(heads) == 1 and all(len(s[0].user.split()) == 10 + 2 for s in text)  # 2.5 words round to 2


def test_multi_turn_sessions_and_text():
    sessions = make_workload("multi-turn", num_prompts=7, input_len=30, output_len=3, turns=3,
                             prompt_format="text", tokens_per_word=1.5)
    assert [len(s) for s in sessions] == [3, 3, 1]
    assert [it.index for s in sessions for it in s] == list(range(7))
    assert [(it.session, it.turn) for it in sessions[1]] == [(1, 0), (1, 1), (1, 2)]
    assert all(len(it.user.split()) == 20 and set(it.user.split()) <= set(WORDS) for s in sessions for it in s)
    assert random_text(random.Random(0), 1, 4.0).count(" ") == 0           # at least one word
    with pytest.raises(BenchError, match="unknown workload"):
        make_workload("poetry", num_prompts=1, input_len=1, output_len=1)


def test_conversation_grows_with_each_answer():
    chat, comp = Conversation("chat"), Conversation("completions")
    first, second = Item(0, 0, 0, "one two", 2, 1), Item(1, 0, 1, "three", 1, 1)
    p = chat.prompt(first)
    assert p == [{"role": "user", "content": "one two"}]
    chat.answered(p, "A1")
    assert chat.prompt(second) == [{"role": "user", "content": "one two"}, {"role": "assistant", "content": "A1"},
                                   {"role": "user", "content": "three"}]
    p = comp.prompt(first)
    comp.answered(p, " A1")
    assert comp.prompt(second) == "one two A1\nthree"
    assert Conversation("completions").prompt(_item(0)) == [1, 2, 3]         # ids go out as a list


def test_request_body():
    b = request_body("completions", "m", [1, 2], 8, ignore_eos=True)
    assert b == {"model": "m", "prompt": [1, 2], "max_tokens": 8, "temperature": 0, "stream": True,
                 "stream_options": {"include_usage": True}, "logprobs": 0, "ignore_eos": True}
    c = request_body("chat", "m", [{"role": "user", "content": "x"}], 2, ignore_eos=False, stream=False)
    assert "messages" in c and "ignore_eos" not in c and "stream_options" not in c and not c["stream"]
    assert "logprobs" not in c                                                # only streamed requests time tokens
    assert request_body("chat", "m", [], 2, ignore_eos=False)["logprobs"] is True
    assert "logprobs" not in request_body("completions", "m", [1], 2, ignore_eos=False, token_logprobs=False)


def test_arrivals():
    assert arrival_times(5, math.inf, 0) == [0.0] * 5
    ts = arrival_times(4000, 20.0, 3)
    assert ts[0] == 0.0 and all(a <= b for a, b in zip(ts, ts[1:])) and ts == arrival_times(4000, 20.0, 3)
    assert ts[-1] / (len(ts) - 1) == pytest.approx(1 / 20.0, rel=0.1)     # mean gap 1/rate
    assert arrival_times(10, 20.0, 4) != ts[:10]


# ---------------------------------------------------------------------- the command line, no server


@pytest.mark.parametrize("flags, why", [
    (["--url", "localhost:8000"], "--url"),
    (["--num-prompts", "0"], "--num-prompts"),
    (["--range-ratio", "1"], "--range-ratio"),
    (["--request-rate", "0"], "--request-rate"),
    (["--request-rate", "nan"], "--request-rate"),
    (["--max-concurrency", "0"], "--max-concurrency"),
    (["--concurrency-sweep", "1,x"], "--concurrency-sweep"),
    (["--concurrency-sweep", "1,4", "--max-concurrency", "2"], "exclude each other"),
    (["--workload", "shared-prefix", "--num-prompts", "2", "--num-groups", "3"], "--num-groups"),
    (["--api", "chat", "--prompt-format", "ids"], "--prompt-format ids"),
    (["--workload", "multi-turn", "--api", "completions", "--prompt-format", "ids"], "--prompt-format ids"),
    (["--token-ids", "5", "5"], "--token-ids"),
    (["--plot", "out.jpg"], "--plot"),
    (["--json", "/nonexistent/dir/r.json"], "no such folder"),
])
def test_bad_flags_exit_2(capsys, flags, why):
    assert main(["bench", "--url", "http://127.0.0.1:9", *flags]) == 2  # a later --url wins
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and why in err and "Traceback" not in err


def test_unknown_workload_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as e:
        main(["bench", "--workload", "poetry"])
    assert e.value.code == 2 and "invalid choice" in capsys.readouterr().err


def test_unreachable_server_exits_2(capsys):
    assert main(["bench", "--url", "http://127.0.0.1:9", "--num-prompts", "2", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "cannot reach" in err and "Traceback" not in err


# ---------------------------------------------------------------------- against the real server


@pytest.fixture(scope="module")
def url():
    """One in-process server on the shipped model for the whole module."""
    from jaxserve.engine.llm import EngineArgs, build_engine
    from server.app import create_app
    from server.async_engine import AsyncEngine
    from tests.server.test_server import _Server

    engine = build_engine(EngineArgs(model=str(DEFAULT_MODEL_DIR), dtype="float32", num_pages=256, num_slots=32,
                                     max_prefill_length=16, max_running_requests=1, max_model_len=512, progress=False))
    aeng = AsyncEngine(engine).start()
    srv = _Server(create_app(aeng, served_model_name="bench-test"))
    yield srv.url
    srv.close()
    aeng.stop()


def _check_run(run: dict, n: int) -> dict:
    """Schema and sanity of one run; returns its summary."""
    s, rows = run["summary"], run["requests"]
    assert set(s) == SUMMARY_KEYS and len(rows) == n and all(set(r) == ROW_KEYS for r in rows)
    assert s["requests"] == s["completed"] == n and s["errors"] == 0, s["error_sample"]
    for r in rows:
        assert r["error"] is None and r["output_tokens"] == r["output_len"] and r["finish_reason"] == "length"
        assert 0 < r["ttft_ms"] <= r["e2e_ms"] and r["tpot_ms"] > 0 and r["prompt_tokens"] > 0
    for key in LATENCIES:
        assert s[key]["p50"] <= s[key]["p90"] <= s[key]["p99"], (key, s[key])
    assert s["output_tokens"] == sum(r["output_len"] for r in rows) and s["request_throughput"] > 0
    return s


def test_random_workload(url, tmp_path, capsys):
    out, png = tmp_path / "r.json", tmp_path / "r.png"
    rc = main(["bench", "--url", url, "--num-prompts", "6", "--input-len", "48", "--range-ratio", "0.25",
               "--output-len", "6", "--max-concurrency", "2", "--seed", "3", "--json", str(out), "--plot", str(png),
               "--quiet"])
    table = capsys.readouterr().out
    assert rc == 0
    assert "TTFT" in table and "req/s" in table and "prefix-cache hit share" in table
    res = json.loads(out.read_text())
    assert res["config"]["model"] == "bench-test" and res["config"]["workload"] == "random"
    assert res["config"]["request_rate"] == "inf" and "api_key" not in res["config"]
    (run,) = res["runs"]
    assert run["max_concurrency"] == 2
    _check_run(run, 6)
    assert all(r["prompt_tokens"] == r["input_len"] and 36 <= r["input_len"] <= 60 for r in run["requests"])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("out_len", [1, 5])
def test_every_token_is_timed(url, capsys, out_len):
    """The sampled tokens' logprobs make every generated token a chunk of its own, whatever its text:
    one TTFT and ``out_len - 1`` ITLs a request, also for a one-token answer (a prefill benchmark's
    TTFT), over random ids from the whole vocabulary."""
    rc = main(["bench", "--url", url, "--num-prompts", "3", "--input-len", "20", "--output-len", str(out_len),
               "--token-ids", "0", "500", "--max-concurrency", "1", "--seed", "5", "--json", "-"])
    (run,) = json.loads(capsys.readouterr().out)["runs"]
    assert rc == 0
    for r in run["requests"]:
        assert r["error"] is None and r["output_tokens"] == out_len
        assert r["ttft_ms"] is not None and 0 < r["ttft_ms"] <= r["e2e_ms"]
        assert len(r["itl_ms"]) == out_len - 1


def test_shared_prefix_hits_the_cache(url, capsys):
    """One request at a time: every prompt after its group's first finds the 128-token prefix cached
    (the cache hits at x64 boundaries). ``--json -`` prints only the JSON."""
    rc = main(["bench", "--url", url, "--workload", "shared-prefix", "--prefix-len", "128", "--num-groups", "2",
               "--num-prompts", "6", "--input-len", "16", "--output-len", "4", "--max-concurrency", "1", "--json", "-"])
    res = json.loads(capsys.readouterr().out)
    assert rc == 0
    (run,) = res["runs"]
    s = _check_run(run, 6)
    seen = set()
    for r in sorted(run["requests"], key=lambda r: r["start_s"]):
        assert r["prompt_tokens"] == 144
        assert r["cached_tokens"] % 64 == 0
        if r["group"] in seen:
            assert r["cached_tokens"] >= 128
        seen.add(r["group"])
    assert s["prefix_cache_hit_share"] >= 4 * 128 / (6 * 144)


@pytest.mark.parametrize("api", ["chat", "completions"])
def test_multi_turn_grows_prompts(url, tmp_path, capsys, api):
    """Text prompts sized by the server's tokens per word; each turn's prompt holds the one before
    plus its answer. The chat case sweeps two concurrencies (two runs, throughput-vs-concurrency)."""
    png = tmp_path / "m.png"
    sweep = ["--concurrency-sweep", "1,2", "--plot", str(png)] if api == "chat" else ["--max-concurrency", "2"]
    rc = main(["bench", "--url", url, "--workload", "multi-turn", "--api", api, "--turns", "3", "--num-prompts", "5",
               "--input-len", "24", "--output-len", "4", "--json", str(tmp_path / "m.json"), "--quiet", *sweep])
    table = capsys.readouterr().out
    res = json.loads((tmp_path / "m.json").read_text())
    assert rc == 0 and res["config"]["prompt_format"] == "text" and res["config"]["text_tokens_per_word"] > 0
    assert len(res["runs"]) == (2 if api == "chat" else 1)
    for run in res["runs"]:
        _check_run(run, 5)
        by_session = {}
        for r in run["requests"]:
            by_session.setdefault(r["session"], []).append(r)
        assert sorted(len(v) for v in by_session.values()) == [2, 3]
        for turns in by_session.values():
            lens = [r["prompt_tokens"] for r in sorted(turns, key=lambda r: r["turn"])]
            assert all(b > a + 4 for a, b in zip(lens, lens[1:])), lens    # + answer + new part
    if api == "chat":
        assert "throughput vs concurrency" in table and png.read_bytes()[:4] == b"\x89PNG"


def test_failed_requests_are_counted_not_raised(url, capsys):
    """Every request 404s (unknown model): the report counts them with a sample message; exit 1.
    The URL is given OpenAI-style, ending in /v1."""
    rc = main(["bench", "--url", url + "/v1/", "--model", "nope", "--num-prompts", "3", "--input-len", "8",
               "--output-len", "2", "--quiet"])
    cap = capsys.readouterr()
    assert rc == 1 and "Traceback" not in cap.err
    assert "0 ok, 3 errors" in cap.out and "HTTP 404" in cap.out and "does not exist" in cap.out
