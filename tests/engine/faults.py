"""A scheduler that corrupts every prefix-cache hit on purpose, to prove the checks can fail.

``tests/test_probe.py`` serves with it and expects ``jaxserve probe`` to report hit-vs-cold
mismatches and exit 1; ``tests/engine/test_scheduler.py`` checks on the fake device that each fault
really changes a hit's tokens. The production ``Scheduler`` knows nothing of it.

Faults (applied where a hit is admitted, before its first row is planned):

- ``stale-snapshot``: skip the restore, so the request starts from whatever its own slot last held;
- ``wrong-snapshot``: restore another tree snapshot, one pinned by a running request (pinned, so it
  cannot be evicted and rewritten during this step); with none pinned it falls back to stale.
"""

from __future__ import annotations

from jaxserve.engine.request import Request
from jaxserve.engine.scheduler import Scheduler

FAULTS = ("stale-snapshot", "wrong-snapshot")


class FaultyScheduler(Scheduler):
    fault: str = FAULTS[0]

    @classmethod
    def corrupt(cls, scheduler: Scheduler, fault: str) -> None:
        """Turn an already wired scheduler (``build_engine``'s, with its engine's hooks set) into
        one that corrupts every hit with ``fault``. Same state, one overridden method."""
        if fault not in FAULTS:
            raise ValueError(f"fault must be one of {FAULTS}, got {fault!r}")
        scheduler.__class__ = cls
        scheduler.fault = fault

    def _admit(self, req: Request, budget: int) -> int:
        n = super()._admit(req, budget)
        if n and req.restore_src:  # admitted on a hit: its first row would restore from restore_src
            req.restore_src = self._corrupted_source(req)
        return n

    def _corrupted_source(self, req: Request) -> int:
        if self.fault == "wrong-snapshot":
            pinned = sorted({r.locked.snapshot for r in self.running if r.locked is not None}
                            - {None, req.restore_src})
            if pinned:
                return pinned[0]
        return 0
