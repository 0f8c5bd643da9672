"""The bridge between the single-threaded ``Engine`` and asyncio.

The engine is not thread-safe, so exactly one thread ever touches it: ``AsyncEngine``'s engine
thread. Its loop: drain the inbox (``Command``s: ``Add`` / ``Abort`` / ``Call`` / ``Wake``), run
``engine.step()`` while there is work, otherwise block on the inbox, and after each round publish
``engine.stats()`` to the metrics. Each request's outputs (``RequestOutput`` deltas, or the
exception that ended it) go to that request's ``asyncio.Queue`` through
``loop.call_soon_threadsafe``, one callback per step.

Every way a request can end goes through the engine thread (finish, ``abort`` from a dropped
client, an engine error), and its queue is dropped there too, so nothing a request held outlives
it (invariant 7). ``call(fn)`` runs ``fn(engine)`` between two steps: the safe way for metrics,
tests and debugging to look at the engine. A request's bad data cannot end the thread: the
engine checks it at ``add_request`` (a 400), and a step that fails fails only its own requests.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import itertools
import queue
import sys
import threading
import time
import traceback
from typing import Any, Callable, Sequence

from jaxserve.engine.engine import Engine, RequestOutput
from jaxserve.sampling_params import SamplingParams
from server.metrics import Metrics


class EngineDeadError(RuntimeError):
    pass


class RequestFailedError(RuntimeError):
    """The request's step failed on the device (``finish_reason == "error"``): this request fails,
    the engine goes on serving (``Engine`` docstring)."""


class _Stream:
    """Per-request state the engine thread keeps: where to deliver, and timing for metrics."""

    __slots__ = ("queue", "loop", "arrival", "last", "prompt_tokens")

    def __init__(self, q: asyncio.Queue, loop: asyncio.AbstractEventLoop, arrival: float, prompt_tokens: int):
        self.queue, self.loop, self.arrival, self.last, self.prompt_tokens = q, loop, arrival, None, prompt_tokens


# Commands the asyncio side posts to the engine thread's inbox.


@dataclasses.dataclass(frozen=True)
class Add:
    """Add a request; ``done`` gets the id (or the ``ValueError`` the engine raised: a 400)."""

    rid: str
    prompt_ids: list[int]
    sampling: SamplingParams
    stop: tuple[str, ...]
    stream: _Stream
    done: concurrent.futures.Future
    cache_ids: list[int] | None = None  # a prompt with images: its content-keyed cache ids
    images: Any = None  # ... and its ImagePrompt (jaxserve.multimodal.prompt.prepare)


@dataclasses.dataclass(frozen=True)
class Abort:
    """Drop a request (no-op if it already finished)."""

    rid: str


@dataclasses.dataclass(frozen=True)
class Call:
    """Run ``fn(engine)`` between two steps; ``done`` gets its result or exception."""

    fn: Callable[[Engine], Any]
    done: concurrent.futures.Future


@dataclasses.dataclass(frozen=True)
class Wake:
    """Nothing to do: makes a blocked engine thread look at ``_stopping``."""


Command = Add | Abort | Call | Wake


class AsyncEngine:
    def __init__(self, engine: Engine, metrics: Metrics | None = None):
        self.engine = engine  # touch only from the engine thread (or before start / after stop)
        self.metrics = metrics or Metrics()
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.error: BaseException | None = None

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> "AsyncEngine":
        self._thread = threading.Thread(target=self._run, name="jaxserve-engine", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        self._stopping = True
        self._inbox.put(Wake())
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.error is None

    # ------------------------------------------------------------------ asyncio side

    async def add(self, prompt_ids: Sequence[int], sampling: SamplingParams, stop: Sequence[str] = (),
                  cache_ids: Sequence[int] | None = None, images: Any = None) -> tuple[str, asyncio.Queue]:
        """Queue a request; returns its id and the queue its outputs arrive on (a ``RequestOutput``
        per step that produced something, the last one ``finished``; or an exception). Raises
        ``ValueError`` if the engine rejects the request (the caller's 400). A prompt with images
        comes with its placeholders expanded, its ``cache_ids`` and its ``ImagePrompt``."""
        self._check_alive()
        loop = asyncio.get_running_loop()
        rid = f"srv-{next(self._ids)}"
        q: asyncio.Queue = asyncio.Queue()
        fut: concurrent.futures.Future = concurrent.futures.Future()
        stream = _Stream(q, loop, time.perf_counter(), len(prompt_ids))
        self._inbox.put(Add(rid, list(prompt_ids), sampling, tuple(stop), stream, fut,
                            None if cache_ids is None else list(cache_ids), images))
        await asyncio.wrap_future(fut)
        return rid, q

    def abort(self, rid: str) -> None:
        """Ask the engine thread to drop ``rid`` (no-op if it already finished). Safe from any thread."""
        self._inbox.put(Abort(rid))

    async def call(self, fn: Callable[[Engine], Any]) -> Any:
        self._check_alive()
        return await asyncio.wrap_future(self.call_future(fn))

    def call_sync(self, fn: Callable[[Engine], Any], timeout: float | None = 60) -> Any:
        """``fn(engine)`` between steps, from a thread that is not the event loop (tests, debugging)."""
        self._check_alive()
        return self.call_future(fn).result(timeout)

    def call_future(self, fn: Callable[[Engine], Any]) -> concurrent.futures.Future:
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._inbox.put(Call(fn, fut))
        return fut

    def _check_alive(self) -> None:
        if not self.alive:
            raise EngineDeadError(f"the engine thread is not running ({self.error!r})")

    # ------------------------------------------------------------------ engine thread

    def _run(self) -> None:
        try:
            self._publish_stats()
            while not self._stopping:
                block = not self.engine.has_work()
                try:
                    cmds = [self._inbox.get(block=block)]
                except queue.Empty:
                    cmds = []
                while True:
                    try:
                        cmds.append(self._inbox.get_nowait())
                    except queue.Empty:
                        break
                for cmd in cmds:
                    self._handle(cmd)
                if self.engine.has_work():
                    outputs = self.engine.step()
                    self._deliver(outputs)
                self._publish_stats()
        except BaseException as e:  # a bug in the engine: fail every request, refuse new ones
            self.error = e
            traceback.print_exc(file=sys.stderr)
            for stream in list(self._streams.values()):
                stream.loop.call_soon_threadsafe(stream.queue.put_nowait, EngineDeadError(f"engine failed: {e!r}"))
            self._streams.clear()
            while True:  # fail whatever is still queued, so no caller waits forever
                try:
                    cmd = self._inbox.get_nowait()
                except queue.Empty:
                    break
                if isinstance(cmd, (Add, Call)):
                    cmd.done.set_exception(EngineDeadError(f"engine failed: {e!r}"))

    def _handle(self, cmd: Command) -> None:
        if isinstance(cmd, Add):
            try:
                self.engine.add_request(cmd.prompt_ids, cmd.sampling, stop=cmd.stop, request_id=cmd.rid,
                                        cache_ids=cmd.cache_ids, images=cmd.images)
            except Exception as e:  # ValueError: bad prompt / too long / out of range; reported as a 400
                cmd.done.set_exception(e)
                return
            self._streams[cmd.rid] = cmd.stream
            self.metrics.prompt_tokens.inc(len(cmd.prompt_ids))
            cmd.done.set_result(cmd.rid)
        elif isinstance(cmd, Abort):
            if self._streams.pop(cmd.rid, None) is not None:
                self.engine.abort(cmd.rid)
                self.metrics.requests_finished.labels(reason="abort").inc()
        elif isinstance(cmd, Call):
            try:
                cmd.done.set_result(cmd.fn(self.engine))
            except Exception as e:
                cmd.done.set_exception(e)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        now = time.perf_counter()
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        m = self.metrics
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            n = len(out.new_ids)
            if n:
                m.generation_tokens.inc(n)
                if stream.last is None:
                    m.ttft.observe(now - stream.arrival)
                    m.cached_tokens.inc(out.cached_tokens)
                else:
                    m.itl.observe(now - stream.last)
                stream.last = now
            if out.finished:
                del self._streams[out.request_id]
                m.e2e.observe(now - stream.arrival)
                m.requests_finished.labels(reason=out.finish_reason).inc()
            if out.finish_reason == "error":
                out = RequestFailedError("the engine failed to run this request's step on the device (see the "
                                         "server log); other requests are unaffected, retrying may succeed")
            by_loop.setdefault(stream.loop, []).append((stream.queue, out))
        for loop, items in by_loop.items():
            loop.call_soon_threadsafe(_put_all, items)

    def _publish_stats(self) -> None:
        self.metrics.engine_stats = self.engine.stats()


def _put_all(items: list) -> None:
    for q, out in items:
        q.put_nowait(out)
