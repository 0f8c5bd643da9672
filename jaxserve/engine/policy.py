"""Scheduling policies: which waiting request to admit next.

A policy only orders the waiting queue; the scheduler owns admission, budgets and preemption.
Research code plugs in its own by subclassing ``Policy`` (or passing any object with ``order``).
"""

from __future__ import annotations

from typing import Callable, Protocol, Sequence

from jaxserve.engine.request import Request


class Policy(Protocol):
    name: str

    def order(self, waiting: Sequence[Request], prefix_len: Callable[[Request], int]) -> list[Request]:
        """Return the waiting requests in admission order. ``prefix_len(req)`` is the length the
        prefix cache would serve for it right now (cheap; no side effects that matter)."""
        ...


class FCFS:
    """First come, first served (arrival order; a preempted request keeps its place)."""

    name = "fcfs"

    def order(self, waiting, prefix_len):
        return sorted(waiting, key=lambda r: r.arrival)


class LongestPrefixMatch:
    """Longest cached prefix first (SGLang's `lpm`): admits requests whose prefix is cached while it
    still is, which raises the hit rate under memory pressure; ties in arrival order."""

    name = "lpm"

    def order(self, waiting, prefix_len):
        return sorted(waiting, key=lambda r: (-prefix_len(r), r.arrival))


POLICIES: dict[str, type] = {"fcfs": FCFS, "lpm": LongestPrefixMatch}


def make_policy(name: str) -> Policy:
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown scheduling policy {name!r}; have {sorted(POLICIES)}") from None
