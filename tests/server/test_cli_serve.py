"""`jaxserve serve` as users start it (a subprocess): the port opens only after every step program is
compiled, the official openai client streams a chat completion from it, and no request after that
waits for a compile."""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import re
import signal
import socket
import subprocess
import sys
import time

import httpx
import openai
import pytest

from tests.server.harness import parse_metrics

KEY = "sk-cli"
# --max-prefill-length 64 --max-running-requests 4: token buckets (32, 64), each a full-width and a
# one-row program; decode buckets (1, 2, 4) with S in (0, 1), (0, 2), (1, 4): 4 + 6 step programs.
PROGRAMS = 10


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """One server for the module: (base url, its log file)."""
    port, log_path = _free_port(), tmp_path_factory.mktemp("serve") / "serve.log"
    log = open(log_path, "w")
    proc = subprocess.Popen([sys.executable, "-m", "jaxserve.cli", "serve", "--port", str(port), "--api-key", KEY,
                             "--dtype", "float32", "--num-pages", "64", "--num-slots", "8", "--max-prefill-length", "64",
                             "--max-running-requests", "4", "--served-model-name", "tiny-default"],
                            stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 300
        while True:
            assert proc.poll() is None, log_path.read_text()
            assert time.monotonic() < deadline, "server not ready in time"
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        yield f"http://127.0.0.1:{port}", log_path
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def test_serve_default_model_streams_chat(served):
    url, log_path = served
    startup = log_path.read_text()
    assert "serve config:" in startup and "served_model_name=tiny-default" in startup
    assert f"compiling {PROGRAMS} step programs" in startup and f"compiled {PROGRAMS} step programs in" in startup
    assert startup.index("compiled in") < startup.index("Uvicorn running on")  # ready only after the compile
    assert re.search(r"weights loaded in [\d.]+s \([\d.]+ GB, [\d.]+ GB/s\)", startup)
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=60)
    assert [m.id for m in client.models.list().data] == ["tiny-default"]
    stream = client.chat.completions.create(model="tiny-default", messages=[{"role": "user", "content": "Hi!"}],
                                            max_tokens=5, temperature=0, stream=True,
                                            stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].usage.completion_tokens == 5


def test_no_request_waits_for_a_compile(served):
    """Prompts of 1 to 150 tokens (chunked at 64), 1 to 4 at once, short and long outputs, greedy
    and sampled: after "ready" the process compiles nothing (``/metrics``); its step compiles are the
    start-up's, one per program (on a CPU nothing is measured, so there is no probe)."""
    url, _ = served
    headers = {"Authorization": f"Bearer {KEY}"}
    m0 = parse_metrics(httpx.get(f"{url}/metrics").text)
    assert m0["jaxserve_step_compiles_total"] == PROGRAMS

    def complete(n_prompt: int, max_tokens: int, temperature: float) -> int:
        body = {"model": "tiny-default", "prompt": [(7 * i + n_prompt) % 3000 + 10 for i in range(n_prompt)],
                "max_tokens": max_tokens, "temperature": temperature, "seed": n_prompt, "ignore_eos": True}
        r = httpx.post(f"{url}/v1/completions", json=body, headers=headers, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()["usage"]["completion_tokens"]

    mix = [(1, 3, 0.0), (20, 70, 0.8), (64, 1, 0.0), (65, 9, 0.0), (150, 20, 0.5), (3, 2, 0.0), (100, 40, 0.0)]
    for concurrency in (1, 2, 4):
        with concurrent.futures.ThreadPoolExecutor(concurrency) as ex:
            done = list(ex.map(lambda a: complete(*a), mix[:concurrency + 3]))
        assert done == [k for _, k, _ in mix[:concurrency + 3]]
    m1 = parse_metrics(httpx.get(f"{url}/metrics").text)
    assert m1["jaxserve_compiles_after_ready_total"] == 0
    assert m1["jaxserve_step_compiles_total"] == PROGRAMS


def test_serve_bad_model_exits_2():
    proc = subprocess.run([sys.executable, "-m", "jaxserve.cli", "serve", "--model", "/nonexistent", "--port",
                           str(_free_port())], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "no such checkpoint folder" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.parametrize("flag, value, message", [("--mem-fraction", "0", "--mem-fraction must be in (0, 1]"),
                                                  ("--compile-workers", "0", "--compile-workers must be >= 1"),
                                                  ("--snapshot-interval", "96",
                                                   "--snapshot-interval must be a multiple of 64"),
                                                  ("--request-read-timeout", "0", "--request-read-timeout must be > 0"),
                                                  ("--limit-concurrency", "-1", "--limit-concurrency must be > 0")])
def test_serve_bad_start_up_flags_exit_2(flag, value, message):
    proc = subprocess.run([sys.executable, "-m", "jaxserve.cli", "serve", flag, value, "--port", str(_free_port())],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and message in proc.stderr and "Traceback" not in proc.stderr


def test_serve_busy_port_exits_2_before_loading_the_model():
    """The port is taken before the checkpoint loads and the step programs compile (minutes on a big
    model), not found busy after them."""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        proc = subprocess.run([sys.executable, "-m", "jaxserve.cli", "serve", "--port", str(port)],
                              capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and f"cannot listen on 127.0.0.1:{port}" in proc.stderr, proc.stderr
    assert "loading" not in proc.stderr and "Traceback" not in proc.stderr


def test_serve_help_says_every_flag_and_its_default():
    """Every serve flag has help, each valued one says its default, and the engine's defaults are
    EngineArgs' (said once)."""
    from jaxserve.cli import build_parser
    from jaxserve.engine.llm import EngineArgs
    from server.limits import HTTPLimits

    ap = build_parser()
    serve = next(a for a in ap._subparsers._group_actions if a.dest == "command").choices["serve"]
    for action in serve._actions:
        if action.dest == "help" or action.help == argparse.SUPPRESS:
            continue
        assert action.help, action.option_strings
        if action.nargs != 0:  # a flag that takes a value says what it is without one
            assert "default" in action.help, action.option_strings
    args = ap.parse_args(["serve"])
    defaults = EngineArgs(model="m")
    for name in ("dtype", "page_size", "max_prefill_length", "max_running_requests", "num_pages", "num_slots",
                 "kernels", "mem_fraction", "compile_workers"):
        assert getattr(args, name) == getattr(defaults, name), name
    assert (args.timeout_keep_alive, args.request_read_timeout, args.limit_concurrency) == \
        dataclasses.astuple(HTTPLimits())
    text = " ".join(serve.format_help().split())
    assert f"(default: {defaults.max_prefill_length})" in text
    assert f"(default: {HTTPLimits().limit_concurrency})" in text
