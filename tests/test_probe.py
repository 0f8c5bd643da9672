"""``jaxserve probe``: the plan and the analysis without a server, then the hammer against the real
server on the shipped model -- clean (no hit differs from its cold answer, checksums 0, pools
back to free) and with an injected fault (the harness must report corruption and exit 1).

The servers run in this process (uvicorn in a thread, as tests/server/test_server.py does), so
the second engine reuses the step programs the first one compiled. fp32: a hit must equal its
cold answer exactly. Only corruption counters are asserted, never ground-truth accuracy (the
shipped model is small and partly trained).
"""

from __future__ import annotations

import json
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxserve import probe
from jaxserve.cli import main
from jaxserve.engine.flags import DEFAULT_MODEL_DIR
from tests.engine.faults import FAULTS, FaultyScheduler
from weights.groundtruth import tasks

SERVE = dict(dtype="float32", num_pages=512, num_slots=64, max_prefill_length=32, max_running_requests=8,
             max_model_len=1024, debug_snapshot_checksums=True, progress=False)
PROBE = ["--needle-tokens", "60", "300", "--max-tokens", "8", "--concurrency", "8", "--json"]


# ---------------------------------------------------------------------- the plan


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 120), frac=st.floats(0, 0.9), seed=st.integers(0, 1000), repeats=st.integers(1, 5))
def test_plan_shape(n, frac, seed, repeats):
    jobs = probe.plan(n, frac, seed, needle_tokens=(20, 60), repeats=repeats)
    assert len(jobs) == n and [j.idx for j in jobs] == list(range(n))
    aborts = [j for j in jobs if j.role == "abort"]
    assert len(aborts) == min(n - 1, round(n * frac))
    assert all(0 <= j.abort_after <= 3 for j in aborts)
    first_full: dict[int, str] = {}
    for j in jobs:
        if j.role != "abort":
            first_full.setdefault(j.key, j.role)
        assert j.answer == tasks.answer_of(list(j.messages) + [{"role": "assistant", "content": ""}])
    assert set(first_full.values()) == {"cold"}  # every prompt is sent whole cold before it is repeated
    colds = [j.key for j in jobs if j.role == "cold"]
    assert len(colds) == len(set(colds))
    assert {j.key for j in jobs} == set(colds)
    assert probe.plan(n, frac, seed, (20, 60), repeats) == jobs  # deterministic
    assert {j.kind for j in probe.plan(n, frac, seed, (20, 60), repeats, kinds=("recall",))} == {"recall"}


def test_needle_siblings_share_their_context():
    prompts = probe.distinct_prompts(12, seed=5, needle_tokens=(60, 120))
    needles = [p for p in prompts if p.kind == "needle"]
    assert len(needles) == 4 and {p.kind for p in prompts} == set(tasks.KINDS)
    ctx = lambda p: p.messages[-1]["content"].rsplit("\n\n", 1)[0]  # noqa: E731
    assert ctx(needles[0]) == ctx(needles[1]) and needles[0].messages != needles[1].messages
    assert ctx(needles[1]) != ctx(needles[2])
    sib = probe.needle_sibling(needles[0], random.Random(0))
    assert sib.answer in ctx(needles[0]) and tasks.score(sib.answer, " " + sib.answer + "\n")


# ---------------------------------------------------------------------- the analysis


def _job(idx, key, role="repeat", kind="arithmetic", answer="5"):
    return probe.Job(idx, key, kind, ({"role": "user", "content": "What is 2 + 3?"},), answer, role)


def _res(job, text="5", tokens=None, done_at=0.0, **kw):
    return probe.Result(job, text=text, tokens=tokens, finish_reason="stop", prompt_tokens=100, cached_tokens=64,
                        ttft=0.1, total=0.2, done_at=done_at, **kw)


def test_analyze_counts_hit_vs_cold_and_wrong_on_hit():
    rs = [_res(_job(0, 0, "cold"), "5", ["5"], done_at=1),
          _res(_job(1, 0), "5", ["5"], done_at=2),
          _res(_job(2, 0), "7", ["7"], done_at=3),                       # corrupted hit, wrong
          _res(_job(3, 0, "abort"), "", aborted=True),
          probe.Result(_job(4, 0), error="HTTP 500: boom"),
          _res(_job(5, 1, "cold", kind="recall", answer="cat"), "dog", done_at=1),
          _res(_job(6, 1, kind="recall", answer="cat"), "cat", done_at=2)]  # right on hit, differs from cold
    a = probe.analyze(rs)
    ar, rc = a["kinds"]["arithmetic"], a["kinds"]["recall"]
    assert (ar["requests"], ar["completed"], ar["right"], ar["wrong"], ar["aborted"], ar["errors"]) == (5, 3, 2, 1, 1, 1)
    assert (ar["hits_compared"], ar["hit_vs_cold_mismatches"], ar["wrong_on_hit"]) == (2, 1, 1)
    assert (rc["hit_vs_cold_mismatches"], rc["wrong_on_hit"], rc["right"]) == (1, 0, 1)
    assert a["totals"]["hit_vs_cold_mismatches"] == 2 and len(a["mismatch_examples"]) == 2
    assert a["cached_token_share"] == pytest.approx(64 / 100)
    assert probe.verdict(a, None)
    assert "CORRUPTION FOUND" in probe.render(dict(a, url="u", model="m", requests=7, concurrency=1, elapsed_s=1.0,
                                                   server=None, corruption=True))


def test_cold_reference_falls_back_to_first_completion():
    cold_failed = probe.Result(_job(0, 0, "cold"), error="timeout")
    late, early = _res(_job(1, 0), "5", done_at=9), _res(_job(2, 0), "6", done_at=4)
    assert probe.cold_of([cold_failed, late, early]) is early
    a = probe.analyze([cold_failed, late, early])
    assert a["totals"]["hits_compared"] == 1 and a["totals"]["hit_vs_cold_mismatches"] == 1
    assert probe.cold_of([cold_failed]) is None and probe.analyze([cold_failed])["totals"]["hits_compared"] == 0


def test_tokens_compared_when_both_have_them_else_text():
    a, b = _res(_job(0, 0), "ab", ["a", "b"]), _res(_job(1, 0), "ab", ["ab"])
    assert not probe.same_answer(a, b)                        # same text, different tokens
    assert probe.same_answer(a, _res(_job(2, 0), "ab", None))  # one side without tokens: by text


def test_reference_mismatches():
    rs = [_res(_job(0, 0, "cold"), "5", ["5"]), _res(_job(1, 0), "5", ["5"])]
    same = probe.analyze(rs, {0: _res(_job(0, 0, "cold"), "5", ["5"])})
    assert same["totals"]["reference_compared"] == 2 and not probe.verdict(same, None)
    other = probe.analyze(rs, {0: _res(_job(0, 0, "cold"), "6", ["6"])})
    assert other["totals"]["reference_mismatches"] == 2 and other["totals"]["hit_vs_cold_mismatches"] == 0
    assert probe.verdict(other, None)


@given(st.lists(st.tuples(st.integers(0, 4), st.booleans(), st.booleans()), max_size=40))
def test_analyze_totals_add_up(spec):
    """Every request lands in exactly one of completed / aborted / errors; a prompt whose answers
    all agree has no mismatch."""
    rs = []
    for i, (key, aborted, error) in enumerate(spec):
        job = _job(i, key, "cold" if i == min(j for j, s in enumerate(spec) if s[0] == key) else "repeat")
        rs.append(probe.Result(job, error="x") if error else _res(job, "5", aborted=aborted, done_at=i))
    t = probe.analyze(rs)["totals"]
    assert t["requests"] == len(rs) == t["completed"] + t["aborted"] + t["errors"]
    assert t["right"] + t["wrong"] == t["completed"] and t["hit_vs_cold_mismatches"] == 0
    assert t["hits_compared"] == t["completed"] - len({r.job.key for r in rs if r.completed})


def test_percentiles_nearest_rank():
    assert probe.percentiles([]) == {"p50": None, "p90": None, "p99": None}
    assert probe.percentiles([float(i) for i in range(1, 101)]) == {"p50": 50.0, "p90": 90.0, "p99": 99.0}
    assert probe.percentiles([3.0]) == {"p50": 3.0, "p90": 3.0, "p99": 3.0}


def test_metrics_parsing_and_verdict():
    text = ("# HELP jaxserve_kv_pages_used x\n# TYPE jaxserve_kv_pages_used gauge\njaxserve_kv_pages_used 12\n"
            "jaxserve_prefix_cache_pages 10\njaxserve_state_slots_used 3\njaxserve_prefix_cache_snapshots 3\n"
            'jaxserve_request_finished_total{reason="stop"} 4\njaxserve_request_finished_total{reason="abort"} 2\n'
            "jaxserve_snapshot_checksum_mismatches 1\ngarbage line\n")
    m = probe.parse_metrics(text)
    assert m["jaxserve_request_finished_total"] == 6 and m["jaxserve_kv_pages_used"] == 12
    s = probe.server_state(m)
    assert s["kv_pages_held_by_requests"] == 2 and s["state_slots_held_by_requests"] == 0
    assert s["kv_pages_total"] is None
    clean = probe.analyze([_res(_job(0, 0, "cold"))])
    assert probe.verdict(clean, s) and not probe.verdict(clean, dict(s, snapshot_checksum_mismatches=0))


def test_usage_and_connection_errors_exit_2(capsys):
    assert main(["probe", "--url", "http://127.0.0.1:9", "--n", "3"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "cannot reach" in err and "Traceback" not in err
    assert main(["probe", "--url", "localhost:8000"]) == 2
    assert main(["probe", "--url", "http://x", "--abort-fraction", "1"]) == 2
    assert "--abort-fraction" in capsys.readouterr().err
    assert main(["probe", "--url", "http://x", "--kinds", "needle,poetry"]) == 2
    assert "--kinds" in capsys.readouterr().err


# ---------------------------------------------------------------------- against the real server


@pytest.fixture
def serve():
    """Start an in-process server on the shipped model; yields ``start(fault=None, **engine_args) ->
    (url, aeng)``. ``fault``: corrupt every cache hit on purpose (tests/engine/faults.py)."""
    from jaxserve.engine.llm import EngineArgs, build_engine
    from server.app import create_app
    from server.async_engine import AsyncEngine
    from tests.server.test_server import _Server

    running = []

    def start(fault=None, **kw):
        engine = build_engine(EngineArgs(model=str(DEFAULT_MODEL_DIR), **{**SERVE, **kw}))
        if fault is not None:
            FaultyScheduler.corrupt(engine.scheduler, fault)
        aeng = AsyncEngine(engine).start()
        srv = _Server(create_app(aeng, served_model_name="probe-test"))
        running.append((srv, aeng))
        return srv.url, aeng

    yield start
    for srv, aeng in running:
        srv.close()
        aeng.stop()


def _probe(capsys, url, *extra) -> tuple[int, dict]:
    capsys.readouterr()
    rc = main(["probe", "--url", url, *PROBE, *extra])
    out = capsys.readouterr().out
    return rc, json.loads(out)


def test_hammer_clean_server(serve, capsys):
    url, aeng = serve()
    rc, rep = _probe(capsys, url, "--n", "200", "--abort-fraction", "0.35", "--seed", "11")
    t, s = rep["totals"], rep["server"]
    assert rep["compared_by"] == "tokens" and rep["model"] == "probe-test"
    assert t["requests"] == 200 and t["errors"] == 0, rep["mismatch_examples"]
    assert t["aborted"] >= 50                           # >= 25% abandoned streams
    assert t["hits_compared"] >= 80
    assert rep["cached_token_share"] > 0.3
    assert t["hit_vs_cold_mismatches"] == 0, rep["mismatch_examples"]
    assert s["snapshot_checksum_mismatches"] == 0
    assert s["kv_pages_held_by_requests"] == 0 and s["state_slots_held_by_requests"] == 0
    assert s["num_requests_running"] == 0 and s["prefix_cache_snapshots"] > 0
    assert rc == 0

    def flushed(e):  # nothing leaked: once the tree lets go, every page and slot is free
        e.check_invariants()
        e.scheduler.cache.flush()
        e.check_invariants()
        s = e.scheduler
        return s.pages.num_free == s.pages.capacity and s.slots.num_free == s.slots.capacity

    assert aeng.call_sync(flushed)


@pytest.mark.parametrize("fault", FAULTS)
def test_hammer_catches_injected_fault(serve, capsys, fault):
    url, _ = serve(fault=fault)
    # Only the kinds long enough to hit (arithmetic prompts are shorter than one x64 boundary).
    rc, rep = _probe(capsys, url, "--kinds", "needle,recall", "--n", "40", "--abort-fraction", "0.25", "--seed", "0")
    assert rep["totals"]["hit_vs_cold_mismatches"] > 0 and rep["corruption"]
    assert rc == 1


def test_reference_url(serve, capsys):
    """Two clean servers agree answer for answer."""
    a, _ = serve()
    b, _ = serve()
    rc, rep = _probe(capsys, a, "--reference-url", b, "--n", "24", "--abort-fraction", "0.2", "--seed", "4")
    t = rep["totals"]
    assert t["reference_compared"] == t["completed"] > 0 and t["reference_mismatches"] == 0, rep["mismatch_examples"]
    assert rc == 0


# ---------------------------------------------------------------------- the image probe


def test_image_plan_alternates_two_fresh_images_after_one_text():
    jobs = probe.image_plan(rounds=2, repeats=3, seed=5, prefix_words=20, side=32)
    assert [(j.key, j.role) for j in jobs[:7]] == [(0, "warmup"), (1, "cold"), (2, "cold"), (1, "repeat"),
                                                   (2, "repeat"), (1, "repeat"), (2, "repeat")]
    assert len(jobs) == 1 + 2 * 2 * 3 and {j.key for j in jobs} == {0, 1, 2, 3, 4}
    parts = {j.key: j.messages[0]["content"] for j in jobs}
    assert len({p[0]["text"] for p in parts.values()}) == 1  # one text before every image
    assert [p["type"] for p in parts[0]] == ["text", "text"]  # the warm-up caches the text, no image
    assert len({p[1]["image_url"]["url"] for k, p in parts.items() if k}) == 4  # a fresh image per key
    assert probe.image_plan(2, 3, 5, 20, 32) == jobs  # deterministic


def test_analyze_images_counts_cross_hits_and_mismatches():
    def res(idx, key, role, cached, tokens):
        return probe.Result(probe.Job(idx, key, "image", (), "", role), text="".join(tokens), tokens=tokens,
                            finish_reason="length", prompt_tokens=400, cached_tokens=cached, done_at=idx)

    warm = res(0, 0, "warmup", 0, ["w"])
    clean = [warm, res(1, 1, "cold", 64, ["a"]), res(2, 2, "cold", 128, ["b"]), res(3, 1, "repeat", 320, ["a"]),
             res(4, 2, "repeat", 320, ["b"])]
    a = probe.analyze_images(clean)  # B's first send one boundary past A's: the image's opening tokens
    assert (a["first_sends_compared"], a["cross_hits"], a["hits_compared"], a["hit_vs_cold_mismatches"]) == (1, 0, 2, 0)
    assert a["anchor_cached_tokens"] == 64 and a["requests"] == 5 and a["completed"] == 5
    crossed = [warm, res(1, 1, "cold", 64, ["a"]), res(2, 2, "cold", 320, ["a"]), res(3, 1, "repeat", 320, ["a"]),
               res(4, 2, "repeat", 320, ["c"])]
    a = probe.analyze_images(crossed)
    assert (a["cross_hits"], a["hit_vs_cold_mismatches"]) == (1, 1)
    assert {e["what"] for e in a["mismatch_examples"]} == {"cross-hit", "hit vs cold"}


@pytest.fixture(scope="module")
def vl_server(tmp_path_factory):
    """The tiny Qwen3.5 checkpoint with a tower served in this process, twice over one engine: as it
    is, and with cache keys blind to the image (every placeholder keyed on its token id: the bug
    content keys exist to prevent)."""
    from jaxserve.engine.llm import LLM, EngineArgs
    from server.app import create_app
    from server.async_engine import AsyncEngine
    from tests.reference.bridge import run_torch
    from tests.server.test_server import _Server

    folder = tmp_path_factory.mktemp("probe-vl") / "qwen3_5-vl"
    run_torch("weights.tiny", "--family", "qwen3_5", "--variant", "vl", "--out", str(folder), "--seed", "5")
    llm = LLM.from_args(EngineArgs(model=str(folder), dtype="float32", num_pages=512, num_slots=32,
                                   max_prefill_length=64, max_running_requests=4, progress=False))

    class ContentBlind:
        def __init__(self, images):
            self._images = images

        def __getattr__(self, name):
            return getattr(self._images, name)

        def prepare(self, ids, images):
            expanded, _, prompt = self._images.prepare(ids, images)
            return expanded, expanded, prompt

    aeng = AsyncEngine(llm.engine).start()
    servers = [_Server(create_app(aeng, "probe-vl", images=llm.images)),
               _Server(create_app(aeng, "probe-vl", images=ContentBlind(llm.images)))]
    yield servers[0].url, servers[1].url
    for srv in servers:
        srv.close()
    aeng.stop()


IMAGE_PROBE = ["--kinds", "image", "--n", "8", "--repeats", "2", "--max-tokens", "4", "--json"]


def test_image_probe_clean_server(vl_server, capsys):
    capsys.readouterr()
    assert main(["probe", "--url", vl_server[0], "--seed", "1", *IMAGE_PROBE]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["requests"] == 9 and rep["errors"] == 0 and rep["completed"] == 9
    assert rep["first_sends_compared"] == 3 and rep["cross_hits"] == 0 and rep["hits_compared"] == 4
    assert rep["hit_vs_cold_mismatches"] == 0 and not rep["corruption"], rep["mismatch_examples"]
    assert rep["anchor_cached_tokens"] >= 64  # the long text did hit


def test_image_probe_catches_content_blind_keys(vl_server, capsys):
    capsys.readouterr()
    assert main(["probe", "--url", vl_server[1], "--seed", "2", *IMAGE_PROBE]) == 1
    rep = json.loads(capsys.readouterr().out)
    assert rep["cross_hits"] == 3 and rep["corruption"], rep
