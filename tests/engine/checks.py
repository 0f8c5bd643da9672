"""Checks shared by the engine tests: drive an engine with the invariant battery after every step,
and the end-of-test leak check (invariant 7)."""

from __future__ import annotations


def drive(engine, abort_at=None, max_steps=5000) -> dict:
    """Step until idle, checking invariants after every step; abort ``abort_at[step]`` ids midway.
    Returns the final output of every request that finished."""
    outs = {}
    for i in range(max_steps):
        if not engine.has_work():
            return outs
        for o in engine.step():
            if o.finished:
                outs[o.request_id] = o
        engine.check_invariants()
        for rid in (abort_at or {}).get(i, ()):
            assert engine.abort(rid)
    raise AssertionError("engine did not drain")


def assert_pools_free_after_flush(engine) -> None:
    """Once the tree is flushed, every page and slot is free again: nothing leaked."""
    s = engine.scheduler
    s.cache.flush()
    engine.check_invariants()
    assert s.pages.num_free == s.pages.capacity
    if s.slots is not None:
        assert s.slots.num_free == s.slots.capacity
