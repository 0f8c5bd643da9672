"""``jaxserve probe --reference-url`` against ``transformers serve``: another engine (torch, CPU, the
torch reference environment) serving the same shipped checkpoint.

Both sides run fp32 greedy: every completed answer of jaxserve must equal transformers' answer to
the same prompt. ``transformers serve`` returns no logprobs, so the probe compares by text; it
answers only to the model it was started with (the probe sends the name it lists) and is slow
(about 2 s a request on 2 CPU cores), so the probe here is small and its concurrency low.
The torch interpreter is found as the other torch-reference tests find it (tests/reference/bridge.py:
a missing one is an error, not a skip).
"""

from __future__ import annotations

import os
import socket
import subprocess
import time
import urllib.request

import pytest

from jaxserve.engine.flags import DEFAULT_MODEL_DIR
from tests.reference.bridge import REPO_ROOT, torch_python
from tests.test_probe import _probe, serve  # noqa: F401 - serve is a fixture

START_TIMEOUT_S = 180.0
# `transformers serve` (transformers.cli.transformers:main), whatever the interpreter's layout.
SERVE_CLI = "import sys; from transformers.cli.transformers import main; sys.exit(main())"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=2) as resp:
            return resp.status == 200
    except OSError:
        return False


@pytest.fixture
def transformers_serve(tmp_path):
    """``transformers serve weights/default`` on the CPU, fp32, on a free port; yields its URL.
    The server is stopped (killed if it does not stop) whatever the test does."""
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    log_path = tmp_path / "transformers-serve.log"
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1",
               TRANSFORMERS_OFFLINE="1")
    cmd = [torch_python(), "-c", SERVE_CLI, "serve", str(DEFAULT_MODEL_DIR), "--device", "cpu", "--dtype", "float32",
           "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        t0 = time.monotonic()
        while not _healthy(url):
            tail = lambda: log_path.read_text(errors="replace")[-3000:]  # noqa: E731
            if proc.poll() is not None:
                pytest.fail(f"transformers serve exited with {proc.returncode} before /health answered "
                            f"(is transformers[serving] installed? scripts/env.sh REFERENCE_PINS):\n{tail()}")
            if time.monotonic() - t0 > START_TIMEOUT_S:
                pytest.fail(f"transformers serve: no /health within {START_TIMEOUT_S:.0f}s:\n{tail()}")
            time.sleep(0.5)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_reference_url_transformers_serve(serve, transformers_serve, capsys):  # noqa: F811
    """jaxserve (fp32, prefix cache, aborted streams among the requests) answers exactly what
    transformers answers, prompt for prompt."""
    url, _ = serve()
    # 19 full sends (5 aborted) of 10 distinct prompts: 10 reference requests, about 3 s each on 2 cores.
    rc, rep = _probe(capsys, url, "--reference-url", transformers_serve, "--n", "24", "--repeats", "2",
                     "--abort-fraction", "0.2", "--concurrency", "2", "--seed", "4")
    t = rep["totals"]
    assert rep["reference_compared_by"] == "text", rep["reference_compared_by"]  # no logprobs from transformers
    assert t["errors"] == 0, rep["mismatch_examples"]
    assert t["reference_compared"] == t["completed"] > 0 and t["reference_mismatches"] == 0, rep["mismatch_examples"]
    assert t["hit_vs_cold_mismatches"] == 0 and rc == 0
