"""Start-up (jaxserve/engine/startup.py): the memory plan from compiled steps, ahead-of-time compiles
that serving reuses, and the persistent compilation cache.

The planning logic runs against a fake ``measure`` whose needs are a known function of T, checked
against a brute-force search over the buckets. The compiles run on a 2-layer random qwen3_5
(a few seconds per program on the CPU); the engine test fakes a device that reports its memory, so
the CPU takes the GPU's path (probe compile, reserve, lowered prefill budget, every program
compiled up front) and then must serve a mix of requests without compiling anything.
"""

from __future__ import annotations

import dataclasses

import re
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve import sampler
from jaxserve.engine import llm as llm_mod
from jaxserve.engine import program_store, runner, startup
from jaxserve.engine.pools import MiB, minimal_pool_bytes, page_bytes, plan_pools, slot_bytes
from jaxserve.models.params import abstract_params
from jaxserve.sampling_params import SamplingParams
from tests.engine.test_pools import HYBRID
from tests.engine.test_runner import KERNEL_CONFIG
from weights import load_model
from weights.random_checkpoint import write_random_checkpoint

REPO = Path(__file__).resolve().parents[2]
# The runner tests' two-layer qwen3_5, smaller still: start-up planning needs no kernel-sized heads.
TINY = {**KERNEL_CONFIG, "head_dim": 32, "linear_key_head_dim": 16, "linear_value_head_dim": 16,
        "rope_parameters": {**KERNEL_CONFIG["rope_parameters"], "partial_rotary_factor": 0.5},
        "max_position_embeddings": 1024}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return write_random_checkpoint(TINY, tmp_path_factory.mktemp("tiny"), dtype="float32", seed=3)


# ------------------------------------------------------------------------------------------------
# plan_memory against a fake measure
# ------------------------------------------------------------------------------------------------

BUCKETS = runner.Buckets.for_limits(max_prefill_tokens=2048, max_seqs=8, max_model_len=4096, page_size=16)
LIMITS = startup.PoolLimits(page_size=16, max_seqs=8)
PARAMS = 10 * MiB


class FakeMeasure:
    """A step of T tokens needs ``base + per_token * T`` bytes; records what it was asked."""

    def __init__(self, base: int, per_token: int):
        self.base, self.per_token, self.calls = base, per_token, []

    def need(self, T: int) -> int:
        return self.base + self.per_token * T

    def __call__(self, program, plan):
        self.calls.append((program, plan))
        return startup.StepMemory(program, self.need(program[0]), self.need(program[0]), 0.0)


def _room(T: int) -> int:
    return minimal_pool_bytes(HYBRID, jnp.bfloat16, page_size=16, max_seqs=8, min_kv_tokens=T)


def _plan(measure, budget, limits=LIMITS, logs=None, between_steps=None):
    return startup.plan_memory(HYBRID, jnp.bfloat16, BUCKETS, limits, budget=budget, param_bytes=PARAMS,
                               measure=measure, log=(logs.append if logs is not None else lambda m: None),
                               between_steps=between_steps)


def test_reserve_covers_the_largest_step_and_the_pools_take_the_rest():
    measure = FakeMeasure(2 * MiB, 1024)
    budget = 1024 * MiB
    mp = _plan(measure, budget)
    reserve = startup.with_margin(measure.need(2048))
    assert mp.buckets == BUCKETS and mp.reserve_bytes == reserve and mp.probe.program[0] == 2048
    assert [c[0] for c in measure.calls] == [(2048, 8, 2048 // 64 + 8, False)]
    used = PARAMS + mp.pools.total_bytes + reserve
    assert used <= budget < used + page_bytes(HYBRID, jnp.bfloat16, 16) + slot_bytes(HYBRID, jnp.bfloat16)
    # the probe was compiled against the largest pools the budget allows (no reserve)
    probe_plan = measure.calls[0][1]
    assert probe_plan == plan_pools(HYBRID, jnp.bfloat16, page_size=16, max_seqs=8, mem_bytes=budget, param_bytes=PARAMS)


@pytest.mark.parametrize("fit_T", [1024, 256, 32])
def test_prefill_budget_drops_to_the_largest_bucket_that_fits(fit_T):
    """The budget leaves room for the step of ``fit_T`` tokens but not the next bucket up. The
    chosen T equals a brute-force search; the probes stay few (the proportional guess skips the
    buckets that cannot fit)."""
    measure = FakeMeasure(3 * MiB, 256 * 1024)
    budget = PARAMS + _room(fit_T) + startup.with_margin(measure.need(fit_T)) + 1
    reference = max(T for T in BUCKETS.tokens if startup.with_margin(measure.need(T)) <= budget - PARAMS - _room(T))
    assert reference == fit_T
    logs = []
    mp = _plan(measure, budget, logs=logs)
    assert mp.buckets.tokens[-1] == fit_T and mp.buckets.tokens == tuple(t for t in BUCKETS.tokens if t <= fit_T)
    assert mp.reserve_bytes == startup.with_margin(measure.need(fit_T))
    assert PARAMS + mp.pools.total_bytes + mp.reserve_bytes <= budget
    assert mp.pools.num_pages - 1 >= 8 + fit_T // 16  # a page per running request and one full step of KV
    asked = [c[0][0] for c in measure.calls]
    assert asked[0] == 2048 and asked[-1] == fit_T and len(asked) <= 3
    assert len(logs) == 1 and f"max prefill lowered from 2048 to {fit_T} tokens" in logs[0]


def test_nothing_fits_is_one_clear_error():
    measure = FakeMeasure(3 * MiB, 256 * 1024)
    budget = PARAMS + _room(32) + startup.with_margin(measure.need(32)) - 1
    with pytest.raises(ValueError, match=r"needs .* no prefill bucket fits"):
        _plan(measure, budget)


def test_a_program_between_steps_is_covered_by_the_reserve_not_added_to_it():
    """The vision tower runs between steps on the same stream: the reserve is the larger need."""
    measure = FakeMeasure(2 * MiB, 1024)
    small = _plan(measure, 1024 * MiB, between_steps=("the vision tower at 64 patches", MiB))
    assert small.reserve_bytes == startup.with_margin(measure.need(2048))
    big = 300 * MiB
    mp = _plan(measure, 1024 * MiB, between_steps=("the vision tower at 4096 patches", big))
    assert mp.reserve_bytes == startup.with_margin(big) and mp.buckets == BUCKETS
    assert PARAMS + mp.pools.total_bytes + mp.reserve_bytes <= 1024 * MiB
    assert "the vision tower at 4096 patches needs 300" in mp.note
    with pytest.raises(ValueError, match="vision tower at 4096 patches needs"):
        _plan(measure, PARAMS + _room(32) + big, between_steps=("the vision tower at 4096 patches", big))


def test_explicit_pool_sizes_are_probed_and_kept():
    measure = FakeMeasure(2 * MiB, 1024)
    limits = startup.PoolLimits(page_size=16, max_seqs=8, num_pages=100, num_slots=20)
    mp = _plan(measure, 400 * MiB, limits)
    assert (mp.pools.num_pages, mp.pools.num_slots) == (100, 20)
    assert measure.calls[0][1] == mp.pools  # the probe already had the final shapes: its program is reused
    with pytest.raises(ValueError, match="no prefill bucket fits"):
        _plan(FakeMeasure(400 * MiB, 0), 400 * MiB, limits)


def test_without_a_measure_nothing_is_reserved():
    mp = _plan(None, 200 * MiB)
    assert mp.reserve_bytes == 0 and mp.probe is None and mp.buckets == BUCKETS
    assert mp.pools == plan_pools(HYBRID, jnp.bfloat16, page_size=16, max_seqs=8, mem_bytes=200 * MiB,
                                  param_bytes=PARAMS)


# ------------------------------------------------------------------------------------------------
# Real compiles
# ------------------------------------------------------------------------------------------------


def test_ahead_of_time_compile_is_the_program_step_runs(tiny):
    """``StepCompiler`` compiles a program; ``runner.step`` with real arrays of those shapes then runs
    it without compiling (the invariant of ``runner.lower_step``), while a program compiled by nobody
    does compile (the counter counts). Its memory: XLA's temporaries plus at least the batch."""
    model = load_model(tiny, dtype="float32", progress=False)
    cfg, params = model.config, model.params
    b = runner.Buckets.for_limits(max_prefill_tokens=64, max_seqs=2, max_model_len=256, page_size=16)
    plan = plan_pools(cfg, jnp.float32, page_size=16, max_seqs=2, num_pages=20, num_slots=6)
    compiler = startup.StepCompiler(params, cfg, b)
    program = (64, 2, b.snapshot_sizes(64, False)[-1], False)
    mem = compiler.compile(program, startup.pool_structs(cfg, jnp.float32, plan))
    pools = llm_mod.init_pools(plan, cfg, jnp.float32)
    batch = runner.padding_batch(*program[:3], b.pages_per_seq, False)
    before = startup.step_compiles()
    out, pools = runner.step(params, cfg, pools, batch, feed_tokens=runner.feed_buffer(b.seqs[-1]))
    jax.block_until_ready(pools)
    assert startup.step_compiles() == before
    other = runner.padding_batch(32, 2, b.snapshot_sizes(32, False)[-1], b.pages_per_seq, False)
    out, pools = runner.step(params, cfg, pools, other, feed_tokens=runner.feed_buffer(b.seqs[-1]))
    assert startup.step_compiles() == before + 1
    # A model without a vision tower never reads the image fields: XLA drops them from the program.
    read = {k: x for k, x in batch._asdict().items() if cfg.vision or k not in ("image_row", "rope_pos")}
    inputs = sum(x.nbytes for x in read.values()) + 4 * b.seqs[-1]
    assert mem.program == program and mem.temp_bytes > 0
    assert mem.temp_bytes + inputs <= mem.need_bytes <= mem.temp_bytes + 2 * inputs + 4096


def test_sampler_programs_compile_ahead_of_time(tiny):
    """``Buckets.sample_programs()`` is every row count of ``programs()`` in both modes, and each,
    compiled by ``StepCompiler.compile_sample``, is the sampler program ``runner.step`` then runs
    after the model, for an all-greedy and for a sampled batch alike; a row count compiled by
    nobody does compile (the counter counts)."""
    model = load_model(tiny, dtype="float32", progress=False)
    cfg, params = model.config, model.params
    b = runner.Buckets.for_limits(max_prefill_tokens=32, max_seqs=2, max_model_len=256, page_size=16)
    assert b.sample_programs() == [(B, mode) for B in (1, 2) for mode in (sampler.GREEDY, sampler.FULL)]
    compiler = startup.StepCompiler(params, cfg, b)
    for program in b.sample_programs():
        compiler.compile_sample(program)
    pools = llm_mod.init_pools(plan_pools(cfg, jnp.float32, page_size=16, max_seqs=2, num_pages=20, num_slots=6),
                               cfg, jnp.float32)
    before = startup.sample_compiles()
    for T, B, S, decode in b.programs():
        for temperature in (0.0, 0.7):
            batch = runner.padding_batch(T, B, S, b.pages_per_seq, decode)
            batch.temperature[-1] = temperature
            out, pools = runner.step(params, cfg, pools, batch, feed_tokens=runner.feed_buffer(b.seqs[-1]))
            assert out.logits is None and out.tokens.shape == (B,) and out.feed_tokens.shape == (b.seqs[-1],)
    jax.block_until_ready(pools)
    assert startup.sample_compiles() == before
    logits = jnp.zeros((3, cfg.vocab_size), jnp.float32)
    runner.sample_logits(logits, runner.padding_batch(3, 3, 0, b.pages_per_seq, True), runner.feed_buffer(2),
                         sampler.GREEDY)
    assert startup.sample_compiles() == before + 1


def test_abstract_params_compile_the_program_the_loaded_model_runs(tiny):
    """``params.abstract_params`` (the weights-free params of benchmarks/step_memory.py) has the
    loaded pytree's structure, shapes and dtype, so the program ``StepCompiler`` builds from it is
    the one a step with the real weights runs: no second compile."""
    model = load_model(tiny, dtype="float32", progress=False)
    cfg, params = model.config, model.params
    abstract = abstract_params(cfg, jnp.float32)
    spec = lambda tree: jax.tree.map(lambda x: (x.shape, jnp.dtype(x.dtype)), tree)  # noqa: E731
    assert spec(abstract) == spec(params)
    b = runner.Buckets.for_limits(max_prefill_tokens=128, max_seqs=2, max_model_len=256, page_size=16)
    plan = plan_pools(cfg, jnp.float32, page_size=16, max_seqs=2, num_pages=20, num_slots=6)
    program = (128, 2, b.snapshot_sizes(128, False)[-1], False)
    mem = startup.StepCompiler(abstract, cfg, b).compile(program, startup.pool_structs(cfg, jnp.float32, plan))
    assert mem.temp_bytes > 0
    before = startup.step_compiles()
    batch = runner.padding_batch(*program[:3], b.pages_per_seq, False)
    out, pools = runner.step(params, cfg, llm_mod.init_pools(plan, cfg, jnp.float32), batch,
                             feed_tokens=runner.feed_buffer(b.seqs[-1]))
    jax.block_until_ready(pools)
    assert startup.step_compiles() == before


def test_engine_plans_compiles_and_serves_without_compiling(tiny, monkeypatch):
    """A fake device budget makes the CPU take the GPU's start-up path. The budget fits the
    64-token step but not the 128-token one (needs measured first, no margin), so the prefill budget
    drops to 64; every program is compiled before ``build_engine`` returns, and a mix of prompts
    (chunked, concurrent, short and long outputs) then compiles no step program."""
    monkeypatch.setattr(startup, "MARGIN_BYTES", 0)
    monkeypatch.setattr(startup, "MARGIN_FRACTION", 0.0)
    model = load_model(tiny, dtype="float32", progress=False)
    b = runner.Buckets.for_limits(max_prefill_tokens=256, max_seqs=2, max_model_len=1024, page_size=16)
    cfg = dataclasses.replace(model.config, chunked_rows=b.chunked_rows)  # as build_engine runs it
    compiler = startup.StepCompiler(model.params, cfg, b)
    shapes = startup.pool_structs(cfg, jnp.float32, plan_pools(cfg, jnp.float32, page_size=16, max_seqs=2,
                                                               num_pages=100, num_slots=20))
    need = {T: compiler.compile((T, 2, b.snapshot_sizes(T, False)[-1], False), shapes).need_bytes for T in (64, 128)}
    assert need[64] < need[128]
    params = sum(x.nbytes for x in jax.tree.leaves(model.params))
    budget = params + minimal_pool_bytes(cfg, jnp.float32, page_size=16, max_seqs=2, min_kv_tokens=64) + \
        (need[64] + need[128]) // 2
    monkeypatch.setattr(llm_mod, "device_budget", lambda fraction: budget)

    steps, samples = startup.step_compiles(), startup.sample_compiles()
    llm = llm_mod.LLM(str(tiny), dtype="float32", max_prefill_length=256, max_running_requests=2,
                      compile_all=True, compile_cache=False, progress=False)
    executor = llm.engine.executor
    assert executor.buckets.tokens == (32, 64) and llm.engine.scheduler.max_prefill_tokens == 64
    assert sum(x.nbytes for x in executor.pools) + params + need[64] <= budget
    compiled, sampled = startup.step_compiles(), startup.sample_compiles()
    # (a sampler program another test of this process compiled already is not compiled again)
    assert sampled - samples <= len(executor.buckets.sample_programs())
    # the probes (256 at the largest pools, then the guess) and every program at the final pools
    assert len(executor.buckets.programs()) + 2 <= compiled - steps <= len(executor.buckets.programs()) + 3

    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 500, n).tolist() for n in (1, 7, 40, 63, 64, 65, 150)]
    outs = llm.generate(prompts, [SamplingParams(max_tokens=k, temperature=0.0, ignore_eos=True)
                                  for k in (1, 9, 3, 20, 2, 5, 12)])
    assert [len(o.output_ids) for o in outs] == [1, 9, 3, 20, 2, 5, 12]
    llm.generate(prompts[2:4], SamplingParams(max_tokens=70, temperature=0.7, seed=1, ignore_eos=True))
    assert startup.step_compiles() == compiled and startup.sample_compiles() == sampled


# ------------------------------------------------------------------------------------------------
# The persistent compilation cache
# ------------------------------------------------------------------------------------------------


def test_compile_cache_dir_resolution(monkeypatch, tmp_path):
    monkeypatch.delenv(startup.COMPILE_CACHE_ENV, raising=False)
    assert startup.compile_cache_dir(True) == Path("~/.cache/jaxserve/xla").expanduser()
    assert startup.compile_cache_dir(False) is None and startup.compile_cache_dir("off") is None
    assert startup.compile_cache_dir(str(tmp_path)) == tmp_path
    monkeypatch.setenv(startup.COMPILE_CACHE_ENV, str(tmp_path / "env"))
    assert startup.compile_cache_dir(True) == tmp_path / "env"
    assert startup.compile_cache_dir(str(tmp_path / "flag")) == tmp_path / "flag"  # a flag beats the env
    monkeypatch.setenv(startup.COMPILE_CACHE_ENV, "off")
    assert startup.compile_cache_dir(None) is None
    assert startup.enable_compile_cache(str(tmp_path)) is None  # the test process has JAX's cache off


_START = """
import sys
from jaxserve.engine.llm import LLM
LLM(sys.argv[1], dtype="float32", max_prefill_length=64, max_running_requests=2, compile_all=True,
    compile_cache=sys.argv[2], one_row_programs=False)
"""


def test_a_restart_loads_every_program_ready_made(tiny, tmp_path):
    """Start-ups of the same model and limits in fresh processes: the first compiles, writing JAX's
    cache and the program store; the second loads every step program from the store (nothing
    traced, lowered or compiled); with the store gone, the third loads them from JAX's cache (and
    does not store those again: program_store.RESERIALIZES)."""
    cache = tmp_path / "xla"
    pattern = (r"compiled (\d+) step programs in [\d.]+s \((\d+) ready-made from the program store, "
               r"(\d+) loaded from the compile cache\)")

    def start() -> tuple[int, int, int]:
        proc = subprocess.run([sys.executable, "-c", _START, str(tiny), str(cache)], capture_output=True, text=True,
                              timeout=600, cwd=REPO)
        assert proc.returncode == 0, proc.stderr
        assert f"compile cache {cache}" in proc.stderr
        m = re.search(pattern, proc.stderr)
        assert m, proc.stderr
        return int(m.group(1)), int(m.group(2)), int(m.group(3))

    programs, stored, loaded = start()
    assert programs == 6 and stored == loaded == 0 and any(cache.iterdir())  # 2 mixed, decode (1, 2) x S (0, B)
    store = program_store.store_dir(cache)
    assert len(list(store.glob("*/*.bin"))) == programs + 4  # and the sampler programs of B = 1, 2
    assert start() == (programs, programs, 0)
    shutil.rmtree(store)
    assert start() == (programs, 0, programs)
