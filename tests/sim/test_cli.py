"""``jaxserve sim`` end to end on small traces: the report, the JSON and the plots are written,
sweeps write their table, and user errors exit 2 with one line."""

from __future__ import annotations

import json

import pytest

from jaxserve.cli import main
from jaxserve.sim.cost import FEATURES, CostModel
from jaxserve.sim.trace import TraceRecord, write_trace


@pytest.fixture()
def files(tmp_path):
    trace = tmp_path / "t.jsonl"
    write_trace([TraceRecord(t=i * 0.05, input_len=200, output_len=8, group=f"g{i % 2}", group_len=128, tenant=f"k{i % 3}")
                 for i in range(30)], trace)
    cost = tmp_path / "cost.json"
    CostModel(tuple({"const": 0.01, "tokens": 1e-5}.get(f, 0.0) for f in FEATURES),
              engine={"num_pages": 256, "num_slots": 16, "max_running": 4, "max_prefill_tokens": 256}).save(cost)
    return tmp_path, str(trace), str(cost)


def test_run_writes_report_json_and_plot(files, capsys):
    tmp, trace, cost = files
    rc = main(["sim", "--trace", trace, "--policy", "lpm", "--cost", cost, "--json", str(tmp / "r.json"),
               "--plot", str(tmp / "r.png")])
    assert rc == 0
    out = capsys.readouterr().out
    assert "policy lpm" in out and "TTFT" in out and "goodput" in out
    doc = json.loads((tmp / "r.json").read_text())
    assert doc["config"]["num_pages"] == 256 and doc["summary"]["completed"] == 30
    assert len(doc["requests"]) == 30 and set(doc["tenants"]) == {"k0", "k1", "k2"}
    assert (tmp / "r.png").read_bytes()[:4] == b"\x89PNG"


def test_sweep_writes_one_table_and_plot(files, capsys):
    tmp, trace, cost = files
    rc = main(["sim", "sweep", "--trace", trace, "--cost", cost, "--policies", "fcfs,lpm,fair", "--loads", "1,4",
               "--pools", "256:16,128:8", "--out", str(tmp / "sw")])
    assert rc == 0
    rows = json.loads((tmp / "sw" / "sweep.json").read_text())["rows"]
    assert len(rows) == 3 * 2 * 2
    assert (tmp / "sw" / "sweep.md").read_text().count("\n| ") == 1 + 12  # the header and one row per run
    assert (tmp / "sw" / "sweep.png").exists()


def test_a_longer_snapshot_interval_writes_fewer_snapshots(files):
    """--snapshot-interval reaches the simulated scheduler. Prompts of 200 tokens behind two shared
    128-token prefixes: at 64 each group's first request writes 64 and 128, every request 192 (34);
    at 128 only the two 128s, and the shared prefixes hit as much."""
    tmp, trace, cost = files
    written, hits = {}, {}
    for interval in (64, 128):
        out = tmp / f"i{interval}.json"
        assert main(["sim", "--trace", trace, "--cost", cost, "--snapshot-interval", str(interval),
                     "--json", str(out)]) == 0
        doc = json.loads(out.read_text())
        assert doc["config"]["snapshot_interval"] == interval and doc["summary"]["completed"] == 30
        written[interval], hits[interval] = doc["summary"]["snapshots_written"], doc["summary"]["hit_rate"]
    assert written == {64: 34, 128: 2} and hits[64] == hits[128] > 0, (written, hits)


def test_gen_then_run_a_generated_workload(tmp_path, files):
    _, _, cost = files
    out = tmp_path / "agents.jsonl"
    assert main(["sim", "gen", "agent-sessions", "--n", "3", "--out", str(out)]) == 0
    assert len(out.read_text().splitlines()) == 3 * 8
    assert main(["sim", "--workload", "tenants", "--n", "20", "--cost", cost, "--policy", "fair"]) == 0


@pytest.mark.parametrize("argv, message", [
    (["sim", "--trace", "missing.jsonl"], "cannot read trace"),
    (["sim", "--workload", "tenants", "--policy", "nope"], "unknown scheduling policy"),
    (["sim", "--workload", "tenants", "--cost", "missing.json"], "cannot read cost model"),
    (["sim", "--workload", "tenants", "--n", "0"], "--n must be"),
    (["sim", "--workload", "tenants", "--n", "5", "--snapshot-interval", "100"], "snapshot_interval must be a multiple"),
])
def test_user_errors_exit_2(argv, message, capsys):
    assert main(argv) == 2
    assert message in capsys.readouterr().err
