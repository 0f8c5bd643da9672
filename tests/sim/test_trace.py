"""Traces and workloads: the formats load as documented, bad input is a clear error, generators
are deterministic and shaped as they claim, and the replay gives requests exactly the shared
content the trace says they share."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxserve.sim import workload
from jaxserve.sim.replay import Replay, token_stream
from jaxserve.sim.trace import TRACES_DIR, TraceError, TraceRecord, load_trace, write_trace


def test_jsonl_roundtrip_and_arrival_order(tmp_path):
    recs = [TraceRecord(t=2.0, input_len=10, output_len=3, tenant="a", priority=1),
            TraceRecord(t=0.5, input_len=100, output_len=5, group="g", group_len=64)]
    p = tmp_path / "t.jsonl"
    write_trace(recs, p)
    assert json.loads(p.read_text().splitlines()[0]) == {"t": 2.0, "input_len": 10, "output_len": 3,
                                                         "priority": 1, "tenant": "a"}
    assert load_trace(p) == sorted(recs, key=lambda r: r.t)


def test_mooncake_and_burstgpt_formats(tmp_path):
    mc = tmp_path / "mooncake.jsonl"
    mc.write_text('{"timestamp": 1500, "input_length": 700, "output_length": 12, "hash_ids": [4, 5]}\n')
    (r,) = load_trace(mc)
    assert (r.t, r.input_len, r.output_len, r.hash_ids, r.block_size) == (1.5, 700, 12, (4, 5), 512)
    bg = tmp_path / "burst.csv"
    bg.write_text("Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
                  "100,ChatGPT,50,20,70,Conversation log\n105,GPT-4,0,0,0,Conversation log\n"
                  "107,GPT-4,30,0,30,API log\n")
    recs = load_trace(bg)
    assert [(r.t, r.input_len, r.output_len, r.tenant) for r in recs] == [(0.0, 50, 20, "ChatGPT"), (7.0, 30, 1, "GPT-4")]


@pytest.mark.parametrize("line, message", [
    ('{"t": 0, "input_len": 5}', "missing fields"),
    ('{"t": 0, "input_len": 5, "output_len": 1, "colour": 1}', "unknown fields"),
    ('{"t": -1, "input_len": 5, "output_len": 1}', "t must be"),
    ('{"t": 0, "input_len": 5, "output_len": 1, "group_len": 3}', "group_len"),
    ('{"t": 0, "input_len": 5, "output_len": 1, "turn": 1}', "without a session"),
    ('not json', "t.jsonl:1"),
])
def test_bad_records_name_the_line(tmp_path, line, message):
    p = tmp_path / "t.jsonl"
    p.write_text(line + "\n")
    with pytest.raises(TraceError, match=message):
        load_trace(p)


def test_session_turns_must_be_complete(tmp_path):
    p = tmp_path / "t.jsonl"
    write_trace([TraceRecord(t=0, input_len=5, output_len=1, session="s"),
                 TraceRecord(t=0, input_len=5, output_len=1, session="s", turn=2)], p)
    with pytest.raises(TraceError, match="expected 0..1"):
        load_trace(p)


def test_missing_trace_lists_the_shipped_ones():
    with pytest.raises(TraceError, match="shipped traces: .*agent-sessions"):
        load_trace("no-such-trace")


@pytest.mark.parametrize("name", sorted(p.stem for p in TRACES_DIR.glob("*.jsonl")))
def test_shipped_traces_load(name):
    assert len(load_trace(name)) >= 40


def test_arrival_processes_have_the_asked_rate_and_burstiness():
    for cv in (1.0, 3.0):
        ts = workload.arrivals(20000, rate=50.0, seed=1, cv=cv)
        gaps = [b - a for a, b in zip(ts, ts[1:])]
        mean = sum(gaps) / len(gaps)
        std = (sum((g - mean) ** 2 for g in gaps) / len(gaps)) ** 0.5
        assert mean == pytest.approx(1 / 50, rel=0.05) and std / mean == pytest.approx(cv, rel=0.1)
    with pytest.raises(ValueError):
        workload.arrivals(3, rate=0, seed=0)


def test_generators_are_deterministic_and_valid():
    for name, gen in workload.WORKLOADS.items():
        a, b = gen(seed=3), gen(seed=3)
        assert a == b and a != gen(seed=4), name
    sessions = workload.agent_sessions(sessions=4, turns=3)
    assert sorted((r.session, r.turn) for r in sessions) == [(f"agent-0-{s}", t) for s in range(4) for t in range(3)]


@settings(max_examples=30, deadline=None)
@given(n=st.integers(0, 300), m=st.integers(0, 300), name=st.text(max_size=8))
def test_token_streams_are_prefix_consistent(n, m, name):
    a, b = token_stream(name, n, (10, 1000)), token_stream(name, m, (10, 1000))
    k = min(n, m)
    assert a[:k] == b[:k] and len(a) == n and all(10 <= t < 1000 for t in a)


def test_replay_shares_exactly_what_the_trace_shares():
    recs = [TraceRecord(t=0, input_len=100, output_len=4, group="g", group_len=64),
            TraceRecord(t=1, input_len=90, output_len=4, group="g", group_len=64),
            TraceRecord(t=2, input_len=1100, output_len=4, hash_ids=(7, 8, 9)),
            TraceRecord(t=3, input_len=600, output_len=4, hash_ids=(7, 1))]
    rp = Replay(recs)
    assert rp.due(0.5)[0].rid == "r0" and rp.next_time() == 1
    a, b, c, d = (x.prompt for x in [*Replay(recs).due(10)])
    assert a[:64] == b[:64] and a[64] != b[64] and (len(a), len(b)) == (100, 90)
    assert c[:512] == d[:512] and c[512:600] != d[512:600] and (len(c), len(d)) == (1100, 600)


def test_replay_builds_turns_from_the_answer_and_edits_the_tail():
    recs = [TraceRecord(t=0, input_len=50, output_len=3, session="s"),
            TraceRecord(t=0, input_len=20, output_len=3, session="s", turn=1, think_s=2.0, edit=5)]
    rp = Replay(recs)
    (first,) = rp.due(0)
    assert rp.next_time() is None  # the next turn waits for the answer
    rp.finish("r0", [1, 2, 3], now=4.0)
    assert rp.next_time() == 6.0 and rp.due(5.9) == []
    (second,) = rp.due(6.0)
    context = first.prompt + [1, 2, 3]
    assert second.prompt[:48] == context[:48] and len(second.prompt) == 48 + 20


def test_a_refused_turn_ends_its_session():
    recs = [TraceRecord(t=0, input_len=5, output_len=1, session="s"),
            TraceRecord(t=0, input_len=5, output_len=1, session="s", turn=1)]
    rp = Replay(recs)
    rp.due(0)
    rp.finish("r0", None, 1.0)
    assert rp.next_time() is None
