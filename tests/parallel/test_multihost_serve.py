"""``jaxserve serve`` over two processes of two CPU devices each, the model split over all four:
process 0 serves HTTP and process 1 follows its steps (``jaxserve.engine.llm.lead`` / ``follow``).

- Greedy completions (one a prefix-cache hit, one streamed, two at once) equal one device's
  ``generate`` of the same prompts, and process 1 exits 0 when process 0 stops.
- A follower whose process 0 disappears exits non-zero, saying so, instead of waiting for it."""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import subprocess
import sys
import time

import httpx
import numpy as np
import pytest

from jaxserve import cli
from tests.parallel.multihost_worker import xla_flags
from tests.parallel.test_multihost import _free_port

ENGINE = ["--dtype", "float32", "--max-prefill-length", "64", "--max-running-requests", "4", "--page-size", "4",
          "--num-pages", "40", "--num-slots", "12"]
MAX_TOKENS = 6
_rng = np.random.default_rng(1)
# A (chunked: more than a step's 64 tokens), then B extending A's prompt (a hit on the tree's pages and
# the snapshot at 64 tokens), then C streamed and D at the same time (a batch of two).
A = _rng.integers(10, 1000, 70).tolist()
PROMPTS = {"a": A, "b": A + [8, 9], "c": _rng.integers(10, 1000, 9).tolist(),
           "d": _rng.integers(10, 1000, 13).tolist()}


class Pair:
    """``serve`` as process 0 (HTTP on ``port``) and 1, their logs in files."""

    def __init__(self, tmp_path):
        self.port, addr = _free_port(), f"127.0.0.1:{_free_port()}"
        env = dict(os.environ, XLA_FLAGS=xla_flags(os.environ.get("XLA_FLAGS", "")))
        self.logs = [tmp_path / f"p{i}.log" for i in range(2)]
        self._files = [open(log, "w") for log in self.logs]
        self.procs = [subprocess.Popen(
            [sys.executable, "-m", "jaxserve.cli", "serve", "--port", str(self.port), *ENGINE,
             "--tensor-parallel-size", "4", "--compile-cache", str(tmp_path.parent / "xla"),
             "--coordinator-address", addr, "--num-processes", "2", "--process-id", str(i)],
            stdout=f, stderr=subprocess.STDOUT, env=env) for i, f in enumerate(self._files)]

    def log(self, i: int) -> str:
        return self.logs[i].read_text()[-4000:]

    def wait_ready(self, timeout: float = 240) -> None:
        deadline = time.monotonic() + timeout
        while True:
            for i, p in enumerate(self.procs):
                assert p.poll() is None, f"process {i} ended: {self.log(i)}"
            assert time.monotonic() < deadline, f"not ready in time: {self.log(0)}"
            try:
                if httpx.get(f"http://127.0.0.1:{self.port}/health", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                time.sleep(0.3)

    def wait(self, i: int, timeout: float = 60) -> int:
        return self.procs[i].wait(timeout)

    def kill(self) -> None:
        for p, f in zip(self.procs, self._files):
            if p.poll() is None:
                p.kill()
                p.wait()
            f.close()


@pytest.fixture
def pair(tmp_path):
    p = Pair(tmp_path)
    try:
        p.wait_ready()
        yield p
    finally:
        p.kill()


def _complete(port: int, ids: list[int], stream: bool = False) -> dict:
    """A greedy completion of ``ids``: {text, logprobs (of each token), cached (prompt tokens)}."""
    body = {"model": "jaxserve-default", "prompt": ids, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
            "logprobs": 0, "stream": stream}
    url = f"http://127.0.0.1:{port}/v1/completions"
    if not stream:
        r = httpx.post(url, json=body, timeout=120)
        assert r.status_code == 200, r.text
        out = r.json()
        return {"text": out["choices"][0]["text"], "logprobs": out["choices"][0]["logprobs"]["token_logprobs"],
                "cached": out["usage"]["prompt_tokens_details"]["cached_tokens"]}
    text, lps = "", []
    with httpx.stream("POST", url, json={**body, "stream_options": {"include_usage": True}}, timeout=120) as r:
        assert r.status_code == 200
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    for e in events:
        for c in e["choices"]:
            text += c["text"]
            lps += (c["logprobs"] or {}).get("token_logprobs") or []
    return {"text": text, "logprobs": lps, "cached": events[-1]["usage"]["prompt_tokens_details"]["cached_tokens"]}


def _one_device(tmp_path, capsys) -> dict[str, dict]:
    """``generate`` of ``PROMPTS`` on one device in this process, by name."""
    prompts = tmp_path / "ref.jsonl"
    prompts.write_text("".join(json.dumps({"prompt_ids": ids}) + "\n" for ids in PROMPTS.values()))
    capsys.readouterr()
    assert cli.main(["generate", *ENGINE, "--prompts-file", str(prompts), "--max-tokens", str(MAX_TOKENS),
                     "--temperature", "0", "--ignore-eos", "--json"]) == 0
    outs = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    return dict(zip(PROMPTS, outs))


def test_serve_over_two_processes_equals_one_device(pair, tmp_path, capsys):
    got = {"a": _complete(pair.port, PROMPTS["a"]), "b": _complete(pair.port, PROMPTS["b"])}
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        c = pool.submit(_complete, pair.port, PROMPTS["c"], True)
        d = pool.submit(_complete, pair.port, PROMPTS["d"])
        got.update(c=c.result(), d=d.result())
    assert got["a"]["cached"] == 0 and got["b"]["cached"] == 64, "B reads A's first 64 tokens from the prefix cache"
    pair.procs[0].send_signal(signal.SIGINT)
    assert pair.wait(0) == 0, pair.log(0)
    assert pair.wait(1) == 0, pair.log(1)

    ref = _one_device(tmp_path, capsys)
    for name, r in ref.items():
        assert got[name]["text"] == r["text"], name
        np.testing.assert_allclose(got[name]["logprobs"], r["logprobs"], rtol=1e-4, atol=1e-4, err_msg=name)


def test_a_follower_whose_leader_dies_fails(pair):
    """A follower never outlives process 0: it fails, either at its next message (the channel's
    own error) or first through JAX's coordination agent, which ends every process once another
    task died (whichever notices first: a race, both are the same failure)."""
    pair.procs[0].kill()
    assert pair.wait(1) != 0
    log = pair.log(1)
    assert "process 0 is gone" in log or "distributed service detected fatal errors" in log, log
