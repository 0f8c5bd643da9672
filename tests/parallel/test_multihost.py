"""Several hosts, as two processes on this machine: ``jax.distributed`` over two processes of two CPU
devices each (gloo collectives), the shipped default model split over all four devices
(``tests/parallel/multihost_worker.py``). Both processes must see four devices and compute the same
logits as one device does for the same steps (fp32; the split only reorders sums). Also: how the
settings are read and checked."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import numpy as np
import pytest

from jaxserve.parallel.distributed import DistributedSpec
from tests.parallel.multihost_worker import schedule

REL_TOL = 1e-5  # of max |logit|


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_split_the_model_over_four_devices(tmp_path):
    addr, out = f"127.0.0.1:{_free_port()}", str(tmp_path / "logits")
    env = dict(os.environ)  # the workers keep this package's XLA flags but force their own device count
    procs = [subprocess.Popen([sys.executable, "-m", "tests.parallel.multihost_worker", addr, "2", str(i), out],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
             for i in range(2)]
    try:
        logs = [p.communicate(timeout=600)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert [p.returncode for p in procs] == [0, 0], "\n".join(log[-2000:] for log in logs)
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
