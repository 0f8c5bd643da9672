"""The program store (jaxserve/engine/program_store.py): compiled step programs saved on disk and
loaded without tracing or lowering, called directly by the step (``runner.Executables``).

A step program of the start-up tests' two-layer qwen3_5 is compiled once, stored, loaded back
(in this process: the executable's bytes round-trip; the restart in a fresh process is
tests/engine/test_startup.py's), and run on real prompts beside the jit step it replaces: the
same logits, pools and tokens. The key must change with anything a program is made from.
"""

from __future__ import annotations

import dataclasses
import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.engine import program_store, runner, startup
from jaxserve.engine import llm as llm_mod
from jaxserve.engine.pools import plan_pools
from jaxserve.sampling_params import SamplingParams
from tests.engine.test_startup import tiny  # noqa: F401 - the fixture
from weights import load_model


@pytest.fixture(scope="module")
def setup(tiny):  # noqa: F811
    model = load_model(tiny, dtype="float32", progress=False)
    b = runner.Buckets.for_limits(max_prefill_tokens=64, max_seqs=2, max_model_len=256, page_size=16)
    plan = plan_pools(model.config, jnp.float32, page_size=16, max_seqs=2, num_pages=20, num_slots=6)
    return model, b, plan


def _rows(b, prompt_len: int) -> runner.Batch:
    """One prompt of ``prompt_len`` tokens with its pages and slot, a snapshot at 64 if it reaches it."""
    pages = list(range(1, 1 + -(-prompt_len // 16)))
    snaps = ((64, 3),) if prompt_len >= 64 else ()
    row = runner.RowSpec(tokens=list(range(5, 5 + prompt_len)), start=0, pages=pages, slot=1, snapshots=snaps)
    return runner.make_batch([row], b)


def test_a_stored_program_loads_and_computes_what_the_jit_step_does(setup, tmp_path):
    model, b, plan = setup
    cfg = model.config
    structs = startup.pool_structs(cfg, jnp.float32, plan)
    batch = _rows(b, 40)
    program = runner.program_of(batch)

    first = startup.StepCompiler(model.params, cfg, b, store=program_store.ProgramStore(tmp_path))
    first.compile(program, structs)
    assert first.store.saved == 1 and not first.store.loaded

    again = startup.StepCompiler(model.params, cfg, b, store=program_store.ProgramStore(tmp_path))
    keep = runner.Executables(cfg)
    mem = again.compile(program, structs, keep)
    again.compile_sample((1, "greedy"), keep)
    assert again.store.loaded == {"step": 1} and again.store.saved == 1  # the program loaded, the sampler new
    assert mem.temp_bytes > 0 and set(keep.step) == {program}  # memory analysis of a loaded executable

    def run(executables):
        pools = llm_mod.init_pools(plan, cfg, jnp.float32)
        out, pools = runner.step(model.params, cfg, pools, batch, feed_tokens=runner.feed_buffer(b.seqs[-1]),
                                 return_logits=True, executables=executables)
        return out, pools

    before = startup.step_compiles()
    stored_out, stored_pools = run(keep)
    assert startup.step_compiles() == before  # nothing traced, lowered or compiled
    jit_out, jit_pools = run(None)
    np.testing.assert_array_equal(np.asarray(stored_out.logits), np.asarray(jit_out.logits))
    np.testing.assert_array_equal(np.asarray(stored_out.tokens), np.asarray(jit_out.tokens))
    for x, y in zip(stored_pools, jit_pools):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_the_step_donates_the_pools_to_a_stored_program(setup, tmp_path):
    """A stored program updates the pools in place as the jit step does: the pools passed in are
    gone after the call (a program that copied them would need twice the pool memory)."""
    model, b, plan = setup
    cfg = model.config
    batch = _rows(b, 20)
    compiler = startup.StepCompiler(model.params, cfg, b, store=program_store.ProgramStore(tmp_path))
    compiler.compile(runner.program_of(batch), startup.pool_structs(cfg, jnp.float32, plan))
    keep = runner.Executables(cfg)
    startup.StepCompiler(model.params, cfg, b, store=program_store.ProgramStore(tmp_path)).compile(
        runner.program_of(batch), startup.pool_structs(cfg, jnp.float32, plan), keep)
    pools = llm_mod.init_pools(plan, cfg, jnp.float32)
    _, new = runner.step(model.params, cfg, pools, batch, feed_tokens=runner.feed_buffer(b.seqs[-1]),
                         executables=keep)
    jax.block_until_ready(new)
    assert all(x.is_deleted() for x in pools)


def test_another_config_or_shape_never_gets_a_stored_program(setup, tmp_path):
    """The step uses an executable only for the config it was built for (a config is a static
    argument: other kernels are another program); the key changes with the program, the config,
    the pools and the params' dtype."""
    model, b, plan = setup
    cfg = model.config
    batch = _rows(b, 20)
    keep = runner.Executables(cfg, step={runner.program_of(batch): "stand-in"})
    assert keep.step_for(cfg, batch) == "stand-in"
    other = dataclasses.replace(cfg, kernels="jnp" if cfg.kernels != "jnp" else "auto")
    assert keep.step_for(other, batch) is None

    compiler = startup.StepCompiler(model.params, cfg, b)
    structs = startup.pool_structs(cfg, jnp.float32, plan)
    base = compiler._describe("step", (64, 1, 1, False), structs)
    bigger = startup.pool_structs(cfg, jnp.float32, plan_pools(cfg, jnp.float32, page_size=16, max_seqs=2,
                                                               num_pages=40, num_slots=6))
    half = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, jnp.bfloat16), model.params)
    variants = [compiler._describe("step", (32, 1, 1, False), structs),
                startup.StepCompiler(model.params, other, b)._describe("step", (64, 1, 1, False), structs),
                compiler._describe("step", (64, 1, 1, False), bigger),
                startup.StepCompiler(half, cfg, b)._describe("step", (64, 1, 1, False), structs),
                compiler._describe("sample", (64, 1, 1, False))]
    keys = {program_store.ProgramStore.key(d) for d in [base, *variants]}
    assert len(keys) == 1 + len(variants)


def test_identity_covers_code_versions_and_flags(monkeypatch, tmp_path):
    """The store's folder is the hash of ``identity()``: another source tree or XLA flag is
    another folder; only the ``KEEP_IDENTITIES`` most recently used folders stay."""
    a = program_store.ProgramStore(tmp_path).dir
    assert json.loads((a / "identity.json").read_text())["sources"] == program_store.source_hash()
    monkeypatch.setenv("XLA_FLAGS", "--xla_dump_to=/nowhere")
    b = program_store.ProgramStore(tmp_path).dir
    monkeypatch.setattr(program_store, "source_hash", lambda: "edited")
    c = program_store.ProgramStore(tmp_path).dir
    assert len({a, b, c}) == 3
    for i in range(program_store.KEEP_IDENTITIES + 2):
        monkeypatch.setenv("XLA_FLAGS", f"--xla_variant={i}")
        program_store.ProgramStore(tmp_path)
    assert len([p for p in tmp_path.iterdir() if p.is_dir()]) == program_store.KEEP_IDENTITIES


def test_a_damaged_entry_is_a_miss_and_is_replaced(setup, tmp_path):
    model, b, plan = setup
    cfg = model.config
    structs = startup.pool_structs(cfg, jnp.float32, plan)
    program = (32, 1, 1, False)
    store = program_store.ProgramStore(tmp_path)
    startup.StepCompiler(model.params, cfg, b, store=store).compile(program, structs)
    (entry,) = store.dir.glob("*.bin")
    entry.write_bytes(entry.read_bytes()[:100])  # truncated (a crash mid-write cannot do this: writes are atomic)
    again = program_store.ProgramStore(tmp_path)
    mem = startup.StepCompiler(model.params, cfg, b, store=again).compile(program, structs)
    assert again.failed == 1 and not again.loaded and again.saved == 1 and mem.temp_bytes > 0
    assert program_store.ProgramStore(tmp_path).load(
        startup.StepCompiler(model.params, cfg, b)._describe("step", program, structs)) is not None


def test_an_unwritable_store_is_no_store_and_no_failure(setup, tmp_path, capsys):
    """A store folder that cannot be made (a file in the way, as a read-only disk would refuse it)
    means no store, said once on stderr; a store whose folder turns unwritable keeps compiling and
    says why it stores nothing."""
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert program_store.open_store(blocker / "store") is None
    assert "no program store" in capsys.readouterr().err
    model, b, plan = setup
    store = program_store.open_store(tmp_path / "store")
    shutil.rmtree(store.dir)
    store.dir.parent.rmdir()
    store.dir.parent.write_text("")  # the folder is now a file: every write fails
    mem = startup.StepCompiler(model.params, model.config, b, store=store).compile(
        (32, 1, 1, False), startup.pool_structs(model.config, jnp.float32, plan))
    assert mem.temp_bytes > 0 and store.saved == 0
    assert "not storing a program" in capsys.readouterr().err


def test_a_stored_program_that_fails_at_warm_up_is_dropped_and_compiled(tiny, tmp_path, monkeypatch, capsys):  # noqa: F811
    """Engines built in this process with a store (JAX's cache is off here, so every compile is
    fresh and stored): the second loads every program ready-made; when its warm-up fails (as a
    program a platform did not keep whole would), the store's programs are dropped, everything is
    compiled again and the engine serves what the first one does."""
    monkeypatch.setattr(program_store, "store_dir", lambda cache: tmp_path / "store")
    kw = dict(dtype="float32", max_prefill_length=64, max_running_requests=2, compile_all=True, progress=True,
              one_row_programs=False)
    prompts = [[3, 4, 5, 6, 7], list(range(20, 90))]
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    first = llm_mod.LLM(str(tiny), **kw)
    want = [o.output_ids for o in first.generate(prompts, greedy)]
    assert "0 ready-made from the program store" in capsys.readouterr().err

    real, calls = llm_mod.warmup, []

    def failing_once(*a, **k):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("INTERNAL: a stored program lost a function")
        return real(*a, **k)

    monkeypatch.setattr(llm_mod, "warmup", failing_once)
    second = llm_mod.LLM(str(tiny), **kw)
    err = capsys.readouterr().err
    assert "the warm-up failed with programs from the program store" in err and len(calls) == 2
    assert "0 ready-made from the program store" in err  # the programs were compiled again
    assert [o.output_ids for o in second.generate(prompts, greedy)] == want
    monkeypatch.setattr(llm_mod, "warmup", real)
    third = llm_mod.LLM(str(tiny), **kw)  # the compiles of the second start were stored again
    assert "6 ready-made from the program store" in capsys.readouterr().err
    assert [o.output_ids for o in third.generate(prompts, greedy)] == want
