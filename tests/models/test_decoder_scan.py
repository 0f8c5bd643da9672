"""The stacked layout of the decoder (``decoder.layer_groups`` / ``stack_layers``): the layers that
repeat run as one ``lax.scan`` over a period of structurally identical layers.

- the layout finder on every family's structure (hybrid periods, a dense-first Kimi, all-attention
  Qwen3 with a period of one layer, no repetition at all);
- the stacked params give the list layout's logits and pools (fp32), through the serving step on
  a prefill with a snapshot, a decode step with a snapshot, and a mixed step restoring it, on a
  qwen3_5_moe-like hybrid (period after a head-less start, a tail) and a Kimi-Linear (dense first
  layer in the head, KDA + MLA in the period, a tail), and with vision deepstack levels added at a
  traced layer index;
- the compiled decode program holds each distinct layer body once: one while loop over the
  groups and a GDN in-projection per GDN layer of the period, not per layer of the model.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.config import ModelConfig
from jaxserve.engine import pools as pool_mod
from jaxserve.engine import runner
from jaxserve.models import decoder
from jaxserve.models.decoder import LayerGroups, find_groups, layer_groups
from weights import load_model
from weights.random_checkpoint import write_random_checkpoint
from weights.tiny import HYBRID_BASE, KIMI_BASE, QWEN3_BASE, VARIANTS

G, A = "linear_attention", "full_attention"
ROPE = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}
# [A, G, G, G] x 2 + [A]: the period starts at layer 0, one layer in the tail
QWEN_MOE = {**HYBRID_BASE, "model_type": "qwen3_5_moe_text", "num_hidden_layers": 9, "layer_types": [A, G, G, G] * 2 + [A],
            "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16, "attn_output_gate": True,
            "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16,
            "shared_expert_intermediate_size": 16, "norm_topk_prob": True, "tie_word_embeddings": False,
            "rope_parameters": ROPE, "eos_token_id": 2}
# KDA layers 1-3, 5-7, 9-11 and MLA 4, 8, 12 (1-based), the first layer dense: head 1, period 4 x 2, tail 3
KIMI = {**KIMI_BASE, "model_type": "kimi_linear", "num_hidden_layers": 12, "q_lora_rank": None, "num_experts": 4,
        "num_experts_per_tok": 2, "n_group": 2, "topk_group": 1, "first_k_dense_replace": 1, "n_shared_experts": 1,
        "linear_attn_config": {"kda_layers": [1, 2, 3, 5, 6, 7, 9, 10, 11], "full_attn_layers": [4, 8, 12],
                               "head_dim": 16, "num_heads": 4, "short_conv_kernel_size": 4}}
PAGE = 16
BUCKETS = runner.Buckets(tokens=(128,), seqs=(4,), pages_per_seq=8, page_size=PAGE)
TOL = 1e-5


def _config(raw: dict) -> ModelConfig:
    return ModelConfig.from_hf(raw, source="test_decoder_scan")


# ------------------------------------------------------------------------------ the layout finder


# weights/tiny.py's text variants -> their layout: alternating GDN / attention, a period of 2 twice
# (qwen3_next's sparse step alternates MoE and dense with them); three GDN layers then attention, a
# period of one GDN layer; plain Qwen3, every layer; Kimi's dense first layer and MLA leave two KDA
# layers in a row.
TINY = {("qwen3_5", "dense"): (0, 2, 2), ("qwen3_5", "untied"): (0, 1, 3), ("qwen3_5_moe", "moe"): (0, 2, 2),
        ("qwen3_5_moe", "moe_tied"): (0, 2, 2), ("qwen3_next", "moe"): (0, 2, 2),
        ("qwen3_next", "sparse_step"): (0, 2, 2), ("qwen3_next", "dense"): (0, 2, 2), ("qwen3", "base"): (0, 1, 3),
        ("qwen3", "untied"): (0, 1, 3), ("kimi_linear", "moe"): (1, 1, 2), ("kimi_linear", "q_lora"): (2, 1, 2)}


@pytest.mark.parametrize("family, variant", sorted(TINY))
def test_every_tiny_variant(family, variant):
    overrides, _ = VARIANTS[family][variant]
    base = {"qwen3": QWEN3_BASE, "kimi_linear": KIMI_BASE}.get(family, HYBRID_BASE)
    model_type = {"qwen3_5": "qwen3_5_text", "qwen3_5_moe": "qwen3_5_moe_text"}.get(family, family)
    assert layer_groups(_config({**base, **overrides, "model_type": model_type})) == LayerGroups(*TINY[family, variant])


def test_real_size_qwen3_5_moe():
    raw = json.loads((Path(__file__).resolve().parents[2] / "benchmarks/configs/qwen3_5_moe-6b.json").read_text())
    assert layer_groups(_config(raw)) == LayerGroups(0, 4, 6)


def test_kimi_dense_first_layer_stays_in_the_head():
    cfg = _config(KIMI)
    assert not cfg.moe_layers[0] and all(cfg.moe_layers[1:])
    assert layer_groups(cfg) == LayerGroups(1, 4, 2)


def test_all_attention_is_one_layer_period():
    assert layer_groups(_config({**QWEN3_BASE, "model_type": "qwen3", "num_hidden_layers": 28})) == LayerGroups(0, 1, 28)


def test_no_repetition_unrolls_everything():
    assert find_groups(["a", "b", "c"]) == LayerGroups(3, 0, 0)
    assert find_groups(["a"]) == LayerGroups(1, 0, 0)
    assert layer_groups(_config({**HYBRID_BASE, "model_type": "qwen3_5_text", "num_hidden_layers": 3,
                                 "layer_types": [G, A, G]})) == LayerGroups(3, 0, 0)


def test_finder_maximizes_scanned_layers_then_prefers_short_periods():
    assert find_groups(list("xabab" "ab" "y")) == LayerGroups(1, 2, 3)
    assert find_groups(list("aaaa")) == LayerGroups(0, 1, 4)  # not a period of 2 twice
    assert find_groups(list("abcabcab")) == LayerGroups(0, 3, 2)  # 6 layers scanned beats "ab" x ...
    assert find_groups(list("aab" "aab" "aab" "aaaa")) == LayerGroups(0, 3, 3)


def test_param_shapes_break_a_period():
    """Two layers the config calls alike but whose params differ (a bias in one) are not one body."""
    cfg = _config({**QWEN3_BASE, "model_type": "qwen3", "num_hidden_layers": 4})
    layers = [{"w": jnp.zeros((2, 2))} for _ in range(4)]
    assert layer_groups(cfg, layers) == LayerGroups(0, 1, 4)
    layers[2] = {"w": jnp.zeros((2, 2)), "b": jnp.zeros(2)}
    assert layer_groups(cfg, layers) == LayerGroups(0, 1, 2)


# ------------------------------------------------------------------------------ same numbers


@pytest.fixture(scope="module", params=["qwen3_5_moe", "kimi_linear"])
def model(request, tmp_path_factory):
    raw = {"qwen3_5_moe": QWEN_MOE, "kimi_linear": KIMI}[request.param]
    folder = write_random_checkpoint(raw, tmp_path_factory.mktemp(request.param), dtype="float32", seed=3,
                                     init_std=0.2)
    m = load_model(folder, dtype="float32", progress=False)
    return dataclasses.replace(m, config=dataclasses.replace(m.config, kernels="jnp"))


def _schedule(params, cfg):
    """A prefill snapshotting a row at 64, a decode step snapshotting a row after its token, and a
    mixed step whose new row restores the first snapshot beside a decode: (logits, pools) of each."""
    plan = pool_mod.plan_pools(cfg, jnp.float32, page_size=PAGE, max_seqs=4, num_pages=24, num_slots=8)
    pools = pool_mod.init_pools(plan, cfg, jnp.float32)
    rng = np.random.default_rng(0)
    a, b = rng.integers(0, cfg.vocab_size, 65).tolist(), rng.integers(0, cfg.vocab_size, 63).tolist()
    c = a[:64] + rng.integers(0, cfg.vocab_size, 9).tolist()
    pa, pb, pc = [1, 2, 3, 4, 5], [6, 7, 8, 9], [10, 11, 12, 13, 14]
    steps = [
        [runner.RowSpec(tokens=a, start=0, pages=pa, slot=1, snapshots=[(64, 5)]),
         runner.RowSpec(tokens=b, start=0, pages=pb, slot=2)],
        [runner.RowSpec(tokens=[3], start=65, pages=pa, slot=1),
         runner.RowSpec(tokens=[4], start=63, pages=pb, slot=2, snapshots=[(1, 6)])],
        [runner.RowSpec(tokens=c[64:], start=64, pages=pc, slot=3, restore_src=5),
         runner.RowSpec(tokens=[5], start=66, pages=pa, slot=1)],
    ]
    out = []
    for rows in steps:
        step, pools = runner.step(params, cfg, pools, runner.make_batch(rows, BUCKETS), return_logits=True)
        out.append((np.asarray(step.logits)[: len(rows)], jax.tree.map(np.asarray, pools)))
    return out


def _close(ours, theirs, what):
    err, scale = np.max(np.abs(ours - theirs), initial=0), max(np.max(np.abs(theirs), initial=0), 1.0)
    assert err <= TOL * scale, f"{what}: max |Δ| {err:.3g} > {TOL} · {scale:.3g}"


def test_stacked_equals_list(model):
    cfg, params = model.config, model.params
    stacked = decoder.stack_layers(cfg, params)
    groups = decoder.stacked_groups(stacked)
    assert groups == layer_groups(cfg) and groups.repeats == 2 and decoder.is_stacked(stacked)
    assert len(stacked["layers"]["head"]) == groups.prefix and len(stacked["layers"]["tail"]) > 0
    for (logits, pools), (ref_logits, ref_pools) in zip(_schedule(stacked, cfg), _schedule(params, cfg)):
        _close(logits, ref_logits, "logits")
        for name, ours, theirs in zip(pools._fields, pools, ref_pools):
            _close(ours, theirs, name)


def test_deepstack_at_a_traced_layer(model):
    """Deepstack levels (added after layers 0..k-1, some of them inside the scan) through the dense
    forward with images: the same logits and state as the list layout."""
    cfg, params = model.config, model.params
    if cfg.is_mla:
        pytest.skip("multimodal rotary positions: the Qwen hybrids")
    cfg = dataclasses.replace(cfg, mrope_section=(2, 1, 1))  # as a multimodal checkpoint's text config has
    B, T, N, k = 2, 40, 6, 6  # levels after layers 0..5: the head-less period's first 1.5 repetitions
    rng = np.random.default_rng(1)
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (B, T)), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    row = np.full((B, T), -1, np.int32)
    row[0, 3:9] = np.arange(N)
    images = decoder.Images(row=jnp.asarray(row), embeds=jnp.asarray(0.1 * rng.normal(size=(N, cfg.hidden_size)), jnp.float32),
                            deepstack=jnp.asarray(0.1 * rng.normal(size=(k, N, cfg.hidden_size)), jnp.float32),
                            rope_pos=jnp.repeat(positions[..., None], 3, axis=-1))
    out = []
    for p in (decoder.stack_layers(cfg, params), params):
        state = decoder.init_state(cfg, B, 64, jnp.float32)
        logits, state = decoder.forward(p, cfg, tokens, positions, state, images=images)
        out.append((np.asarray(logits), jax.tree.map(np.asarray, state)))
    _close(out[0][0], out[1][0], "logits")
    for ours, theirs in zip(out[0][1], out[1][1]):
        _close(ours, theirs, "state")
    no_deep = images._replace(deepstack=images.deepstack[:0])
    logits, _ = decoder.forward(params, cfg, tokens, positions, decoder.init_state(cfg, B, 64, jnp.float32), images=no_deep)
    assert np.max(np.abs(np.asarray(logits) - out[1][0])) > 1e-3  # the levels do change the result


# ------------------------------------------------------------------------------ one body per period


def _decode_hlo(params, cfg) -> str:
    plan = pool_mod.plan_pools(cfg, jnp.float32, page_size=PAGE, max_seqs=4, num_pages=24, num_slots=8)
    pools = jax.eval_shape(lambda: pool_mod.init_pools(plan, cfg, jnp.float32))
    program = next(p for p in BUCKETS.programs() if p[3])
    return runner.lower_step(params, cfg, pools, BUCKETS, program).compile().as_text()


def test_decode_program_holds_each_layer_body_once(model):
    """The GDN / KDA in-projection (``[T, H] @ [H, conv_dim (+ z, b, a)]``) appears once per linear layer of the
    period plus each unscanned one (list layout: once per linear layer), inside one while loop whose
    trip count is the repetitions; no pool is copied. (A dense MLP's ``gate_up_proj`` of the same
    width counts as one more product of its layer.)"""
    cfg, params = model.config, model.params
    groups = layer_groups(cfg)
    stacked = decoder.stack_layers(cfg, params)
    width = cfg.linear_conv_dim + (0 if cfg.kda else cfg.linear_value_dim + 2 * cfg.linear_num_value_heads)  # GDN: q k v | z | b | a
    per_layer = [(t == G) + (not moe and 2 * cfg.intermediate_size == width)
                 for t, moe in zip(cfg.layer_types, cfg.moe_layers)]
    scanned = sum(per_layer[groups.prefix:groups.prefix + groups.period])
    unscanned = sum(per_layer[:groups.prefix]) + sum(per_layer[groups.tail_start:])
    proj = re.compile(rf"f32\[4,{width}\]\{{[^}}]*\}} dot\(")
    list_text, stacked_text = _decode_hlo(params, cfg), _decode_hlo(stacked, cfg)
    assert len(proj.findall(list_text)) == sum(per_layer)
    assert len(proj.findall(stacked_text)) == scanned + unscanned
    def layer_loops(text):  # the step's own top-level loops (the scan), not those inside a layer's ops
        return [line for line in text.splitlines() if " while(" in line and 'op_name="jit(_step)/while"' in line]

    assert layer_loops(list_text) == []
    (scan,) = layer_loops(stacked_text)
    assert f'"known_trip_count":{{"n":"{groups.repeats}"}}' in scan
    # the pools ride the carry in place: no op copies a whole pool (per iteration or at all)
    pools = jax.eval_shape(lambda: pool_mod.init_pools(
        pool_mod.plan_pools(cfg, jnp.float32, page_size=PAGE, max_seqs=4, num_pages=24, num_slots=8), cfg, jnp.float32))
    for pool in pools:
        shape = ",".join(map(str, pool.shape))
        assert not re.search(rf"= f32\[{shape}\]\{{[^}}]*\}} copy\(", stacked_text), f"a copy of a {pool.shape} pool"


def _stacked_equals_list(raw: dict, folder, seed: int, kernels: str):
    """A random [G, A] x 2 checkpoint of ``raw`` run with ``kernels`` through ``_schedule`` stacked
    (two repetitions of a 2-layer period) and as a list: logits and every pool agree. Returns
    (config, stacked params)."""
    m = load_model(write_random_checkpoint(raw, folder, dtype="float32", seed=seed, init_std=0.2), dtype="float32",
                   progress=False)
    cfg = dataclasses.replace(m.config, kernels=kernels)
    stacked = decoder.stack_layers(cfg, m.params)
    assert decoder.stacked_groups(stacked) == LayerGroups(0, 2, 2)
    for (logits, pools), (ref_logits, ref_pools) in zip(_schedule(stacked, cfg), _schedule(m.params, cfg)):
        _close(logits, ref_logits, "logits")
        for name, ours, theirs in zip(pools._fields, pools, ref_pools):
            _close(ours, theirs, name)
    return cfg, stacked


def test_kernels_take_the_traced_layer(tmp_path):
    """The Mosaic GPU kernels (interpreted: GDN chunked prefill and decode, conv1d, paged attention)
    index the pools with the scan's traced layer: the stacked layout gives the list layout's numbers."""
    from tests.engine.test_runner import KERNEL_CONFIG

    _stacked_equals_list({**KERNEL_CONFIG, "num_hidden_layers": 4, "layer_types": [G, A] * 2}, tmp_path, 5,
                         "pallas-interpret")


def test_moe_kernel_reads_the_stack_in_place(tmp_path):
    """Under the scan the MoE kernel gets the whole stack of the period's experts (``[n * E, ...]``)
    and the layer's row as an offset: lowered for the GPU, every Mosaic GPU call of a mixed step's
    program takes the stack (a row passed as an operand would be copied out every step); interpreted,
    the numbers are the list layout's."""
    cfg, stacked = _stacked_equals_list({**QWEN_MOE, "num_hidden_layers": 4, "layer_types": [G, A] * 2}, tmp_path,
                                        6, "interpret:moe")

    gpu_cfg = dataclasses.replace(cfg, kernels="moe")
    params = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, jnp.bfloat16), stacked)
    plan = pool_mod.plan_pools(gpu_cfg, jnp.bfloat16, page_size=PAGE, max_seqs=4, num_pages=24, num_slots=8)
    pools = jax.eval_shape(lambda: pool_mod.init_pools(plan, gpu_cfg, jnp.bfloat16))
    T = 32  # a mixed step: 64 routed rows, the grouped kernel (a decode step of 1 row takes the gather path)
    batch = runner.padding_batch(T, BUCKETS.rows_for(T), BUCKETS.snapshot_sizes(T, False)[-1], BUCKETS.pages_per_seq,
                                 False)
    text = runner._step.trace(params, gpu_cfg, pools, batch, runner.feed_buffer(BUCKETS.seqs[-1]), False).lower(
        lowering_platforms=("cuda",)).as_text()
    calls = [line for line in text.splitlines() if "custom_call @mosaic_gpu" in line]
    E, H, I = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
    assert calls and all(f"tensor<{2 * E}x{H}x{2 * I}xbf16>" in c or f"tensor<{2 * E}x{I}x{H}xbf16>" in c
                         for c in calls), calls


def test_small_linear_kernel_reads_the_stack_in_place(tmp_path):
    """Decode steps' projections through ``pallas_kernels.linear_small`` (``kernels="linear"``):
    interpreted, the stacked layout gives the list layout's numbers and the list layout the jnp
    path's; lowered for the GPU in bf16, the stacked decode program's kernel calls take whole
    stacks of the period's weights (``[2, K, N]``: a row passed as an operand would be copied out
    every step) or the LM head, and the mixed step's layers stay on XLA's dot."""
    raw = {**QWEN_MOE, "num_hidden_layers": 4, "layer_types": [G, A] * 2}
    cfg, stacked = _stacked_equals_list(raw, tmp_path / "k", 8, "interpret:linear")
    m = load_model(write_random_checkpoint(raw, tmp_path / "k", dtype="float32", seed=8, init_std=0.2),
                   dtype="float32", progress=False)
    for (logits, pools), (ref_logits, ref_pools) in zip(_schedule(m.params, cfg),
                                                        _schedule(m.params, dataclasses.replace(cfg, kernels="jnp"))):
        _close(logits, ref_logits, "logits vs jnp")
        for name, ours, theirs in zip(pools._fields, pools, ref_pools):
            _close(ours, theirs, f"{name} vs jnp")

    gpu_cfg = dataclasses.replace(cfg, kernels="linear")
    params = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, jnp.bfloat16), stacked)
    plan = pool_mod.plan_pools(gpu_cfg, jnp.bfloat16, page_size=PAGE, max_seqs=4, num_pages=24, num_slots=8)
    pools = jax.eval_shape(lambda: pool_mod.init_pools(plan, gpu_cfg, jnp.bfloat16))

    def mosaic_calls(T, decode):
        S = BUCKETS.snapshot_sizes(T, decode)[-1]
        batch = runner.padding_batch(T, 4 if decode else BUCKETS.rows_for(T), S, BUCKETS.pages_per_seq, decode)
        text = runner._step.trace(params, gpu_cfg, pools, batch, runner.feed_buffer(BUCKETS.seqs[-1]),
                                  decode).lower(lowering_platforms=("cuda",)).as_text()
        return [line for line in text.splitlines() if "custom_call @mosaic_gpu" in line]

    H, V = cfg.hidden_size, cfg.vocab_size
    head = f"tensor<1x{H}x{V}xbf16>"  # the LM head: one "layer" [1, K, N]
    decode_calls = mosaic_calls(4, True)
    # (jitted, each kernel is a private function, one per distinct shape) 2 repetitions, K = 64 unsplit
    stacks = [c for c in decode_calls if re.search(r"tensor<2x\d+x\d+xbf16>", c)]
    assert stacks and len(stacks) + sum(head in c for c in decode_calls) == len(decode_calls), decode_calls
    assert any(head in c for c in decode_calls)
    assert all(head in c for c in mosaic_calls(128, False))  # a mixed step: the LM head's few rows only
