"""Replaying a trace: which request arrives when, with which token ids (shared by the simulator
and the real-engine validation run, so both see the very same requests).

Token ids are content: a group's prefix, a Mooncake block or a request's own tokens are pseudo-
random streams seeded by their name, so requests that the trace says share a prefix share exactly
those tokens and nothing else (two different streams agreeing on a whole 16-token page is a
1-in-10^47 event). A session's later turn is built from the previous turn's prompt and the answer
the engine actually produced, and arrives ``think_s`` after that answer: sessions are closed loops,
as agents are, so a slow engine also delays the turns that follow.
"""

from __future__ import annotations

import dataclasses
import hashlib
import heapq
from typing import Callable, NamedTuple, Sequence

import numpy as np

from jaxserve.sampling_params import SamplingParams
from jaxserve.sim.trace import TraceRecord


class Arrival(NamedTuple):
    rid: str
    t: float
    prompt: list[int]
    sampling: SamplingParams
    record: TraceRecord


def token_stream(name: str, n: int, token_range: tuple[int, int]) -> list[int]:
    """``n`` pseudo-random ids in [lo, hi) determined by ``name`` (a prefix of a longer stream of
    the same name is the shorter stream)."""
    seed = int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "little")
    return np.random.default_rng(seed).integers(*token_range, size=n).tolist() if n > 0 else []


class Replay:
    """Arrivals in time order. ``due(now)`` hands out those with ``t <= now``; ``finish`` tells it a
    request's answer (a session's next turn is then scheduled). ``scale`` multiplies the load: first
    arrivals happen at ``t / scale`` (think times are the users' and stay as they are)."""

    def __init__(self, records: Sequence[TraceRecord], token_range: tuple[int, int] = (10, 1000), scale: float = 1.0):
        if scale <= 0:
            raise ValueError(f"load scale must be > 0, got {scale}")
        lo, hi = token_range
        if not 0 <= lo < hi:
            raise ValueError(f"token range must satisfy 0 <= low < high, got {token_range}")
        self.token_range = token_range
        self._heap: list[tuple[float, int, TraceRecord, list[int] | None]] = []
        self._later: dict[str, list[tuple[int, TraceRecord]]] = {}
        self._session_of: dict[str, tuple[str, list[int]]] = {}  # rid -> (session, prompt)
        self._groups: dict[str, list[int]] = {}
        self.total = len(records)
        for i, r in enumerate(records):
            if r.turn == 0:
                self._heap.append((r.t / scale, i, r, None))
            else:
                self._later.setdefault(r.session, []).append((i, r))
        for turns in self._later.values():
            turns.sort(key=lambda x: -x[1].turn)  # pop() gives the next turn
        heapq.heapify(self._heap)

    def next_time(self) -> float | None:
        return self._heap[0][0] if self._heap else None

    def due(self, now: float) -> list[Arrival]:
        out = []
        while self._heap and self._heap[0][0] <= now:
            t, i, rec, context = heapq.heappop(self._heap)
            rid = f"r{i}"
            prompt = self._prompt(rid, rec, context)
            if rec.session is not None:
                self._session_of[rid] = (rec.session, prompt)
            out.append(Arrival(rid, t, prompt, SamplingParams(max_tokens=rec.output_len, ignore_eos=True,
                                                             priority=rec.priority, tenant=rec.tenant), rec))
        return out

    def finish(self, rid: str, output_ids: Sequence[int] | None, now: float) -> None:
        """``rid`` finished at ``now`` with ``output_ids`` (None: it failed or was refused, which ends its session)."""
        session, prompt = self._session_of.pop(rid, (None, None))
        turns = self._later.get(session)
        if not turns:
            return
        if output_ids is None:
            del self._later[session]
            return
        i, rec = turns.pop()
        heapq.heappush(self._heap, (now + rec.think_s, i, rec, prompt + list(output_ids)))

    def _prompt(self, rid: str, rec: TraceRecord, context: list[int] | None) -> list[int]:
        if context is not None:  # a later turn: the conversation minus the edited tail, plus new tokens
            kept = context[:max(0, len(context) - rec.edit)]
            return kept + token_stream(rid, max(rec.input_len, 0 if kept else 1), self.token_range)
        if rec.group is not None:
            head = self._group(rec.group, rec.group_len)
        else:
            head = [t for h in rec.hash_ids for t in token_stream(f"block-{h}", rec.block_size, self.token_range)]
        head = head[:rec.input_len]
        return head + token_stream(rid, rec.input_len - len(head), self.token_range)

    def _group(self, name: str, n: int) -> list[int]:
        stream = self._groups.get(name)
        if stream is None or len(stream) < n:
            stream = self._groups[name] = token_stream(f"group-{name}", n, self.token_range)
        return stream[:n]


@dataclasses.dataclass
class RequestRecord:
    """One request's life in virtual seconds (None: did not happen)."""

    rid: str
    arrival: float
    prompt_len: int
    output_len: int
    tenant: str = ""
    priority: int = 0
    session: str | None = None
    first_token: float | None = None
    finish: float | None = None
    output_tokens: int = 0
    cached_tokens: int = 0
    preemptions: int = 0
    error: str | None = None

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.arrival

    @property
    def e2e(self) -> float | None:
        return None if self.finish is None else self.finish - self.arrival

    @property
    def tpot(self) -> float | None:
        if self.finish is None or self.first_token is None or self.output_tokens < 2:
            return None
        return (self.finish - self.first_token) / (self.output_tokens - 1)


def drive_trace(engine, replay: Replay, now: Callable[[], float], wait_until: Callable[[float], None],
                after_step: Callable[[], None] = lambda: None) -> list[RequestRecord]:
    """Feed ``replay``'s arrivals to ``engine`` and step it until both are done; ``now()`` is the
    clock (virtual or wall), ``wait_until(t)`` idles until ``t``. Returns every request's record in
    arrival order; a request the engine refuses (``ValueError``) is recorded with its error."""
    recs: dict[str, RequestRecord] = {}
    live = {}
    while True:
        for a in replay.due(now()):
            rec = recs[a.rid] = RequestRecord(a.rid, a.t, len(a.prompt), a.record.output_len, a.record.tenant,
                                              a.record.priority, a.record.session)
            try:
                engine.add_request(a.prompt, a.sampling, request_id=a.rid)
            except ValueError as e:
                rec.error = str(e)
                replay.finish(a.rid, None, now())
                continue
            live[a.rid] = engine.requests[a.rid]
        if not engine.has_work():
            nxt = replay.next_time()
            if nxt is None:
                break
            wait_until(nxt)
            continue
        outs = engine.step()
        t = now()
        for out in outs:
            rec = recs[out.request_id]
            if rec.first_token is None:
                rec.first_token = t
            if out.finished:
                rec.finish, rec.output_tokens, rec.cached_tokens = t, len(out.output_ids), out.cached_tokens
                rec.preemptions = live.pop(out.request_id).num_preemptions
                replay.finish(out.request_id, out.output_ids, t)
        after_step()
    return sorted(recs.values(), key=lambda r: (r.arrival, int(r.rid[1:])))
