"""``jaxserve sim``: the real ``Engine``, ``Scheduler`` and ``HybridRadixCache`` against a virtual
clock, with a step cost model (cost.py) standing in for the device.

Only the executor is simulated (``SimExecutor``, the ``Executor`` protocol of engine.py): a step
dispatched at virtual time ``now`` starts when the device is free, takes ``CostModel.step_time``
of its rows and delivers its tokens when it ends. Everything else — admission, chunking, prefix
matching, snapshot donation, eviction, preemption, the overlapped loop — is the code that serves
requests, so a policy measured here is the policy that runs. Arrivals come from ``Replay``
(replay.py): a request that arrives while a step runs is seen when the scheduler next plans, as
it would be by the real engine.

Sampled tokens are a deterministic function of (request, output index), never an end-of-sequence
(requests use ``ignore_eos``), so every request produces its trace's ``output_len`` tokens and a
session's next turn extends the answer this run produced.
"""

from __future__ import annotations

import dataclasses
import time
import zlib
from typing import Any, Sequence

from jaxserve.cache.allocator import PageAllocator, SlotAllocator
from jaxserve.cache.radix import HybridRadixCache
from jaxserve.config import SNAPSHOT_INTERVAL
from jaxserve.engine.engine import Engine
from jaxserve.engine.policy import Policy, make_policy
from jaxserve.engine.scheduler import Scheduler, StepPlan
from jaxserve.sim.cost import CostModel
from jaxserve.sim.replay import Replay, RequestRecord, drive_trace
from jaxserve.sim.trace import TraceRecord


@dataclasses.dataclass(frozen=True)
class SimConfig:
    """The simulated engine. Counts are usable pages / slots (the null entries excluded)."""

    page_size: int = 16
    num_pages: int = 8192
    num_slots: int = 256
    max_prefill_tokens: int = 8192
    max_running: int = 64
    max_model_len: int = 32768
    hybrid: bool = True
    snapshot_interval: int = SNAPSHOT_INTERVAL
    max_snapshots_per_path: int | None = None
    overlap: bool = True

    def __post_init__(self):
        for name in ("page_size", "num_pages", "max_prefill_tokens", "max_running", "max_model_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.snapshot_interval < SNAPSHOT_INTERVAL or self.snapshot_interval % SNAPSHOT_INTERVAL:
            raise ValueError(f"snapshot_interval must be a multiple of {SNAPSHOT_INTERVAL}, got {self.snapshot_interval}")
        if self.hybrid and self.num_slots < 1:
            raise ValueError(f"a hybrid engine needs num_slots >= 1, got {self.num_slots}")

    @classmethod
    def from_engine(cls, engine: dict[str, Any], **overrides) -> SimConfig:
        """The configuration a cost model was measured with (``CostModel.engine``), then ``overrides``
        (None values ignored)."""
        names = {f.name for f in dataclasses.fields(cls)}
        kw = {k: v for k, v in engine.items() if k in names}
        kw.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**kw)


class VirtualClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class SimExecutor:
    """The ``Executor`` protocol on a virtual clock: steps run back to back on one device."""

    def __init__(self, cost: CostModel, clock: VirtualClock, token_range: tuple[int, int]):
        self.cost, self.clock = cost, clock
        self.lo, self.span = token_range[0], token_range[1] - token_range[0]
        self.free_at = 0.0
        self.steps = 0
        self.busy_s = 0.0
        self.snapshots_written = 0  # linear-state snapshots the steps wrote (the cache's state traffic)
        self._seeds: dict[str, int] = {}  # rid -> crc32 of it, the token stream's seed

    def dispatch(self, plan: StepPlan):
        start = max(self.clock.now, self.free_at)
        dt = self.cost.step_time(plan.rows)
        self.free_at = start + dt
        self.steps += 1
        self.busy_s += dt
        self.snapshots_written += sum(len(row.snapshots) for row in plan.rows)
        tokens = [self.lo + (self._seed(row.req.rid) + 7919 * row.sample_idx) % self.span for row in plan.rows]
        return self.free_at, tokens

    def _seed(self, rid: str) -> int:
        seed = self._seeds.get(rid)
        if seed is None:
            seed = self._seeds[rid] = zlib.crc32(rid.encode())
        return seed

    def fetch(self, handle):
        end, tokens = handle
        self.clock.now = max(self.clock.now, end)
        return tokens, [0.0] * len(tokens)

    def recover(self) -> bool:
        return False

    def barrier(self) -> None:
        pass

    def slot_checksum(self, slot: int) -> int:
        return 0


@dataclasses.dataclass
class Pressure:
    """Pool occupancy after every step (time series) and time-weighted means / maxima."""

    t: list[float] = dataclasses.field(default_factory=list)
    running: list[int] = dataclasses.field(default_factory=list)
    waiting: list[int] = dataclasses.field(default_factory=list)
    pages_used: list[float] = dataclasses.field(default_factory=list)    # share of the page pool held
    tree_pages: list[float] = dataclasses.field(default_factory=list)    # share held by the prefix cache
    slots_used: list[float] = dataclasses.field(default_factory=list)    # share of the slot pool held
    tree_slots: list[float] = dataclasses.field(default_factory=list)    # share held as snapshots

    def sample(self, now: float, sched: Scheduler) -> None:
        pages, slots, cache = sched.pages, sched.slots, sched.cache
        self.t.append(now)
        self.running.append(len(sched.running))
        self.waiting.append(len(sched.waiting))
        self.pages_used.append(1 - pages.num_free / pages.capacity)
        self.tree_pages.append(cache.num_tree_pages / pages.capacity)
        self.slots_used.append(0.0 if slots is None else 1 - slots.num_free / slots.capacity)
        self.tree_slots.append(0.0 if slots is None else cache.num_snapshots / slots.capacity)

    def summary(self) -> dict[str, dict[str, float]]:
        out = {}
        span = self.t[-1] - self.t[0] if len(self.t) > 1 else 0.0
        for name in ("running", "waiting", "pages_used", "tree_pages", "slots_used", "tree_slots"):
            xs = getattr(self, name)
            if not xs:
                continue
            if span > 0:  # each sample holds until the next one
                mean = sum(x * (b - a) for x, a, b in zip(xs, self.t, self.t[1:])) / span
            else:
                mean = sum(xs) / len(xs)
            out[name] = {"mean": mean, "max": max(xs)}
        return out


@dataclasses.dataclass
class SimResult:
    requests: list[RequestRecord]
    pressure: Pressure
    duration_s: float            # virtual: first arrival to last answer
    steps: int
    busy_s: float                # virtual seconds the device computed
    preemptions: int
    cache: dict[str, float]      # HybridRadixCache.metrics() at the end
    wall_s: float                # host seconds the simulation took
    snapshots_written: int = 0   # linear-state snapshots the steps wrote


def build_engine(config: SimConfig, policy: Policy, cost: CostModel, clock: VirtualClock,
                 token_range: tuple[int, int]) -> Engine:
    """The real engine stack on a ``SimExecutor``."""
    pages = PageAllocator(config.num_pages + 1)
    slots = SlotAllocator(config.num_slots + 1) if config.hybrid else None
    cache = HybridRadixCache(pages, slots, config.page_size, snapshot_interval=config.snapshot_interval,
                             hybrid=config.hybrid, max_snapshots_per_path=config.max_snapshots_per_path)
    sched = Scheduler(pages=pages, slots=slots, cache=cache, page_size=config.page_size,
                      max_prefill_tokens=config.max_prefill_tokens, max_running=config.max_running,
                      max_pages_per_seq=-(-config.max_model_len // config.page_size), policy=policy,
                      snapshot_interval=config.snapshot_interval, clock=clock)
    return Engine(sched, SimExecutor(cost, clock, token_range), vocab_size=token_range[1], overlap=config.overlap,
                  output_history=False)  # drive_trace reads only finished outputs


def simulate(records: Sequence[TraceRecord], policy: Policy | str, cost: CostModel, config: SimConfig, *,
             scale: float = 1.0, token_range: tuple[int, int] = (10, 1000), check_invariants: int = 0) -> SimResult:
    """Replay ``records`` through the engine on virtual time. ``scale`` multiplies the arrival rate.
    A request the engine refuses (too long for the context or the pools) is recorded with its error.
    ``check_invariants``: run the engine's leak and cache invariant check (ARCHITECTURE.md invariant 7)
    after every N-th engine step (True: every step, as the tests do; 0: never, the default): it walks
    every page, slot and tree node, so it costs O(pool size) per call."""
    wall0 = time.perf_counter()
    policy = make_policy(policy) if isinstance(policy, str) else policy
    clock = VirtualClock()
    engine = build_engine(config, policy, cost, clock, token_range)
    sched, executor = engine.scheduler, engine.executor
    pressure = Pressure()

    def wait_until(t: float) -> None:
        clock.now = max(clock.now, t)

    steps = 0

    def after_step() -> None:
        nonlocal steps
        steps += 1
        pressure.sample(clock.now, sched)
        if check_invariants and steps % check_invariants == 0:
            engine.check_invariants()

    requests = drive_trace(engine, Replay(records, token_range, scale), clock, wait_until, after_step)
    start = min((r.arrival for r in requests), default=0.0)
    end = max((r.finish for r in requests if r.finish is not None), default=start)
    return SimResult(requests, pressure, end - start, executor.steps, executor.busy_s, sched.num_preemptions,
                     sched.cache.metrics(), time.perf_counter() - wall0, executor.snapshots_written)
