"""`jaxserve serve` as users start it (a subprocess): the port opens only after the warm-up compile,
and the official openai client streams a chat completion from it."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time

import httpx
import openai


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_serve_default_model_streams_chat(tmp_path):
    port, key = _free_port(), "sk-cli"
    log = open(tmp_path / "serve.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "jaxserve.cli", "serve", "--port", str(port), "--api-key", key,
                             "--dtype", "float32", "--num-pages", "64", "--num-slots", "8", "--max-prefill-length", "64",
                             "--max-running-requests", "4", "--served-model-name", "tiny-default"],
                            stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None, (tmp_path / "serve.log").read_text()
            assert time.monotonic() < deadline, "server not ready in time"
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        startup = (tmp_path / "serve.log").read_text()
        assert "serve config:" in startup and "served_model_name=tiny-default" in startup
        assert startup.index("compiled in") < startup.index("Uvicorn running")  # ready only after the compile
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=key, max_retries=0, timeout=60)
        assert [m.id for m in client.models.list().data] == ["tiny-default"]
        stream = client.chat.completions.create(model="tiny-default", messages=[{"role": "user", "content": "Hi!"}],
                                                max_tokens=5, temperature=0, stream=True,
                                                stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        chunks = list(stream)
        assert chunks[0].choices[0].delta.role == "assistant"
        assert chunks[-1].usage.completion_tokens == 5
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def test_serve_bad_model_exits_2():
    proc = subprocess.run([sys.executable, "-m", "jaxserve.cli", "serve", "--model", "/nonexistent", "--port", "1"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "no such checkpoint folder" in proc.stderr and "Traceback" not in proc.stderr
