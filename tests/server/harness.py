"""What the server tests share: the served model's name and prompts, a uvicorn server in a thread
(run as ``jaxserve serve`` runs it), and checks of SSE, metrics and the engine's pools."""

from __future__ import annotations

import json
import re
import threading
import time

import uvicorn

from server.http import bind_socket, uvicorn_config
from server.limits import HTTPLimits

MODEL = "tiny"
KEY = "sk-test-key"
N = 12  # max_tokens of the greedy comparisons
CHAT = [{"role": "user", "content": "What is 2 + 3?"}]
LONG_IDS = [(7 * i + 3) % 500 + 1 for i in range(150)]  # > 64 tokens: hits at x64 boundaries
CONCURRENT = [f"client {i} says hello to the server number {i * 7}" for i in range(16)]
GREEDY = dict(temperature=0, max_tokens=N, extra_body={"ignore_eos": True})
# Greedy tokens must equal the offline reference exactly; logprobs only to fp32 noise: the reference
# decodes all prompts as one batch, the server each request in whatever batch it lands in, and XLA's
# CPU reductions change order with the batch shape (up to 1.35e-4 on the shipped default model).
LOGPROB_ABS = 5e-4


class Server:
    """uvicorn in a background thread on an ephemeral port, as ``jaxserve serve`` runs it."""

    def __init__(self, app, limits: HTTPLimits = HTTPLimits()):
        self.sock = bind_socket("127.0.0.1", 0)
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn_config(app, "127.0.0.1", self.port, limits, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "uvicorn did not start"
            time.sleep(0.01)

    def close(self):
        self.server.should_exit = True
        self.thread.join(10)
        self.sock.close()


def sse_events(lines) -> list:
    """Parse raw SSE lines strictly: `data: <json>` lines, each followed by a blank line, ending in [DONE]."""
    lines = list(lines)
    assert lines and lines[-1] == "" or lines[-1] == "data: [DONE]", lines[-3:]
    events, expect_blank = [], False
    for line in lines:
        if expect_blank:
            assert line == "", f"an event must end with a blank line, got {line!r}"
            expect_blank = False
            continue
        if line == "":
            continue
        assert line.startswith("data: "), line
        events.append(line[len("data: "):])
        expect_blank = True
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def aborted(ctx) -> float:
    return ctx.aeng.metrics.value("jaxserve_request_finished_total", reason="abort")


def wait_idle(ctx, timeout=30):
    deadline = time.monotonic() + timeout
    while ctx.aeng.call_sync(lambda e: e.has_work() or bool(e.requests)):
        assert time.monotonic() < deadline, "the engine did not go idle"
        time.sleep(0.02)


def assert_pools_free(ctx):
    def check(e):
        e.check_invariants()
        e.scheduler.cache.flush()
        e.check_invariants()
        s = e.scheduler
        return s.pages.num_free, s.pages.capacity, s.slots.num_free, s.slots.capacity
    pf, pc, sf, sc = ctx.aeng.call_sync(check)
    assert pf == pc and sf == sc, (pf, pc, sf, sc)


_SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{([a-zA-Z_][a-zA-Z0-9_]*="[^"]*",?)*\})? (-?[0-9.eE+-]+|\+Inf|NaN)$')


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> {sample (name and labels as written): value}; every line must parse."""
    out = {}
    for line in text.splitlines():
        if not line or line.startswith("# HELP ") or line.startswith("# TYPE "):
            continue
        m = _SAMPLE.match(line)
        assert m, f"not a Prometheus sample line: {line!r}"
        out[line.rsplit(" ", 1)[0]] = float(line.rsplit(" ", 1)[1])
    return out


def metric_types(text: str) -> dict[str, str]:
    """{family name: its # TYPE}."""
    return {p[2]: p[3] for p in (line.split() for line in text.splitlines() if line.startswith("# TYPE "))}
