"""Start-up, between loading the weights and serving: a memory plan from the compiled step programs,
every step program compiled before the first request, and JAX's persistent compilation cache.

Memory (``plan_memory``). A step needs, beside the params and the donated pools it updates in
place, XLA's temporaries (activations, workspace), its non-donated outputs and the batch it is
given. Those depend on the step's shape only, and XLA reports them exactly for a compiled program
(``Compiled.memory_analysis()``), so the engine compiles the largest prefill step before it sizes
the pools and reserves ``with_margin`` of what it needs (``plan_pools(reserve_bytes=...)``). The
probe is compiled against the largest pools the budget could give (the plan without a reserve):
the pools are arguments, and a step that copied a pool instead of updating it in place would show
that copy at its largest. When even the smallest pools do not fit beside the largest step, the
prefill token budget drops to the largest token bucket that fits (one log line says so), or start-up
fails with one line saying what does not fit.

Compiling (``StepCompiler``, ``compile_programs``). Every program a server can run is
``Buckets.programs()`` (the model) and ``Buckets.sample_programs()`` (the sampler that follows it,
per row count and mode: tiny). They are compiled ahead of time (``runner.lower_step`` and
``runner.lower_sample`` lower each exactly as ``runner.step`` calls it, so the executables land in
the cache that serving then hits) before the pools are allocated (so XLA's autotuning has the
memory the pools will take), then ``runner.warmup`` runs them once on the real pools (all of them
where a reserve was measured, so the largest steps run for real before the port opens; on a CPU
the smallest of each kind): a step or sampler compile during it would mean the ahead-of-time keys
missed (counted, and logged). The probe's executable (compiled against the probe pools) is the one
program compiled twice when the pools come from a budget; with explicit pool sizes it is reused.

Cache (``enable_compile_cache``). JAX's persistent compilation cache keeps executables on disk
(default ``~/.cache/jaxserve/xla``; ``JAXSERVE_COMPILE_CACHE=DIR`` or ``off``), so a second start
of the same model and limits loads its programs instead of compiling them. Beside it the program
store (``program_store.py``, ``<cache>-programs``) keeps the compiled programs themselves: a restart
loads those without tracing or lowering anything (one device; a mesh uses the cache alone).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os
import sys
import threading
import time
from functools import partial
from pathlib import Path
from typing import Callable, Sequence

import jax
import numpy as np

from jaxserve import sampler
from jaxserve.config import ModelConfig
from jaxserve.engine import runner
from jaxserve.engine.pools import PoolPlan, minimal_pool_bytes, plan_pools
from jaxserve.engine.program_store import ProgramStore, describe_args
from jaxserve.engine.runner import Buckets
from jaxserve.models.decoder import Pools, pool_shapes

MiB, GiB = 1 << 20, 1 << 30
# The reserve is the probe's need plus 10 % and 256 MiB: room for the allocator's fragmentation when
# programs of different sizes alternate, the next step's host-to-device batch arriving while one runs,
# and library workspaces XLA does not count. Memory outside the budget (1 - mem_fraction) is not
# counted on: the runtime itself (CUDA context, autotuning) lives there.
MARGIN_FRACTION = 0.10
MARGIN_BYTES = 256 * MiB
DEFAULT_COMPILE_CACHE = Path("~/.cache/jaxserve/xla")
COMPILE_CACHE_ENV = "JAXSERVE_COMPILE_CACHE"
_OFF = ("", "0", "off", "false", "no", "none")


def fmt_bytes(n: float) -> str:
    return f"{n / GiB:.2f} GiB" if abs(n) >= GiB else f"{n / MiB:.1f} MiB"


def with_margin(need: int) -> int:
    """The reserve for a step that needs ``need`` bytes beside params and pools."""
    return int(need * (1 + MARGIN_FRACTION)) + MARGIN_BYTES


# ------------------------------------------------------------------------------------------ events


class _CompileEvents:
    """Process-wide counts of XLA backend compiles (a persistent-cache load counts too: it is what
    a request would wait for), of those of the serving step and of its sampler, and of
    persistent-cache hits (all, and the serving step's), from ``jax.monitoring``.

    A cache hit is told to the listeners, in the compiling thread, before that compile's duration
    event, which names the function: a thread-local flag pairs the two."""

    def __init__(self):
        self.compiles = 0
        self.step_compiles = 0
        self.sample_compiles = 0
        self.cache_hits = 0
        self.step_cache_hits = 0
        self._lock = threading.Lock()
        self._hit = threading.local()
        jax.monitoring.register_event_duration_secs_listener(self._on_duration)
        jax.monitoring.register_event_listener(self._on_event)

    def _on_duration(self, event: str, duration: float, fun_name: str = "", **_) -> None:
        if event == "/jax/core/compile/backend_compile_duration":
            hit, self._hit.value = getattr(self._hit, "value", False), False
            step = fun_name == f"jit({runner._step.__name__})"
            with self._lock:
                self.compiles += 1
                self.step_compiles += step
                self.sample_compiles += fun_name == f"jit({sampler.sample_rows.__name__})"
                self.step_cache_hits += step and hit

    def _on_event(self, event: str, **_) -> None:
        if event == "/jax/compilation_cache/cache_hits":
            self._hit.value = True
            with self._lock:
                self.cache_hits += 1


_events = _CompileEvents()


def backend_compiles() -> int:
    """XLA executables built (compiled or loaded from the persistent cache) in this process so far."""
    return _events.compiles


def step_compiles() -> int:
    """Of ``backend_compiles()``, those of the serving step (``runner._step``)."""
    return _events.step_compiles


def sample_compiles() -> int:
    """Of ``backend_compiles()``, those of the step's sampler (``sampler.sample_rows``)."""
    return _events.sample_compiles


def step_cache_hits() -> int:
    """Of ``cache_hits()``, the serving step's."""
    return _events.step_cache_hits


def cache_hits() -> int:
    """Executables loaded from the persistent compilation cache in this process so far."""
    return _events.cache_hits


# ------------------------------------------------------------------------------------------ cache


def compile_cache_dir(setting: str | bool | None = True) -> Path | None:
    """The cache directory ``setting`` asks for: a path; ``False`` (off); ``True`` / ``None``:
    ``$JAXSERVE_COMPILE_CACHE`` (a path, or ``off``) else ``~/.cache/jaxserve/xla``."""
    if setting is False:
        return None
    if isinstance(setting, str):
        return None if setting.strip().lower() in _OFF else Path(setting).expanduser()
    env = os.environ.get(COMPILE_CACHE_ENV)
    if env is not None:
        return None if env.strip().lower() in _OFF else Path(env).expanduser()
    return DEFAULT_COMPILE_CACHE.expanduser()


def enable_compile_cache(setting: str | bool | None = True) -> Path | None:
    """Point JAX's persistent compilation cache at ``compile_cache_dir(setting)`` and make it keep
    every step program (any compile time of 0.1 s or more, any size). Returns the directory, or
    None when off (also when ``jax_enable_compilation_cache`` is false, as in the tests).

    JAX opens its cache once per process, at the first compile after a directory is set: a later
    call with another directory does not move it."""
    path = compile_cache_dir(setting)
    if path is None or not jax.config.jax_enable_compilation_cache:
        return None
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.1)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    return path


# ------------------------------------------------------------------------------------------ compiling


@dataclasses.dataclass(frozen=True)
class StepMemory:
    """What one compiled step program needs beside the params and the pools it updates in place."""

    program: tuple[int, int, int, bool]  # (T, B, S, decode)
    temp_bytes: int   # XLA temporaries
    need_bytes: int   # temp + outputs not aliased to donated inputs + inputs that are neither params nor pools
    seconds: float    # lowering + compiling (or loading from the persistent cache)

    def describe(self) -> str:
        T, B, S, decode = self.program
        kind = f"{B}-row decode step" if decode else f"{T}-token step"
        return f"the {kind} (S={S}) needs {fmt_bytes(self.need_bytes)}"


def step_memory(compiled: jax.stages.Compiled, program, param_bytes: int, pool_bytes: int,
                seconds: float) -> StepMemory | None:
    """``StepMemory`` from XLA's memory analysis of ``compiled``; None where the backend has none."""
    stats = compiled.memory_analysis()
    if stats is None:
        return None
    temp = int(stats.temp_size_in_bytes)
    outputs = max(int(stats.output_size_in_bytes) - int(stats.alias_size_in_bytes), 0)
    inputs = max(int(stats.argument_size_in_bytes) - param_bytes - pool_bytes, 0)
    return StepMemory(tuple(program), temp, temp + outputs + inputs, seconds)


def _nbytes(tree, shardings=None) -> int:
    """Bytes of ``tree``'s arrays; with ``shardings`` (a matching pytree), one device's share."""
    leaves = jax.tree.leaves(tree)
    shapes = [x.shape for x in leaves] if shardings is None else [
        s.shard_shape(x.shape) for x, s in zip(leaves, jax.tree.leaves(shardings))]
    return sum(int(np.prod(shape)) * np.dtype(x.dtype).itemsize for x, shape in zip(leaves, shapes))


class StepCompiler:
    """Ahead-of-time compiles of one model's step programs (``runner.lower_step``) and of the
    sampler programs that follow them (``runner.lower_sample``). Under a
    ``placement`` (a model split over a mesh) every byte count is one device's: XLA's memory
    analysis of a sharded program is per device, and so are the budget and the plan.

    With a ``store`` (``program_store.ProgramStore``; one device only) each program is first looked
    up there and, when compiled, saved there: a restart loads it without tracing or lowering.
    ``keep`` (``runner.Executables``), when given to ``compile`` / ``compile_sample``, receives the
    executable: the serving step then calls it directly."""

    def __init__(self, params, cfg: ModelConfig, buckets: Buckets, placement: runner.Placement | None = None,
                 store: ProgramStore | None = None):
        self.params, self.cfg, self.buckets = runner._abstract(params), cfg, buckets
        self.placement = placement
        self.store = store if placement is None else None
        self.param_bytes = _nbytes(params, None if placement is None else placement.params)

    def _describe(self, kind: str, program, pools: Pools | None = None) -> str:
        """The program's part of its store key: everything its lowering reads beside the code."""
        text = (f"{kind} {program!r}\n{self.cfg!r}\npages_per_seq={self.buckets.pages_per_seq} "
                f"feed={self.buckets.seqs[-1]}\n{describe_args(self.params)}")
        return text if pools is None else f"{text}\n{describe_args(pools)}"

    def executable(self, program, pools: Pools) -> jax.stages.Compiled:
        """The step program ``program`` for pools of ``pools``' shapes (arrays or ``ShapeDtypeStruct``s)."""
        def lower():
            return runner.lower_step(self.params, self.cfg, pools, self.buckets, program, self.placement)
        if self.store is None:
            return lower().compile()
        return self.store.get_or_compile(self._describe("step", program, pools), lower)

    def compile(self, program, pools: Pools, keep: runner.Executables | None = None) -> StepMemory | None:
        """Compile (or load) ``program`` against pools of ``pools``' shapes; its memory need."""
        t0 = time.perf_counter()
        compiled = self.executable(program, pools)
        if keep is not None:
            keep.step[program] = compiled
        pool_bytes = _nbytes(pools, None if self.placement is None else self.placement.pools)
        return step_memory(compiled, program, self.param_bytes, pool_bytes, time.perf_counter() - t0)

    def compile_sample(self, program: tuple[int, str], keep: runner.Executables | None = None) -> None:
        """Compile (or load) the sampler program ``program`` = (B, mode) (``Buckets.sample_programs()``)."""
        def lower():
            return runner.lower_sample(self.cfg, self.buckets, program, self.placement)
        compiled = (lower().compile() if self.store is None else
                    self.store.get_or_compile(self._describe("sample", program), lower))
        if keep is not None:
            keep.sample[program] = compiled


def default_compile_workers() -> int:
    """Step programs compiled at once when the user does not say: half the CPU cores, at most 8.
    XLA's compile of one program (its LLVM and ptxas passes) runs outside the GIL on one core, and
    a real-size model's 19 programs took ~40 s each one at a time on the H100 machine (13 minutes
    to ready); lowering stays serial under the GIL. Half the cores leaves room for the server's
    threads; a 2-core machine compiles one at a time, as before."""
    return max(1, min(8, (os.cpu_count() or 2) // 2))


def compile_programs(compiler: StepCompiler, pools: Pools, programs: Sequence, *, samples: Sequence = (),
                     workers: int = 1, progress: bool = True,
                     keep: runner.Executables | None = None) -> list[StepMemory | None]:
    """Compile every step program of ``programs`` against ``pools``' shapes, then every sampler
    program of ``samples`` (``Buckets.sample_programs()``), ``workers`` at a time (XLA compiles
    outside the GIL), with one progress bar on stderr over both. Returns the step programs' memory,
    in order; ``keep`` receives every executable."""
    from tqdm import tqdm

    desc = f"compiling {len(programs)} step programs" + (f" and {len(samples)} sampler programs" if samples else "")
    with tqdm(total=len(programs) + len(samples), desc=desc, unit="program", file=sys.stderr,
              disable=not progress, leave=True) as bar:
        def one(compile_one, program):
            out = compile_one(program)
            bar.update(1)
            return out

        def each(compile_one, items) -> list:
            if workers <= 1:
                return [one(compile_one, p) for p in items]
            with concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="jaxserve-compile") as ex:
                return list(ex.map(partial(one, compile_one), items))

        mems = each(lambda program: compiler.compile(program, pools, keep), programs)
        each(lambda program: compiler.compile_sample(program, keep), samples)
        return mems


# ------------------------------------------------------------------------------------------ memory


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    pools: PoolPlan
    buckets: Buckets          # tokens capped where the prefill budget had to drop
    reserve_bytes: int        # passed to plan_pools; 0 without a budget
    probe: StepMemory | None  # the measured step the reserve covers
    note: str                 # why this reserve, for the start-up line


@dataclasses.dataclass(frozen=True)
class PoolLimits:
    """What ``plan_pools`` needs beside the budget and the reserve."""

    page_size: int
    max_seqs: int
    num_pages: int | None = None
    num_slots: int | None = None
    snapshot_fraction: float = 0.25


def _mixed(buckets: Buckets, T: int) -> tuple[int, int, int, bool]:
    return T, buckets.rows_for(T), buckets.snapshot_sizes(T, False)[-1], False


def plan_memory(cfg: ModelConfig, dtype, buckets: Buckets, limits: PoolLimits, *, budget: int | None,
                param_bytes: int, measure: Callable[[tuple, PoolPlan], StepMemory | None] | None,
                log: Callable[[str], None] = lambda msg: None,
                between_steps: tuple[str, int] | None = None) -> MemoryPlan:
    """Pools and prefill buckets such that params + pools + the largest prefill step's needs (with
    ``with_margin``) fit ``budget``.

    ``measure(program, plan)`` compiles a step program against pools of ``plan``'s shapes and
    returns its ``StepMemory``. Without ``measure`` or a budget nothing is measured and nothing
    reserved (the pools come from the budget, if any, or the explicit sizes).

    Otherwise the largest token bucket is measured first, against the pools the budget would give
    without a reserve (with explicit sizes: those pools, so the probe is the serving program). If
    the smallest pools that still hold one full step of it (``min_kv_tokens``; explicit sizes: as
    given) do not fit beside it, smaller buckets are tried, starting from the largest one a need
    proportional to T would allow (a need a + b·T with a >= 0 falls no faster than T going down, so
    none above it can fit), and the prefill budget drops to the first that fits (logged). Raises
    ``ValueError`` when none does.

    ``between_steps`` (what, bytes): a program that runs between steps on the same stream (the
    vision tower), so its need and a step's never add up: the reserve covers the larger of the two."""
    plan_kw = dict(page_size=limits.page_size, max_seqs=limits.max_seqs, num_pages=limits.num_pages,
                   num_slots=limits.num_slots, snapshot_fraction=limits.snapshot_fraction)
    explicit = limits.num_pages is not None and limits.num_slots is not None
    if measure is None or budget is None:
        plan = plan_pools(cfg, dtype, mem_bytes=budget, param_bytes=param_bytes if budget else 0, **plan_kw)
        return MemoryPlan(plan, buckets, 0, None, "no reserve for step temporaries")
    probe_plan = plan_pools(cfg, dtype, mem_bytes=budget, param_bytes=param_bytes, **plan_kw)

    def room(T: int) -> int:
        """Bytes the budget leaves for a step of T tokens beside params and the smallest pools."""
        pools = probe_plan.total_bytes if explicit else minimal_pool_bytes(
            cfg, dtype, page_size=limits.page_size, max_seqs=limits.max_seqs, min_kv_tokens=T)
        return budget - param_bytes - pools

    tokens = buckets.tokens
    T = tokens[-1]
    probe = measure(_mixed(buckets, T), probe_plan)
    if probe is None:
        plan = plan_pools(cfg, dtype, mem_bytes=budget, param_bytes=param_bytes, **plan_kw)
        return MemoryPlan(plan, buckets, 0, None, "no reserve: this backend reports no memory analysis")
    first = probe
    other = between_steps[1] if between_steps else 0
    while with_margin(max(probe.need_bytes, other)) > room(T):
        per_token = first.need_bytes / first.program[0]
        below = [t for t in tokens if t < T]
        if not below:
            tower = f" (and {between_steps[0]} needs {fmt_bytes(other)})" if other > probe.need_bytes else ""
            raise ValueError(
                f"{probe.describe()} of temporaries{tower}, but params ({fmt_bytes(param_bytes)}) and the smallest pools "
                f"leave {fmt_bytes(room(T))} of the {fmt_bytes(budget)} budget (a reserve of "
                f"{fmt_bytes(with_margin(max(probe.need_bytes, other)))} is needed): no prefill bucket fits; use a device with "
                f"more memory, a larger mem_fraction (--mem-fraction), fewer running requests or a smaller "
                f"max_model_len")
        guess = [t for t in below if with_margin(int(per_token * t)) <= room(t)]
        T = guess[-1] if guess else below[0]
        probe = measure(_mixed(buckets, T), probe_plan)
    reserve = with_margin(max(probe.need_bytes, other))
    if T != tokens[-1]:
        log(f"max prefill lowered from {tokens[-1]} to {T} tokens per step: {first.describe()} beside params "
            f"({fmt_bytes(param_bytes)}) and the smallest pools, more than the {fmt_bytes(budget)} budget allows; "
            f"{probe.describe()}")
        buckets = buckets.with_max_tokens(T)
    plan = plan_pools(cfg, dtype, mem_bytes=budget, param_bytes=param_bytes, reserve_bytes=reserve,
                      min_kv_tokens=0 if explicit else T, **plan_kw)
    needs = probe.describe() + (f"; {between_steps[0]} needs {fmt_bytes(other)}" if between_steps else "")
    note = (f"reserved {fmt_bytes(reserve)} for step temporaries ({needs}, measured in {probe.seconds:.1f}s, "
            f"+{MARGIN_FRACTION:.0%} + {fmt_bytes(MARGIN_BYTES)}) of the {fmt_bytes(budget)} budget beside "
            f"params ({fmt_bytes(param_bytes)})")
    return MemoryPlan(plan, buckets, reserve, probe, note)


def pool_structs(cfg: ModelConfig, dtype, plan: PoolPlan) -> Pools:
    """``ShapeDtypeStruct``s of the pools ``plan`` makes (``init_pools`` without allocating)."""
    return pool_shapes(cfg, dtype, (plan.num_pages, plan.page_size), plan.num_slots)
