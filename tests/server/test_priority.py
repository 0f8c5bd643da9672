"""``priority`` and ``user`` over HTTP: each reaches the request's ``SamplingParams`` (``priority``;
``tenant``, which ``--policy fair`` shares by), a mistyped priority is a 400 naming it, and the
priority steers the real scheduler. The served engine is conftest.py's ``ctx`` (policy fcfs); the
scheduling test swaps ``PriorityClasses`` (what ``--policy priority`` installs) and a one-request
running limit into that engine between steps, and restores both."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from jaxserve.engine.policy import PriorityClasses
from tests.server.harness import MODEL, assert_pools_free, wait_idle


def _completion(ctx, max_tokens: int = 2, **extra) -> dict:
    r = ctx.http.post("/v1/completions", json={"model": MODEL, "prompt": [5, 17, 42], "max_tokens": max_tokens,
                                               "temperature": 0, "ignore_eos": True, **extra})
    assert r.status_code == 200, r.text
    return r.json()


@pytest.fixture
def sampling_seen(ctx, monkeypatch):
    """The ``SamplingParams`` of every request the engine is handed, in order (the engine thread
    calls ``add_request`` on the instance, so the wrapper sees exactly what the server built)."""
    seen = []
    add = ctx.engine.add_request

    def recording(prompt, sampling=None, *args, **kw):
        seen.append(sampling)
        return add(prompt, sampling, *args, **kw)

    monkeypatch.setattr(ctx.engine, "add_request", recording)
    return seen


def test_priority_and_user_reach_sampling_params(ctx, sampling_seen):
    _completion(ctx, priority=-3, user="alice")
    r = ctx.http.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                                                    "max_tokens": 2, "priority": 7, "user": "bob"})
    assert r.status_code == 200, r.text
    _completion(ctx)
    assert [(s.priority, s.tenant) for s in sampling_seen] == [(-3, "alice"), (7, "bob"), (0, "")]


@pytest.mark.parametrize("value", ["high", 1.5, 2**40, None], ids=["string", "float", "huge", "null-ok"])
def test_mistyped_priority_is_a_400_naming_it(ctx, value):
    r = ctx.http.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 1, "priority": value})
    if value is None:  # an explicit null is the default class
        assert r.status_code == 200, r.text
        return
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "priority" and "priority" in err["message"], err


class _Paused:
    """Hold the engine thread between steps (a command that waits), so requests sent meanwhile
    queue up in a known order; on release the engine admits them in one scheduling pass."""

    def __init__(self, ctx):
        self.ctx, self.go = ctx, threading.Event()
        self.held = threading.Event()

        def hold(engine):
            self.held.set()
            assert self.go.wait(60), "the test never released the engine"

        self.done = ctx.aeng.call_future(hold)
        assert self.held.wait(30), "the engine thread did not pause"

    def wait_queued(self, n: int) -> None:
        deadline = time.monotonic() + 30
        while self.ctx.aeng._inbox.qsize() < n:
            assert time.monotonic() < deadline, "requests did not reach the engine's inbox"
            time.sleep(0.005)

    def release(self) -> None:
        self.go.set()
        self.done.result(30)


@pytest.fixture
def priority_engine(ctx):
    """The shared engine with ``PriorityClasses`` and room for one running request; every finish
    is logged as (user, priority, reason, preemptions) in the order the scheduler finishes them."""
    s = ctx.engine.scheduler
    wait_idle(ctx)
    saved = ctx.aeng.call_sync(lambda e: (s.policy, s.max_running))
    finished = []
    finish = s.finish

    def logging_finish(req, reason):
        finished.append((req.sampling.tenant, req.sampling.priority, reason, req.num_preemptions))
        return finish(req, reason)

    def install(e):
        s.policy, s.max_running, s.finish = PriorityClasses(), 1, logging_finish

    def restore(e):
        s.policy, s.max_running = saved
        del s.finish  # the class's method again

    ctx.aeng.call_sync(install)
    try:
        yield finished
        wait_idle(ctx)
    finally:
        ctx.aeng.call_sync(restore)
    assert_pools_free(ctx)


def test_priority_orders_admission_and_preempts_over_http(ctx, priority_engine):
    """Queued together, the high-priority request (lower value) is admitted first although it
    arrived second; sent while a low-priority request runs, it preempts it and finishes first.
    The same two requests at equal priority run in arrival order: the field made the difference."""
    finished = priority_engine
    with ThreadPoolExecutor(2) as pool:
        for first, second, order in ((9, -1, ["second", "first"]), (0, 0, ["first", "second"])):
            finished.clear()
            paused = _Paused(ctx)
            a = pool.submit(_completion, ctx, 3, priority=first, user="first")
            paused.wait_queued(1)
            b = pool.submit(_completion, ctx, 3, priority=second, user="second")
            paused.wait_queued(2)
            paused.release()
            a.result(60), b.result(60)
            assert [u for u, _, _, _ in finished] == order, finished
            assert all(n == 0 for _, _, _, n in finished), finished  # ordered, nobody preempted

        finished.clear()
        preemptions = ctx.aeng.call_sync(lambda e: e.scheduler.num_preemptions)
        stream = ctx.http.stream("POST", "/v1/completions", json={
            "model": MODEL, "prompt": [5, 17, 42], "max_tokens": 48, "temperature": 0, "ignore_eos": True,
            "stream": True, "priority": 9, "user": "low"})
        with stream as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")  # the low-priority request is running
            paused = _Paused(ctx)
            b = pool.submit(_completion, ctx, 3, priority=-1, user="high")
            paused.wait_queued(1)
            paused.release()
            b.result(60)
            for _ in lines:
                pass
        assert finished[0] == ("high", -1, "length", 0), finished
        assert finished[1][:3] == ("low", 9, "length") and finished[1][3] >= 1, finished
        assert ctx.aeng.call_sync(lambda e: e.scheduler.num_preemptions) > preemptions
