"""Tensor / expert parallelism on four forced host devices, against the same model on one device.

Every family (GDN + gated attention, dense and with experts split by intermediate; fused Qwen3-Next
projections and KDA + MLA + sigmoid routing, with experts split by expert id; plain attention) runs
one schedule through ``runner.step`` on one device and split over 2 and 4 devices: a prefill step that snapshots
a row at 64, a decode step, and a mixed step whose new row restores that snapshot (a hit) beside a
decode. Every row's fp32 logits must agree with one device's to float rounding (the split only
reorders sums), the params and pools must really be split (each device holds 1/n of the heads),
and the pools must come back from every step with the sharding they went in with.

The engine under TP=2 then serves a prompt cold and a second prompt that hits the first one's
prefix: greedy tokens equal the dense single-device forward's (hit equals cold, invariant 6).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.engine import pools as pool_mod
from jaxserve.engine import runner, startup
from jaxserve.generate import generate
from jaxserve.sampling_params import SamplingParams
from jaxserve.parallel.tensor import TensorParallel
from tests.parallel.conftest import DEVICES
from weights import load_model
from weights.random_checkpoint import write_random_checkpoint

pytestmark = pytest.mark.skipif(
    len(jax.devices()) < DEVICES,
    reason=f"needs {DEVICES} host devices: run tests/parallel in its own pytest process (scripts/test.sh does)")

ROPE = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25}
HYBRID = dict(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, layer_types=["linear_attention", "full_attention"],
              linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=8, linear_num_key_heads=4,
              linear_num_value_heads=8, rms_norm_eps=1e-6, max_position_embeddings=4096, eos_token_id=511,
              rope_parameters=ROPE)
MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48)
# name -> (HF config, expert_parallel): experts split by intermediate for qwen3_5_moe, by expert id
# (under shard_map, tests/parallel/test_expert_parallel.py) for qwen3_next and kimi_linear. KV heads:
# 2, so TP=4 replicates them (qwen3: 1, replicated at 2 too).
FAMILIES = {
    "qwen3_5": ({**HYBRID, "model_type": "qwen3_5_text", "tie_word_embeddings": True}, False),
    "qwen3_5_moe": ({**HYBRID, **MOE, "model_type": "qwen3_5_moe_text", "tie_word_embeddings": False}, False),
    "qwen3_next": ({**HYBRID, **MOE, "model_type": "qwen3_next", "tie_word_embeddings": False,
                    "norm_topk_prob": True}, True),
    "kimi_linear": (dict(model_type="kimi_linear", vocab_size=512, hidden_size=64, intermediate_size=96,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, rms_norm_eps=1e-5,
                         tie_word_embeddings=False, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
                         v_head_dim=16, q_lora_rank=None, num_experts=8, num_experts_per_tok=2, n_group=2,
                         topk_group=1, first_k_dense_replace=0, n_shared_experts=1, moe_intermediate_size=32,
                         linear_attn_config={"kda_layers": [1], "full_attn_layers": [2], "head_dim": 16,
                                             "num_heads": 4, "short_conv_kernel_size": 4},
                         eos_token_id=511), True),
    "qwen3": (dict(model_type="qwen3", vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=1, head_dim=16, rms_norm_eps=1e-6,
                   max_position_embeddings=4096, tie_word_embeddings=False, eos_token_id=511,
                   rope_parameters={"rope_type": "default", "rope_theta": 10000.0}), False),
}
PAGE = 16
BUCKETS = runner.Buckets(tokens=(128,), seqs=(4,), pages_per_seq=8, page_size=PAGE)
REL_TOL = 1e-5  # of max |logit|: fp32 sums in another order


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp")
    return {name: write_random_checkpoint(hf, root / name, dtype="float32", seed=i, init_std=0.2)
            for i, (name, (hf, _)) in enumerate(FAMILIES.items())}


def _schedule(folder, tp: TensorParallel | None, stacked: bool = False):
    """The module doc's three steps; returns (cfg, params, per-step logits of the real rows, pools).
    ``stacked``: the params in the decoder's stacked layout (the engine's)."""
    model = load_model(folder, dtype="float32", progress=False, tensor_parallel=tp, stacked=stacked)
    cfg = model.config if tp else dataclasses.replace(model.config, kernels="jnp")
    plan = pool_mod.plan_pools(cfg, jnp.float32, page_size=PAGE, max_seqs=4, num_pages=24, num_slots=8)
    placement = None if tp is None else runner.Placement(model.params, tp.pool_shardings(cfg))
    pools = pool_mod.init_pools(plan, cfg, jnp.float32, None if tp is None else placement.pools)
    slot = (lambda s: s) if cfg.is_hybrid else (lambda s: 0)
    rng = np.random.default_rng(0)
    a, b = rng.integers(0, cfg.vocab_size, 72).tolist(), rng.integers(0, cfg.vocab_size, 30).tolist()
    c = a[:64] + rng.integers(0, cfg.vocab_size, 9).tolist()
    pa, pb, pc = [1, 2, 3, 4, 5], [6, 7], [1, 2, 3, 4, 8]
    snap = [(64, slot(5))] if cfg.is_hybrid else []
    steps = [
        [runner.RowSpec(tokens=a, start=0, pages=pa, slot=slot(1), snapshots=snap),
         runner.RowSpec(tokens=b, start=0, pages=pb, slot=slot(2))],
        [runner.RowSpec(tokens=[3], start=72, pages=pa, slot=slot(1)),
         runner.RowSpec(tokens=[4], start=30, pages=pb, slot=slot(2))],
        [runner.RowSpec(tokens=c[64:], start=64, pages=pc, slot=slot(3), restore_src=slot(5)),
         runner.RowSpec(tokens=[5], start=73, pages=pa, slot=slot(1))],
    ]
    logits = []
    for rows in steps:
        before = None if tp is None else pools
        out, pools = runner.step(model.params, cfg, pools, runner.make_batch(rows, BUCKETS), return_logits=True,
                                 placement=placement)
        logits.append(np.asarray(out.logits)[: len(rows)])
        if tp is not None:  # the step gives the pools back split as they came
            assert jax.tree.map(lambda x: x.sharding, pools) == placement.pools
            assert all(x.is_deleted() for x in jax.tree.leaves(before)), "pools were not donated"
    return cfg, model.params, logits, pools


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, checkpoints):
    return request.param, checkpoints[request.param], _schedule(checkpoints[request.param], None)


@pytest.mark.parametrize("n", [2, 4])
def test_logits_equal_one_device(family, n):
    name, folder, (cfg1, _, ref, _) = family
    tp = TensorParallel.make(n, expert_parallel=FAMILIES[name][1])
    cfg, params, got, pools = _schedule(folder, tp)
    for i, (ours, theirs) in enumerate(zip(got, ref)):
        err, scale = np.max(np.abs(ours - theirs)), np.max(np.abs(theirs))
        assert err <= REL_TOL * scale, f"step {i}: max |Δlogit| {err:.3g} > {REL_TOL} · {scale:.3g}"
        assert (ours.argmax(-1) == theirs.argmax(-1)).all()

    # really split: each device holds 1/n of every split axis
    def per_device(x, axis):
        return x.addressable_shards[0].data.shape[axis] * n == x.shape[axis]

    assert per_device(pools.k, 3) and per_device(pools.v, 3)
    assert pools.k.shape[3] == max(cfg1.num_kv_heads, n) if not cfg.is_mla else pools.k.shape[3] == cfg1.num_heads
    if cfg.is_hybrid:
        assert per_device(pools.conv, 2) and per_device(pools.rec, 2)
    layer = params["layers"][-1]
    attn = layer["self_attn"]
    assert per_device(attn["o_proj"]["w"], 0)
    assert per_device(attn["kv_b_proj" if cfg.is_mla else "q_proj"]["w"], 1)
    lin = params["layers"][0]["linear_attn"] if cfg.is_hybrid else None
    if lin is not None:
        assert per_device(lin["in_proj_qkv" if cfg.kda else "in_proj"]["w"], 1) and per_device(lin["out_proj"]["w"], 0)
        assert per_device(lin["conv_w"], 0)
    mlp = layer["mlp"]
    if "gate_up" in mlp:
        ep = FAMILIES[name][1]
        assert per_device(mlp["gate_up"], 0 if ep else 2) and per_device(mlp["down"], 0 if ep else 1)
        assert cfg.expert_parallel == ep
        assert per_device(mlp["shared_expert"]["down_proj"]["w"], 0)
    else:
        assert per_device(mlp["gate_up_proj"]["w"], 1)
    assert params["embed"].sharding.is_fully_replicated
    if "lm_head" in params:
        assert per_device(params["lm_head"], 1)


# [GDN, attention] x 2: a period of 2 layers scanned twice in the stacked layout
DEEP = {**FAMILIES["qwen3_5_moe"][0], "num_hidden_layers": 4, "layer_types": ["linear_attention", "full_attention"] * 2}


@pytest.mark.parametrize("ep", [False, True])
def test_stacked_layout_split(tmp_path, ep):
    """The stacked params (``decoder.stack_layers``, as the engine loads them) split over 2 devices
    give one device's list-layout logits; each stacked leaf keeps its leading layer axis whole and
    splits the axis its layer's rule splits."""
    from jaxserve.models import decoder

    folder = write_random_checkpoint({**DEEP, "norm_topk_prob": True}, tmp_path / "deep", dtype="float32", seed=7,
                                     init_std=0.2)
    _, _, ref, _ = _schedule(folder, None)
    cfg, params, got, _ = _schedule(folder, TensorParallel.make(2, expert_parallel=ep), stacked=True)
    assert decoder.is_stacked(params) and decoder.stacked_groups(params) == decoder.LayerGroups(0, 2, 2)
    for ours, theirs in zip(got, ref):
        assert np.max(np.abs(ours - theirs)) <= REL_TOL * np.max(np.abs(theirs))
    gdn, attn = params["layers"]["period"]
    qkv = gdn["linear_attn"]["in_proj"]["w"]
    assert qkv.shape[0] == 2 and qkv.sharding.spec == jax.sharding.PartitionSpec(None, None, "tp")
    assert qkv.addressable_shards[0].data.shape == (2, qkv.shape[1], qkv.shape[2] // 2)
    assert attn["self_attn"]["o_proj"]["w"].sharding.spec == jax.sharding.PartitionSpec(None, "tp")
    assert attn["mlp"]["shared_expert"]["gate_up_proj"]["w"].sharding.spec == jax.sharding.PartitionSpec(None, None, "tp")
    gate_up = attn["mlp"]["gate_up"]
    assert gate_up.sharding.spec == (jax.sharding.PartitionSpec(None, "tp") if ep
                                     else jax.sharding.PartitionSpec(None, None, None, "tp"))


def test_ahead_of_time_compile_is_the_step_program(checkpoints):
    """A program compiled by ``StepCompiler`` under a placement is the one ``step`` runs (the
    start-up compile of every program is not wasted under TP), and so are its sampler programs
    (``warmup`` runs both modes)."""
    tp = TensorParallel.make(2)
    model = load_model(checkpoints["qwen3_5"], dtype="float32", progress=False, tensor_parallel=tp)
    cfg = model.config
    plan = pool_mod.plan_pools(cfg, jnp.float32, page_size=PAGE, max_seqs=4, num_pages=24, num_slots=8)
    placement = runner.Placement(model.params, tp.pool_shardings(cfg))
    program = BUCKETS.programs()[-1]
    compiler = startup.StepCompiler(model.params, cfg, BUCKETS, placement)
    compiler.compile(program, startup.pool_structs(cfg, jnp.float32, plan))
    for sample_program in BUCKETS.sample_programs():
        compiler.compile_sample(sample_program)
    pools = pool_mod.init_pools(plan, cfg, jnp.float32, placement.pools)
    before = startup.step_compiles(), startup.sample_compiles()
    runner.warmup(model.params, cfg, pools, BUCKETS, programs=[program], placement=placement)
    assert (startup.step_compiles(), startup.sample_compiles()) == before
    assert compiler.param_bytes * 2 > sum(x.nbytes for x in jax.tree.leaves(model.params))  # per device


def test_startup_errors():
    with pytest.raises(ValueError, match="does not divide the 4 attention heads"):
        TensorParallel.make(3).configure(_config("qwen3_5"))
    with pytest.raises(ValueError, match="Pallas kernels"):
        TensorParallel.make(2).configure(dataclasses.replace(_config("qwen3_5"), kernels="pallas"))
    with pytest.raises(ValueError, match="no routed experts"):
        TensorParallel.make(2, expert_parallel=True).configure(_config("qwen3"))
    with pytest.raises(ValueError, match="this host has"):
        TensorParallel.make(DEVICES + 1)
    assert TensorParallel.make(4).configure(_config("qwen3")).num_kv_heads == 4  # 1 KV head, replicated


def _config(name):
    from jaxserve.config import ModelConfig

    return ModelConfig.from_hf(FAMILIES[name][0], source="test")


def test_engine_greedy_under_tp_hit_equals_cold(checkpoints):
    """The whole engine split over 2 devices: a cold prompt, then one sharing its first 80 tokens
    (a 64-token hit on the first one's snapshot); both give the dense one-device forward's tokens."""
    from jaxserve.engine.llm import LLM

    folder = checkpoints["qwen3_next"]
    one = load_model(folder, dtype="float32", progress=False)
    cfg1 = dataclasses.replace(one.config, kernels="jnp")
    rng = np.random.default_rng(3)
    p1 = rng.integers(0, 500, 120).tolist()
    p2 = p1[:80] + rng.integers(0, 500, 60).tolist()  # 76 uncached tokens: the same 128-token program as p1
    sampling = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    cold = [generate(one.params, cfg1, p, sampling).output_ids for p in (p1, p2)]

    llm = LLM(str(folder), dtype="float32", tensor_parallel_size=2, num_pages=40, num_slots=12, page_size=PAGE,
              max_prefill_length=128, max_running_requests=4, max_model_len=256, progress=False,
              compile_cache=False)
    executor = llm.engine.executor
    assert executor.placement is not None and executor.pools.rec.sharding.spec[2] == "tp"
    first = llm.generate([p1], sampling)[0]
    second = llm.generate([p2], sampling)[0]
    assert first.cached_tokens == 0 and second.cached_tokens == 64
    assert [first.output_ids, second.output_ids] == cold
