"""The pooled serving step against the dense per-sequence forward, on tiny real checkpoints.

One schedule per model drives ``runner.step`` through prefill chunks at non-aligned offsets
continuing earlier chunks, mixed prefill + decode steps, pure-decode steps, snapshots (mid-row on
a ×64 boundary, a whole 1-token row, a decode-path row), and restores from those snapshots (a
prefill hit and a decode hit). Every row's token and logprob must equal what the dense
``decoder.forward`` gives for that sequence alone (a cold run), every snapshot slot must equal the
dense state at its boundary, and after every step every page offset and slot the step did not name
must be bit-identical (padding rows write only the null page / slot; tree slots read by a
restore stay untouched).

All steps of a model share one prefill bucket and one decode bucket, and the dense reference runs
all sequences as one [N, 64] batch twice, so each model compiles three programs.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.experimental.pallas.fuser  # noqa: F401  (test_one_compile_per_bucket says why)
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve import sampler
from jaxserve.engine import pools as pool_mod
from jaxserve.engine import runner
from jaxserve.models import decoder
from weights import load_model
from weights.random_checkpoint import write_random_checkpoint

MODELS = [("qwen3_5", "dense"), ("qwen3_next", "moe"), ("qwen3", "base"), ("kimi_linear", "moe"),
          ("kernel", "gdn_decode"), ("kernel", "kda"), ("kernel", "gdn_fused"), ("kernel", "kda_fused"),
          ("kernel", "gdn_prep"), ("kernel", "linear")]
# ("kernel", "gdn_decode"): a random qwen3_5 whose shapes fit the Mosaic GPU kernels' tiling (GDN dk =
# dv = 64; attention head dim 64), run with cfg.kernels="pallas-interpret": the GDN chunked prefill
# kernel on prefill steps, the GDN decode kernel on decode steps, the conv1d kernels (prefill and
# update) and the paged attention kernel on every step, in GPU interpret mode, through the
# same schedule (decode snapshots, a decode-path restore, fresh one-token rows, chunked prefill
# continuing cached pages) against the jnp dense forward.
KERNEL_CONFIG = {
    "model_type": "qwen3_5_text", "vocab_size": 512, "hidden_size": 64, "intermediate_size": 96,
    "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 64,
    "layer_types": ["linear_attention", "full_attention"], "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 64, "linear_value_head_dim": 64, "linear_num_key_heads": 1,
    "linear_num_value_heads": 2, "rms_norm_eps": 1e-6, "tie_word_embeddings": True,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
    "max_position_embeddings": 4096, "eos_token_id": 511,
}
# kimi_linear through every kernel: KDA chunked prefill and decode (per-channel gate), the short conv
# over q/k/v (3 * 2 * 64 = 384 channels), and paged attention for its MLA (value dim = key dim = 64
# here; Kimi-Linear's own 128 != 192 takes the jnp paged attention).
KDA_KERNEL_CONFIG = {
    "model_type": "kimi_linear", "vocab_size": 512, "hidden_size": 64, "intermediate_size": 96,
    "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 2, "kv_lora_rank": 32,
    "qk_nope_head_dim": 32, "qk_rope_head_dim": 32, "v_head_dim": 64, "q_lora_rank": None,
    "layer_types": ["linear_attention", "full_attention"], "mlp_layer_types": ["dense", "dense"],
    "linear_attn_config": {"kda_layers": [1], "full_attn_layers": [2], "head_dim": 64, "num_heads": 2,
                           "short_conv_kernel_size": 4},
    "num_experts": 0, "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "eos_token_id": 511,
}
# case -> (config, cfg.kernels). The *_fused cases run only the fused whole-chunk prefill kernels
# (gdn_chunk_fused / kda_chunk_fused, backends' "prefill_fused") in interpret mode, jnp elsewhere
# (kda_fused with its decay rates set to 1: ``_gentle_gates``); gdn_prep the GDN prefill with its
# intra-chunk terms by gdn_chunk_prep (backends' "prefill_prep").
KERNEL_CASES = {"gdn_decode": (KERNEL_CONFIG, "pallas-interpret"), "kda": (KDA_KERNEL_CONFIG, "pallas-interpret"),
                "gdn_fused": (KERNEL_CONFIG, "interpret:prefill_fused"),
                "kda_fused": (KDA_KERNEL_CONFIG, "interpret:prefill_fused"),
                "gdn_prep": (KERNEL_CONFIG, "interpret:prefill_prep"),
                # decode steps' projections and every step's LM head through pallas_kernels/linear_small
                "linear": ({**KERNEL_CONFIG, "tie_word_embeddings": False}, "interpret:linear")}
PAGE = 16
MAX_LEN = 128  # every sequence fits; the dense reference is [N, 64] run twice
BUCKETS = runner.Buckets(tokens=(128,), seqs=(8,), pages_per_seq=MAX_LEN // PAGE, page_size=PAGE)
# the schedule's two programs: every mixed step pads S to 128 // 64 + 8; its decode steps ask for <= 1 snapshot
PROGRAMS = [(128, 8, 10, False), (8, 8, 1, True)]
GREEDY = dict(temperature=0.0)
SAMPLED = dict(temperature=0.8, top_k=20, top_p=0.9, seed=7)


@dataclasses.dataclass
class Seq:
    name: str
    tokens: list[int]  # everything fed so far, then the prompt remainder
    pages: list[int]
    slot: int
    sampling: dict
    fed: int = 0
    samples: int = 0


def _run_schedule(model):
    """Drive the runner; returns records of every row, snapshot slots and the final pools."""
    cfg, params = model.config, model.params
    hybrid = cfg.is_hybrid
    plan = pool_mod.plan_pools(cfg, jnp.float32, page_size=PAGE, max_seqs=8, num_pages=48, num_slots=16)
    pools = pool_mod.init_pools(plan, cfg, jnp.float32)
    rng = np.random.default_rng(0)
    rand = lambda n: rng.integers(0, cfg.vocab_size, n).tolist()  # noqa: E731
    free_pages = iter(range(1, plan.num_pages))
    new_pages = lambda n: [next(free_pages) for _ in range(n)]  # noqa: E731
    slot = lambda s: s if hybrid else 0  # noqa: E731
    seqs = {
        "A": Seq("A", rand(100), new_pages(8), slot(1), GREEDY),
        "B": Seq("B", rand(62), new_pages(8), slot(2), GREEDY),
        "C": Seq("C", rand(63), new_pages(8), slot(3), SAMPLED),
        "E": Seq("E", rand(4), new_pages(1), slot(6), GREEDY),
    }
    snap = {"A": slot(9), "B": slot(10), "C": slot(11)}  # tree slots: written once by a snapshot op
    records, checks = [], []
    before_compiles = runner.compile_count()

    def row(name, n, snapshots=(), restore=0):
        s = seqs[name]
        return s, runner.RowSpec(tokens=s.tokens[s.fed : s.fed + n], start=s.fed, pages=s.pages, slot=s.slot,
                                 restore_src=restore if hybrid else 0,
                                 snapshots=[(k, snap[w]) for k, w in snapshots] if hybrid else [],
                                 sample_idx=s.samples, **s.sampling)

    def run(rows):
        nonlocal pools
        specs = [spec for _, spec in rows]
        batch = runner.make_batch(specs, BUCKETS)
        host = jax.tree.map(np.asarray, pools)
        out, pools = runner.step(params, cfg, pools, batch)
        toks, lps = np.asarray(out.tokens), np.asarray(out.logprobs)
        checks.append((host, jax.tree.map(np.asarray, pools), specs))
        for i, (s, spec) in enumerate(rows):
            s.fed += len(spec.tokens)
            records.append((s.name, s.fed - 1, int(toks[i]), float(lps[i]), s.sampling is GREEDY))
            if s.fed == len(s.tokens):  # the row ended its pending tokens: the sample is kept
                s.tokens.append(int(toks[i]))
                s.samples += 1

    # 1. four prefill chunks (A and B stop mid-prompt at non-aligned offsets); E is then retired.
    run([row("A", 37), row("B", 23), row("C", 63), row("E", 4)])
    # 2. A crosses 64 mid-row (snapshot after 27 of 63 tokens), B finishes its prompt, C decodes
    #    position 63 and snapshots after its single token (= the row's length).
    run([row("A", 63, [(27, "A")]), row("B", 39), row("C", 1, [(1, "C")])])
    # 3. D = A's first 64 tokens (a cache hit: A's pages, restore from A's snapshot) + its own 30;
    #    mixed with three decodes.
    a = seqs["A"]
    seqs["D"] = Seq("D", a.tokens[:64] + rand(30), a.pages[:4] + new_pages(4), slot(4), GREEDY, fed=64)
    run([row("D", 30, restore=snap["A"]), row("A", 1), row("B", 1), row("C", 1)])
    # 4. pure decode: B decodes position 63 and snapshots 64 on the decode path; F = C's first 64
    #    tokens + one of its own, restored from C's snapshot (a hit on the decode path).
    c = seqs["C"]
    seqs["F"] = Seq("F", c.tokens[:64] + [(c.tokens[64] + 1) % cfg.vocab_size], c.pages[:4] + new_pages(4),
                    slot(5), GREEDY, fed=64)
    run([row("A", 1), row("B", 1, [(1, "B")]), row("C", 1), row("D", 1), row("F", 1, restore=snap["C"])])
    # 5. pure decode again, plus G: a fresh 1-token prompt in E's old slot and page, which still
    #    hold E's state and KV (a fresh sequence must start from zeros whatever its slot held).
    seqs["G"] = Seq("G", rand(1), seqs["E"].pages, slot(6), GREEDY)
    run([row(n, 1) for n in "ABCDFG"])
    return dict(seqs=seqs, records=records, checks=checks, pools=jax.tree.map(np.asarray, pools), snap=snap,
                compiles=runner.compile_count() - before_compiles)


def _reference(model, seqs):
    """Dense cold runs: every sequence alone in its own row of decoder.forward (zero-padded to
    MAX_LEN; causal, so padding changes no earlier logit). Returns log-probs [N, MAX_LEN, V] and the
    dense state after 64 tokens."""
    names = list(seqs)
    toks = np.zeros((len(names), MAX_LEN), np.int32)
    for i, n in enumerate(names):
        toks[i, : len(seqs[n].tokens)] = seqs[n].tokens
    state = decoder.init_state(model.config, len(names), MAX_LEN, jnp.float32)
    logits = []
    for start in (0, 64):
        pos = jnp.broadcast_to(jnp.arange(start, start + 64, dtype=jnp.int32), (len(names), 64))
        lg, state = decoder.forward(model.params, model.config, jnp.asarray(toks[:, start : start + 64]), pos, state)
        logits.append(np.asarray(lg))
        if start == 0:
            at64 = jax.tree.map(np.asarray, state)
    logp = jax.nn.log_softmax(jnp.asarray(np.concatenate(logits, axis=1)), axis=-1)
    return {n: i for i, n in enumerate(names)}, np.asarray(logp), at64


def _gentle_gates(model):
    """``model`` with every decay rate ``exp(A_log)`` 1: log-decays ``-softplus(a + dt_bias)``, above
    the fused KDA kernel's ``MIN_LOG_DECAY`` (-10 per token and channel), so the kernel is exact
    here and the case checks the wiring to fp32 rounding. transformers' ``A_log`` init (log U(1,
    16), rates up to 16) goes below it, where the kernel counts a log-decay as -10 (logprobs move by
    ~3e-4 over 100 tokens of this model; tests/pallas_kernels/test_kda_chunk_fused.py bounds it)."""
    params = jax.tree_util.tree_map_with_path(
        lambda path, x: jnp.zeros_like(x) if jax.tree_util.keystr(path).endswith("['A_log']") else x, model.params)
    return dataclasses.replace(model, params=params)


@pytest.fixture(scope="module", params=MODELS, ids=lambda m: f"{m[0]}-{m[1]}")
def case(request, oracle_dir, tmp_path_factory):
    if request.param[0] == "kernel":
        config, kernels = KERNEL_CASES[request.param[1]]
        folder = write_random_checkpoint(config, tmp_path_factory.mktemp("kernel"), dtype="float32", seed=5,
                                         init_std=0.2)
        model = load_model(folder, dtype="float32", progress=False)
        if request.param[1] == "kda_fused":
            model = _gentle_gates(model)
        model = dataclasses.replace(model, config=dataclasses.replace(model.config, kernels=kernels))
    else:
        model = load_model(oracle_dir / f"{request.param[0]}-{request.param[1]}", dtype="float32", progress=False)
    # as the engine runs it: the scheduler's promise of few rows of several tokens (ModelConfig.chunked_rows)
    model = dataclasses.replace(model, config=dataclasses.replace(model.config, chunked_rows=BUCKETS.chunked_rows))
    result = _run_schedule(model)
    # the reference is always the jnp stack without the engine's promise (for the kernel case:
    # kernels under test vs jnp; for every case: blocked and split forms vs the plain ones)
    plain = dataclasses.replace(model.config, kernels="jnp", chunked_rows=0)
    index, logp, at64 = _reference(dataclasses.replace(model, config=plain), result["seqs"])
    return model, result, index, logp, at64


def test_step_equals_dense_forward(case):
    """Every row's sampled token and logprob match the sequence run alone, cold (hit equals cold
    for the restored rows D and F)."""
    _, result, index, logp, _ = case
    for name, pos, tok, lp, greedy in result["records"]:
        ref = logp[index[name], pos]
        if greedy:
            assert tok == int(np.argmax(ref)), f"{name}@{pos}: token {tok} != {int(np.argmax(ref))}"
        assert abs(lp - ref[tok]) < 1e-4, f"{name}@{pos}: logprob {lp} != {ref[tok]}"
    assert {r[0] for r in result["records"]} == set("ABCDEFG")


def test_snapshots_equal_dense_state(case):
    """A mid-row chunked snapshot (A), a whole-row one (C) and a decode-path one (B), all after 64
    tokens: every GDN layer's conv and recurrent state equals the dense state there."""
    model, result, index, _, at64 = case
    if not model.config.is_hybrid:
        assert result["pools"].conv.size == 0 and result["pools"].rec.size == 0
        return
    pools = result["pools"]
    # fp32 rounding only: the kernels order their sums differently from the jnp stack (KDA's
    # per-channel decays reach 4e-5 relative on O(1) states in the kernel case)
    for name, slot in result["snap"].items():
        np.testing.assert_allclose(pools.conv[:, slot], at64.conv[:, index[name]], rtol=1e-4, atol=1e-5, err_msg=name)
        np.testing.assert_allclose(pools.rec[:, slot], at64.rec[:, index[name]], rtol=1e-4, atol=1e-5, err_msg=name)


def test_steps_touch_only_what_they_name(case):
    """Bit-identical before/after each step: every KV (page, offset) no new token maps to and every
    slot that is neither a row's own nor a snapshot destination (null page / slot aside). So
    padding writes nowhere else, and the tree slots read by restores are unchanged."""
    _, result, _, _, _ = case
    restored = 0
    for before, after, specs in result["checks"]:
        written = np.zeros(before.k.shape[1:3], bool)
        for s in specs:
            for pos in range(s.start, s.start + len(s.tokens)):
                written[s.pages[pos // PAGE], pos % PAGE] = True
        written[pool_mod.NULL_PAGE] = True
        for b, a in ((before.k, after.k), (before.v, after.v)):
            assert np.array_equal(b[:, ~written], a[:, ~written])
        slots = {s.slot for s in specs} | {dst for s in specs for _, dst in s.snapshots} | {pool_mod.NULL_SLOT}
        keep = [i for i in range(before.conv.shape[1]) if i not in slots]
        for b, a in ((before.conv, after.conv), (before.rec, after.rec)):
            assert np.array_equal(b[:, keep], a[:, keep])
        for s in specs:
            if s.restore_src:
                restored += 1
                assert np.array_equal(before.rec[:, s.restore_src], after.rec[:, s.restore_src])
                assert np.array_equal(before.conv[:, s.restore_src], after.conv[:, s.restore_src])
    assert restored == (2 if before.conv.shape[0] else 0)


def test_one_compile_per_bucket(case):
    """Five steps of varying raggedness hit two programs: one prefill/mixed bucket, one decode.
    (Mosaic GPU's interpreter imports ``jax.experimental.pallas.fuser`` on its first run, whose
    config state joins JAX's tracing context, so a program traced before that would be traced again
    (``jax_explain_cache_misses``: "number of tracing context values differs"): the first
    interpreted case to run would count 3. This module imports it up front.)"""
    assert case[1]["compiles"] == 2


# ------------------------------------------------------------------------------------------------
# Host-side batch building (no device work).
# ------------------------------------------------------------------------------------------------


def test_make_batch_pads_to_buckets():
    rows = [runner.RowSpec(tokens=[5, 6, 7], start=16, pages=[3, 4], slot=2, snapshots=[(0, 9)]),
            runner.RowSpec(tokens=[8], start=0, pages=[7], slot=3)]
    b = runner.make_batch(rows, BUCKETS)
    assert b.tokens.shape == (128,) and b.cu_seqlens.tolist()[:4] == [0, 3, 4, 4] and not runner.is_decode(b)
    assert b.positions[:4].tolist() == [16, 17, 18, 0] and b.page_table[0, :3].tolist() == [3, 4, 0]
    assert b.snap_seq.tolist() == [0] * 10 and b.snap_dst.tolist() == [9] + [0] * 9  # S = 128 // 64 + 8 rows
    d = runner.make_batch([runner.RowSpec(tokens=[1], start=5, pages=[2], slot=1)], BUCKETS)
    assert runner.is_decode(d) and d.tokens.shape == (8,) and d.cu_seqlens.tolist() == list(range(9))
    assert d.snap_seq.shape == (1,)  # a decode step of 8 rows pads S to 8 // 16 -> 1 unless more rows ask


@pytest.mark.parametrize("bad, match", [
    (runner.RowSpec(tokens=[1] * 20, start=0, pages=[1], slot=1), "do not cover"),
    (runner.RowSpec(tokens=[1] * 20, start=30, pages=[1, 2, 3, 4], slot=1, snapshots=[(10, 5)]), "boundary"),
    (runner.RowSpec(tokens=[1] * 20, start=44, pages=[1, 2, 3, 4], slot=1, snapshots=[(20, 1)]), "distinct"),
    (runner.RowSpec(tokens=[1] * 20, start=44, pages=[1, 2, 3, 4], slot=1, restore_src=1), "restore"),
    (runner.RowSpec(tokens=[1] * 200, start=0, pages=list(range(1, 14)), slot=1), "bucket|cover"),
])
def test_make_batch_rejects(bad, match):
    with pytest.raises(ValueError, match=match):
        runner.make_batch([bad], BUCKETS)


def test_make_batch_rejects_more_rows_of_several_tokens_than_the_chunk_grid_holds():
    rows = [runner.RowSpec(tokens=[1, 2], start=0, pages=[i + 1], slot=i + 1) for i in range(3)]
    two = dataclasses.replace(BUCKETS, chunked_rows=2)
    with pytest.raises(ValueError, match="exceed chunked_rows 2"):
        runner.make_batch(rows, two)
    runner.make_batch(rows[:2] + [runner.RowSpec(tokens=[3], start=5, pages=[9], slot=9)], two)  # one-token rows are free


def test_make_batch_puts_the_snapshots_of_rows_of_several_tokens_first():
    """The chunked rule computes only the first T // 64 + chunked_rows snapshot entries (Ragged)."""
    rows = [runner.RowSpec(tokens=[1], start=63, pages=[1, 2, 3, 4], slot=1, snapshots=[(1, 5)]),
            runner.RowSpec(tokens=[2] * 70, start=0, pages=[5, 6, 7, 8, 9], slot=2, snapshots=[(64, 6)])]
    b = runner.make_batch(rows, BUCKETS)
    assert b.snap_seq[:2].tolist() == [1, 0] and b.snap_len[:2].tolist() == [64, 1] and b.snap_dst[:2].tolist() == [6, 5]
    two = runner.RowSpec(tokens=[2] * 3, start=62, pages=[1, 2, 3, 4], slot=1, snapshots=[(0, 20), (2, 21)])
    with pytest.raises(ValueError, match="snapshots of rows of several tokens exceed"):
        runner.make_batch([two], dataclasses.replace(BUCKETS, chunked_rows=1, tokens=(32,), one_row_programs=False))


def test_make_batch_runs_a_lone_prompt_in_the_one_row_program():
    """A step of one row takes B = 1 and S = T // 64 + 1 (every boundary its tokens can cross); a
    second row, a decode riding along, takes the full-width program; without one-row programs both
    take it."""
    prompt = runner.RowSpec(tokens=[2] * 100, start=0, pages=list(range(1, 8)), slot=2, snapshots=[(64, 6)])
    decode = runner.RowSpec(tokens=[1], start=63, pages=[8, 9, 10, 11], slot=1, snapshots=[(1, 5)])
    lone = runner.make_batch([prompt], BUCKETS)
    assert (lone.tokens.shape[0], lone.cu_seqlens.shape[0] - 1, lone.snap_seq.shape[0]) == (128, 1, 128 // 64 + 1)
    both = runner.make_batch([prompt, decode], BUCKETS)
    assert (both.cu_seqlens.shape[0] - 1, both.snap_seq.shape[0]) == (8, 128 // 64 + 8)
    full = runner.make_batch([prompt], dataclasses.replace(BUCKETS, one_row_programs=False))
    assert (full.cu_seqlens.shape[0] - 1, full.snap_seq.shape[0]) == (8, 128 // 64 + 8)
    progs = BUCKETS.programs()
    assert (128, 1, 3, False) in progs and (128, 8, 10, False) in progs


def test_buckets_for_limits():
    b = runner.Buckets.for_limits(max_prefill_tokens=2048, max_seqs=48, max_model_len=1000, page_size=16)
    assert b.tokens == (32, 64, 128, 256, 512, 1024, 2048)
    assert b.seqs == (1, 2, 4, 8, 16, 32, 48)
    assert b.pages_per_seq == 64 and b.rows_for(32) == 32 and b.rows_for(2048) == 48
    assert b.snapshot_sizes(2048, False) == (2048 // 64 + 48,) and b.snapshot_sizes(32, False) == (32,)
    assert [b.snapshot_sizes(n, True) for n in (1, 2, 4, 32, 48)] == [(0, 1), (0, 2), (1, 4), (2, 32), (3, 48)]
    assert b.row_sizes(2048) == (1, 48) and b.snapshot_sizes(2048, False, 1) == (2048 // 64 + 1,)
    assert len(b.programs()) == 2 * 7 + 2 * 7 == len(set(b.programs()))
    without = dataclasses.replace(b, one_row_programs=False)
    assert without.row_sizes(2048) == (48,) and len(without.programs()) == 7 + 2 * 7
    assert b.with_max_tokens(256).tokens == (32, 64, 128, 256) and b.with_max_tokens(256).seqs == b.seqs
    with pytest.raises(ValueError, match="not one of"):
        b.with_max_tokens(300)
    with pytest.raises(ValueError, match="divide"):
        runner.Buckets.for_limits(max_prefill_tokens=64, max_seqs=4, max_model_len=64, page_size=24)


@pytest.mark.parametrize("max_seqs, count", [(64, 23), (32, 21)])
def test_program_counts_of_the_serve_defaults(max_seqs, count):
    """``--max-prefill-length 8192`` with 64 (the default) or 32 running requests: 2 x |tokens| = 18
    mixed programs (full width and one row) and two per decode bucket; 9 fewer without the one-row
    programs (one S ladder per shape gave 85 and 80)."""
    b = runner.Buckets.for_limits(max_prefill_tokens=8192, max_seqs=max_seqs, max_model_len=8192, page_size=16)
    assert len(b.programs()) == count + 9
    assert len(dataclasses.replace(b, one_row_programs=False).programs()) == count


def _boundaries_crossed(start: int, n: int) -> int:
    """×64 boundaries in (start, start + n]: the snapshots the scheduler asks of such a row, at most."""
    return sum(1 for pos in range(start + 1, start + n + 1) if pos % 64 == 0)


@pytest.mark.parametrize("max_seqs", [1, 3, 8, 48])
def test_largest_snapshot_size_covers_every_step(max_seqs):
    """Random steps (rows at random cache offsets, random splits of up to T tokens, every row
    crossing every boundary it can): the snapshots never exceed the last size of the step's shape,
    counted row by row (independent of the capacity formula)."""
    rng = np.random.default_rng(max_seqs)
    b = runner.Buckets.for_limits(max_prefill_tokens=1024, max_seqs=max_seqs, max_model_len=8192, page_size=16)
    for _ in range(3000):
        decode = rng.random() < 0.3
        if decode:
            n_rows = int(rng.integers(1, max_seqs + 1))
            lens = [1] * n_rows
            T = runner._fit(n_rows, b.seqs, "rows")
        else:
            total = int(rng.integers(1, b.tokens[-1] + 1))
            n_rows = int(rng.integers(1, min(total, max_seqs) + 1))
            cuts = np.sort(rng.choice(np.arange(1, total), n_rows - 1, replace=False)) if n_rows > 1 else []
            lens = np.diff([0, *cuts, total]).tolist()
            T = runner._fit(total, b.tokens, "tokens")
        starts = [int(63 - rng.integers(0, 3)) if rng.random() < 0.5 else int(rng.integers(0, 4096)) for _ in lens]
        snaps = sum(_boundaries_crossed(s, n) for s, n in zip(starts, lens))
        assert snaps <= b.snapshot_sizes(T, decode)[-1], (T, decode, lens, starts)


def test_warmup_writes_only_null_entries(case):
    """All-padding batches (what ``warmup`` runs) leave every non-null page and slot bit-identical,
    so warming up on live pools is safe. Uses this model's two programs: no new compile."""
    model, result, _, _, _ = case
    rng = np.random.default_rng(1)
    live = jax.tree.map(lambda x: jnp.asarray(rng.standard_normal(x.shape), x.dtype), result["pools"])
    before = jax.tree.map(np.asarray, live)
    after = runner.warmup(model.params, model.config, live, BUCKETS, programs=PROGRAMS)
    for b, a in zip(before, jax.tree.map(np.asarray, after)):
        assert np.array_equal(b[:, 1:], a[:, 1:])


def test_device_executor_runs_a_scheduler_plan(case):
    """The Executor adapter maps a scheduler plan (duck-typed) onto the step: step 1 of the
    schedule again, through fresh pools, gives the same tokens."""
    model, result, _, _, _ = case
    seqs = result["seqs"]
    plan = pool_mod.plan_pools(model.config, jnp.float32, page_size=PAGE, max_seqs=8, num_pages=48, num_slots=16)
    ex = runner.DeviceExecutor(model.params, model.config, pool_mod.init_pools(plan, model.config, jnp.float32),
                               BUCKETS)
    ns = lambda **kw: type("NS", (), kw)  # noqa: E731
    rows = []
    for name, n in (("A", 37), ("B", 23), ("C", 63), ("E", 4)):
        s = seqs[name]
        req = ns(pages=s.pages, slot=s.slot, output_ids=[], sampling=ns(**{"top_k": 0, "top_p": 1.0, "seed": 0,
                                                                           **s.sampling}))
        rows.append(ns(req=req, start=0, tokens=s.tokens[:n], restore_src=0, snapshots=[], sample_idx=0, feed=-1))
    tokens, logprobs = ex.execute(ns(rows=rows))
    first = result["records"][:4]
    assert tokens == [r[2] for r in first]
    np.testing.assert_allclose(logprobs, [r[3] for r in first], atol=1e-6)
    ex.barrier()
    if model.config.is_hybrid:
        assert ex.slot_checksum(9) == ex.slot_checksum(10)  # both untouched zeros
        assert ex.slot_checksum(1) != ex.slot_checksum(9)


def test_greedy_rows_are_the_same_bits_in_any_batch_mix(case):
    """Step 1 of the schedule (greedy A, B, E beside sampled C) through fresh pools runs the full
    sampler; the same batch with C made greedy runs the greedy one (no sort, no draw). The greedy
    rows' tokens and logprobs are the same bits both ways and equal the schedule's, C's are the
    schedule's, and ``sample`` on the returned logits (the sampler as the step ran it before it
    was split out) gives the same bits for every row."""
    model, result, _, _, _ = case
    cfg, seqs = model.config, result["seqs"]
    plan = pool_mod.plan_pools(cfg, jnp.float32, page_size=PAGE, max_seqs=8, num_pages=48, num_slots=16)
    rows = [runner.RowSpec(tokens=seqs[n].tokens[:k], start=0, pages=seqs[n].pages, slot=seqs[n].slot,
                           **seqs[n].sampling) for n, k in (("A", 37), ("B", 23), ("C", 63), ("E", 4))]
    mixed = runner.make_batch(rows, BUCKETS)
    greedy = mixed._replace(temperature=np.zeros_like(mixed.temperature))
    assert sampler.sample_mode(mixed.temperature) == sampler.FULL and sampler.sample_mode(greedy.temperature) == sampler.GREEDY
    outs = [runner.step(model.params, cfg, pool_mod.init_pools(plan, cfg, jnp.float32), b, return_logits=True)[0]
            for b in (mixed, greedy)]
    (toks, lps), (g_toks, g_lps) = [(np.asarray(o.tokens)[:4], np.asarray(o.logprobs)[:4]) for o in outs]
    np.testing.assert_array_equal(np.asarray(outs[0].logits), np.asarray(outs[1].logits))
    is_greedy = np.array([r.temperature == 0 for r in rows])
    np.testing.assert_array_equal(toks[is_greedy], g_toks[is_greedy])
    np.testing.assert_array_equal(lps[is_greedy], g_lps[is_greedy])
    first = result["records"][:4]
    assert toks.tolist() == [r[2] for r in first] and lps.tolist() == [r[3] for r in first]
    keys = jax.vmap(lambda s, i: jax.random.fold_in(jax.random.PRNGKey(s), i))(mixed.seed, mixed.sample_idx)
    for out, b in zip(outs, (mixed, greedy)):
        want = sampler.sample(out.logits, keys, b.temperature, b.top_k, b.top_p)
        np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(want[0]))
        np.testing.assert_array_equal(np.asarray(out.logprobs), np.asarray(want[1]))


def test_paged_attention_matches_naive():
    """The attention backend alone against a numpy loop: GQA, scattered non-contiguous pages,
    cached context + new tokens, a sliding window, padding tokens and an empty padding row."""
    from jaxserve.models.layers import paged_attention

    rng = np.random.default_rng(3)
    nh, nkv, hd, ps, n_pages, window = 4, 2, 8, 16, 20, 40
    lens, ctx = [5, 1, 30], [70, 17, 0]  # row 1 is a decode; row 3 is padding
    pages = [[7, 3, 12, 9, 15, 2], [11, 4], [5, 18]]
    T = 48
    cu = np.concatenate([[0], np.cumsum(lens), [sum(lens)]]).astype(np.int32)
    pos = np.zeros(T, np.int32)
    table = np.zeros((4, 8), np.int32)
    for b in range(3):
        pos[cu[b] : cu[b + 1]] = np.arange(ctx[b], ctx[b] + lens[b])
        table[b, : len(pages[b])] = pages[b]
    k_pool = rng.standard_normal((2, n_pages, ps, nkv, hd)).astype(np.float32)
    v_pool = rng.standard_normal((2, n_pages, ps, nkv, hd)).astype(np.float32)
    q = rng.standard_normal((T, nh, hd)).astype(np.float32)
    k = rng.standard_normal((T, nkv, hd)).astype(np.float32)
    v = rng.standard_normal((T, nkv, hd)).astype(np.float32)
    z = np.zeros(4, np.int32)
    r = decoder.make_ragged(jnp.asarray(pos), jnp.asarray(cu), jnp.asarray(np.array(ctx + [0], np.int32)),
                            jnp.asarray(table), jnp.asarray(z), jnp.asarray(z))
    for w in (None, window):
        out, kp, vp = jax.jit(paged_attention, static_argnums=(5, 7))(q, k, v, k_pool, v_pool, 1, r, w)
        out, kp = np.asarray(out).reshape(T, nh, hd), np.asarray(kp)
        ref_k, ref_v = k_pool.copy(), v_pool.copy()
        for b in range(3):
            for t in range(cu[b], cu[b + 1]):
                ref_k[1, pages[b][pos[t] // ps], pos[t] % ps] = k[t]
                ref_v[1, pages[b][pos[t] // ps], pos[t] % ps] = v[t]
        for b in range(3):
            keys = np.stack([ref_k[1, pages[b][p // ps], p % ps] for p in range(ctx[b] + lens[b])])
            vals = np.stack([ref_v[1, pages[b][p // ps], p % ps] for p in range(ctx[b] + lens[b])])
            for t in range(cu[b], cu[b + 1]):
                lo = 0 if w is None else max(0, pos[t] - w + 1)
                for h in range(nh):
                    s = keys[lo : pos[t] + 1, h // 2] @ q[t, h] / np.sqrt(hd)
                    p = np.exp(s - s.max())
                    np.testing.assert_allclose(out[t, h], p @ vals[lo : pos[t] + 1, h // 2] / p.sum(), atol=1e-5)
        written = np.zeros((n_pages, ps), bool)
        written[0] = True  # padding tokens land in the null page
        for b in range(3):
            for p in range(ctx[b], ctx[b] + lens[b]):
                written[pages[b][p // ps], p % ps] = True
        assert np.array_equal(kp[1][~written], ref_k[1][~written]) and np.array_equal(kp[0], k_pool[0])
        np.testing.assert_array_equal(kp[1, 1:][written[1:]], ref_k[1, 1:][written[1:]])
