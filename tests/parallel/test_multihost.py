"""Several hosts, as two processes on this machine: ``jax.distributed`` over two processes of two CPU
devices each (gloo collectives), the shipped default model split over all four devices.

- The model's steps (``tests/parallel/multihost_worker.py``): both processes see four devices and
  compute the same logits as one device does (fp32; the split only reorders sums).
- The engine (``jaxserve generate`` in each process): process 0 prints one device's greedy tokens
  and process 1 prints nothing; processes given different engine flags (or a mesh short of a
  process) both fail at once with one line; a process that fails alone takes the other down with
  it instead of leaving it waiting in a collective.
- How the settings are read and checked (``serve`` over processes: test_multihost_serve.py)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import numpy as np
import pytest

from jaxserve import cli
from jaxserve.parallel.distributed import DistributedSpec
from tests.parallel.multihost_worker import schedule, xla_flags

REL_TOL = 1e-5  # of max |logit|


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_processes(commands: list[list[str]], env: dict, timeout: float) -> list[tuple[int, str, str]]:
    """Run ``commands`` at once; (exit status, stdout, stderr) of each. Every process still running
    after ``timeout`` seconds in all (a missed collective hangs) is killed and the test fails."""
    procs = [subprocess.Popen(c, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env) for c in commands]
    try:
        outs = [p.communicate(timeout=timeout) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return [(p.returncode, out, err) for p, (out, err) in zip(procs, outs)]


def test_two_processes_split_the_model_over_four_devices(tmp_path):
    addr, out = f"127.0.0.1:{_free_port()}", str(tmp_path / "logits")
    env = dict(os.environ)  # the workers keep this package's XLA flags but force their own device count
    runs = _run_processes([[sys.executable, "-m", "tests.parallel.multihost_worker", addr, "2", str(i), out]
                           for i in range(2)], env, timeout=600)
    assert [rc for rc, _, _ in runs] == [0, 0], "\n".join((o + e)[-2000:] for _, o, e in runs)
    ref = schedule(None)
    for pid in range(2):
        got = np.load(f"{out}{pid}.npz")
        assert got["devices"].tolist() == [4, pid]
        for i, theirs in enumerate(ref):
            ours = got[f"arr_{i}"]
            err, scale = np.max(np.abs(ours - theirs)), np.max(np.abs(theirs))
            assert err <= REL_TOL * scale, f"process {pid}, step {i}: max |Δlogit| {err:.3g} > {REL_TOL} · {scale:.3g}"
            assert (ours.argmax(-1) == theirs.argmax(-1)).all()


def test_spec_from_flags_and_env(monkeypatch):
    for var in ("JAXSERVE_COORDINATOR_ADDRESS", "JAXSERVE_NUM_PROCESSES", "JAXSERVE_PROCESS_ID"):
        monkeypatch.delenv(var, raising=False)
    assert DistributedSpec.resolve() is None
    assert DistributedSpec.resolve("h:1", 2, 1) == DistributedSpec("h:1", 2, 1)
    monkeypatch.setenv("JAXSERVE_COORDINATOR_ADDRESS", "10.0.0.1:1234")
    monkeypatch.setenv("JAXSERVE_NUM_PROCESSES", "4")
    monkeypatch.setenv("JAXSERVE_PROCESS_ID", "3")
    assert DistributedSpec.resolve(process_id=0) == DistributedSpec("10.0.0.1:1234", 4, 0)  # a flag wins
    monkeypatch.delenv("JAXSERVE_PROCESS_ID")
    with pytest.raises(ValueError, match="missing process_id"):
        DistributedSpec.resolve()
    for args, message in ((("nohost", 2, 0), "HOST:PORT"), (("h:1", 2, 2), "process_id must be in"),
                          (("h:1", 0, 0), "process_id must be in"), (("h:1", "two", 0), "must be integers")):
        with pytest.raises(ValueError, match=message):
            DistributedSpec.resolve(*args)


PROMPTS = ["The capital of France is", "1 + 2 =", "Once upon a time"]
# Greedy, fp32, small steps (the two-process run compiles a handful of small programs), and pools too
# small for the three requests at once (14 pages of 4 tokens, 9 to go round): one is preempted and
# recomputed, in step in both processes.
GENERATE = ["generate", "--max-tokens", "8", "--temperature", "0", "--ignore-eos", "--dtype", "float32",
            "--max-prefill-length", "64", "--max-running-requests", "4", "--page-size", "4", "--num-pages", "10",
            "--num-slots", "8", "--json"]


def _generate_over_two_processes(tmp_path, extra: list[list[str]]) -> list[tuple[int, str, str]]:
    """``jaxserve generate`` of ``PROMPTS`` in two processes of two CPU devices each, the model split
    over all four; ``extra[i]``: process i's own flags. Both share one compile cache directory (JAX
    writes it from process 0 only)."""
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS) + "\n")
    addr = f"127.0.0.1:{_free_port()}"
    env = dict(os.environ, XLA_FLAGS=xla_flags(os.environ.get("XLA_FLAGS", "")))
    return _run_processes([[sys.executable, "-m", "jaxserve.cli", *GENERATE, "--prompts-file", str(prompts),
                            "--tensor-parallel-size", "4", "--compile-cache", str(tmp_path / "xla"),
                            "--coordinator-address", addr, "--num-processes", "2", "--process-id", str(i), *extra[i]]
                           for i in range(2)], env, timeout=300)


def test_generate_over_two_processes_equals_one_device(tmp_path, capsys):
    runs = _generate_over_two_processes(tmp_path, [[], []])
    assert [rc for rc, _, _ in runs] == [0, 0], "\n".join(err[-3000:] for _, _, err in runs)
    assert runs[1][1] == "", "only process 0 prints results"
    got = [json.loads(line) for line in runs[0][1].splitlines()]

    assert cli.main([*GENERATE, "--prompts-file", str(tmp_path / "prompts.txt")]) == 0  # one device, this process
    ref = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert len(ref) == len(PROMPTS) and all(len(r["output_ids"]) == 8 for r in ref)
    assert [g["output_ids"] for g in got] == [r["output_ids"] for r in ref]


@pytest.mark.parametrize("extra, message", [
    ([[], ["--max-running-requests", "2"]], "every process must be given the same engine arguments"),
    ([["--tensor-parallel-size", "2"]] * 2, "give tensor_parallel_size=4, not 2"),  # a mesh without process 1
], ids=["different-flags", "mesh-short-of-a-process"])
def test_bad_settings_fail_in_every_process_at_once(tmp_path, extra, message):
    for rc, _, err in _generate_over_two_processes(tmp_path, extra):
        assert rc == 2 and message in err, err[-3000:]


def test_a_process_that_fails_alone_ends_both(tmp_path):
    runs = _generate_over_two_processes(tmp_path, [[], ["--model", str(tmp_path / "missing")]])
    assert runs[1][0] == 2 and "no config.json" in runs[1][2], runs[1][2][-3000:]
    assert runs[0][0] != 0, "process 0 must fail (its peer is gone), not hang or succeed"
