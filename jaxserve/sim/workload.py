"""Workload generators: arrival processes and request shapes, each returning trace records
(trace.py), deterministic in the seed. ``jaxserve sim gen`` writes them as JSONL.

Arrivals: ``poisson`` (exponential gaps) and ``gamma`` (gaps with a coefficient of variation
``cv``: cv > 1 is bursty, as production traces such as BurstGPT are; cv = 1 is Poisson).
Shapes: ``shared_prompts`` (a few system prompts, popularity skewed by ``zipf``), ``agent_sessions``
(multi-turn sessions whose context grows and whose tool outputs edit the tail), ``doc_qa`` (long
documents, short questions), ``tenants`` (a quiet and a noisy API key: the fair-share case).
"""

from __future__ import annotations

import random

from jaxserve.bench.workload import draw_len
from jaxserve.sim.trace import TraceRecord


def arrivals(n: int, rate: float, seed: int, cv: float = 1.0) -> list[float]:
    """``n`` arrival times (s) at mean ``rate`` per second, the first at 0; gamma gaps of
    coefficient of variation ``cv`` (1: Poisson)."""
    if rate <= 0 or cv <= 0:
        raise ValueError(f"rate ({rate}) and cv ({cv}) must be > 0")
    rng, t, out = random.Random(f"arrivals-{seed}"), 0.0, []
    shape = 1 / cv**2
    for _ in range(n):
        out.append(t)
        t += rng.gammavariate(shape, 1 / (rate * shape))
    return out


def _zipf_choice(rng: random.Random, n: int, s: float) -> int:
    return rng.choices(range(n), weights=[1 / (i + 1) ** s for i in range(n)])[0]


def shared_prompts(n: int = 1000, rate: float = 10.0, *, groups: int = 8, group_len: int = 1024,
                   input_len: int = 256, output_len: int = 128, range_ratio: float = 0.5, zipf: float = 1.0,
                   cv: float = 1.0, seed: int = 0, group_name: str = "sys") -> list[TraceRecord]:
    """Chat traffic: each prompt is one of ``groups`` shared prefixes (chosen with Zipf skew
    ``zipf``, 0 = uniform) followed by ``input_len`` tokens of its own."""
    rng = random.Random(seed)
    out = []
    for t in arrivals(n, rate, seed, cv):
        g = _zipf_choice(rng, groups, zipf)
        tail = draw_len(rng, input_len, range_ratio)
        out.append(TraceRecord(t=t, input_len=group_len + tail, output_len=draw_len(rng, output_len, range_ratio),
                               group=f"{group_name}-{g}", group_len=group_len))
    return out


def doc_qa(n: int = 500, rate: float = 2.0, *, docs: int = 20, doc_len: int = 6000, question_len: int = 64,
           output_len: int = 128, zipf: float = 0.8, cv: float = 1.0, seed: int = 0) -> list[TraceRecord]:
    """Long-document QA: a few long documents (the shared prefixes), short questions about them."""
    return shared_prompts(n, rate, groups=docs, group_len=doc_len, input_len=question_len, output_len=output_len,
                          zipf=zipf, cv=cv, seed=seed, group_name="doc")


def agent_sessions(sessions: int = 100, rate: float = 1.0, *, turns: int = 8, system_len: int = 1024,
                   first_len: int = 512, tool_len: int = 256, output_len: int = 96, edit: int = 64,
                   think_s: float = 1.0, range_ratio: float = 0.5, cv: float = 1.0, seed: int = 0) -> list[TraceRecord]:
    """Agent sessions starting at ``rate`` per second: turn 0 is a shared system prompt plus a task;
    each later turn drops the last ``edit`` tokens of the context (the tool output gets rewritten)
    and appends a tool output of about ``tool_len`` tokens, ``think_s`` after the previous answer."""
    rng = random.Random(seed)
    out = []
    for s, t in enumerate(arrivals(sessions, rate, seed, cv)):
        sid = f"agent-{seed}-{s}"
        out.append(TraceRecord(t=t, input_len=system_len + draw_len(rng, first_len, range_ratio),
                               output_len=draw_len(rng, output_len, range_ratio), group="agent-system",
                               group_len=system_len, session=sid))
        for k in range(1, turns):
            out.append(TraceRecord(t=t, input_len=draw_len(rng, tool_len, range_ratio),
                                   output_len=draw_len(rng, output_len, range_ratio), session=sid, turn=k,
                                   think_s=think_s, edit=edit))
    return out


def tenants(n: int = 600, rate: float = 20.0, *, noisy_share: float = 0.9, input_len: int = 512,
            output_len: int = 128, range_ratio: float = 0.5, cv: float = 2.0, seed: int = 0) -> list[TraceRecord]:
    """Two API keys on bursty arrivals: ``noisy`` sends ``noisy_share`` of the requests."""
    rng = random.Random(seed)
    return [TraceRecord(t=t, input_len=draw_len(rng, input_len, range_ratio),
                        output_len=draw_len(rng, output_len, range_ratio),
                        tenant="noisy" if rng.random() < noisy_share else "quiet")
            for t in arrivals(n, rate, seed, cv)]


WORKLOADS = {"shared-prompts": shared_prompts, "doc-qa": doc_qa, "agent-sessions": agent_sessions, "tenants": tenants}
