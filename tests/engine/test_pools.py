"""Pool sizing: from a memory budget or explicit counts, with clear errors when nothing fits."""

from __future__ import annotations

import jax.numpy as jnp
import pytest

from jaxserve.config import ModelConfig
from jaxserve.engine.pools import MiB, PoolPlan, init_pools, page_bytes, plan_pools, slot_bytes

HYBRID = ModelConfig(
    model_type="qwen3_5", vocab_size=512, hidden_size=64, num_layers=4,
    layer_types=("linear_attention", "full_attention", "linear_attention", "full_attention"), rms_norm_eps=1e-6,
    tie_word_embeddings=True, hidden_act="silu", num_heads=4, num_kv_heads=2, head_dim=32, rope_theta=1e4,
    rotary_dim=8, attention_bias=False, attn_output_gate=True, zero_centered_norm=True, sliding_window=None,
    intermediate_size=96, moe_layers=(False,) * 4, linear_conv_kernel=4, linear_num_key_heads=2,
    linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16)
PLAIN = ModelConfig(
    model_type="qwen3", vocab_size=512, hidden_size=64, num_layers=3, layer_types=("full_attention",) * 3,
    rms_norm_eps=1e-6, tie_word_embeddings=True, hidden_act="silu", num_heads=4, num_kv_heads=2, head_dim=32,
    rope_theta=1e4, rotary_dim=32, attention_bias=False, attn_output_gate=False, zero_centered_norm=False,
    sliding_window=None, intermediate_size=96, moe_layers=(False,) * 3, linear_conv_kernel=0)


def test_unit_sizes():
    # 2 attention layers x (k + v) x 16 tokens x 2 heads x 32 dims x 2 bytes
    assert page_bytes(HYBRID, jnp.bfloat16, 16) == 2 * 2 * 16 * 2 * 32 * 2
    # 2 GDN layers x (conv 128 ch x 3 x 2 bytes + rec 4 x 16 x 16 x 4 bytes)
    assert slot_bytes(HYBRID, jnp.bfloat16) == 2 * (128 * 3 * 2 + 4 * 16 * 16 * 4)
    assert slot_bytes(PLAIN, jnp.bfloat16) == 0


def test_plan_from_budget_splits_slots_then_kv():
    pb, sb = page_bytes(HYBRID, jnp.bfloat16, 16), slot_bytes(HYBRID, jnp.bfloat16)
    budget, params = 64 * MiB, 10 * MiB
    plan = plan_pools(HYBRID, jnp.bfloat16, page_size=16, max_seqs=8, mem_bytes=budget, param_bytes=params,
                      snapshot_fraction=0.25)
    avail = budget - params
    spare = avail - 9 * pb - 9 * sb
    assert plan.num_slots == 9 + int(0.25 * spare) // sb
    assert plan.num_pages == (avail - plan.num_slots * sb) // pb
    assert plan.total_bytes <= avail < plan.total_bytes + pb
    assert plan.state_bytes == pytest.approx(0.25 * avail, rel=0.01)


def test_plan_plain_attention_is_all_kv():
    plan = plan_pools(PLAIN, jnp.bfloat16, page_size=64, max_seqs=4, mem_bytes=8 * MiB)
    assert plan.num_slots == 0 and plan.num_pages == 8 * MiB // page_bytes(PLAIN, jnp.bfloat16, 64)
    pools = init_pools(PoolPlan(64, 5, 0, plan.page_bytes, 0), PLAIN, jnp.bfloat16)
    assert pools.k.shape == (3, 5, 64, 2, 32) and pools.conv.size == 0 and pools.rec.size == 0


def test_init_pools_shapes_and_dtypes():
    plan = plan_pools(HYBRID, jnp.bfloat16, page_size=32, max_seqs=2, num_pages=7, num_slots=5)
    pools = init_pools(plan, HYBRID, jnp.bfloat16)
    assert pools.k.shape == pools.v.shape == (2, 7, 32, 2, 32) and pools.k.dtype == jnp.bfloat16
    assert pools.conv.shape == (2, 5, 128, 3) and pools.conv.dtype == jnp.bfloat16
    assert pools.rec.shape == (2, 5, 4, 16, 16) and pools.rec.dtype == jnp.float32
    assert plan.total_bytes == sum(x.nbytes for x in pools)


def test_plan_errors():
    with pytest.raises(ValueError, match=r"need [\d.]+ MiB for params .* have 1.0 MiB"):
        plan_pools(HYBRID, jnp.bfloat16, page_size=16, max_seqs=8, mem_bytes=1 * MiB, param_bytes=1 * MiB)
    for ps in (24, 128, 0):
        with pytest.raises(ValueError, match="must divide 64"):
            plan_pools(HYBRID, jnp.bfloat16, page_size=ps, max_seqs=8, num_pages=100, num_slots=100)
    with pytest.raises(ValueError, match="too small"):
        plan_pools(HYBRID, jnp.bfloat16, page_size=16, max_seqs=8, num_pages=100, num_slots=4)
    with pytest.raises(ValueError, match="have 1.0 MiB"):
        plan_pools(HYBRID, jnp.bfloat16, page_size=16, max_seqs=8, num_pages=10_000, num_slots=9, mem_bytes=MiB)
    with pytest.raises(ValueError, match="mem_bytes"):
        plan_pools(HYBRID, jnp.bfloat16, page_size=16, max_seqs=8)
