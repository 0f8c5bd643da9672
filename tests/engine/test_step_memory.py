"""The serving step's XLA temporaries (what start-up reserves beside params and pools) stay those of
one layer's activations, at a token bucket, whatever the depth, the page-table width or the expert
count.

Each case compiles the prefill step program of a small random-shaped qwen3_5_moe (``ShapeDtypeStruct``
params and pools, ``runner.lower_step`` through ``startup.StepCompiler``, as start-up does) on the CPU
and reads ``Compiled.memory_analysis()``. Three ways the step used to grow, each one a fix pinned here
(numbers at the real size: benchmarks/RESULTS.md "Step memory (CPU compile analysis)"):

- depth: XLA merged the identical zero-filled buffers every GDN layer's chunked rule starts from,
  gave each layer a copy and scheduled all the copies before the first layer, so temporaries grew
  with every layer (``decoder._scoped`` runs each layer of a prefill step as a loop body of its own);
- page-table width: attention gathered each token's whole row of the page table, [T, W] (now only
  the page it writes and one key block's pages at a time);
- experts: ``lax.ragged_dot`` lowers to a dense dot over every expert, [T * top_k, E * H] for the
  whole step (now a block of tokens at a time, ``layers.routed_experts_blocked``, within
  ``MOE_EXPANSION_BYTES``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from jaxserve.config import ModelConfig
from jaxserve.engine import runner, startup
from jaxserve.engine.pools import plan_pools
from jaxserve.models import decoder, layers
from jaxserve.models.params import abstract_params

MiB = 1 << 20
T = 512        # token bucket of the compiled prefill step
MAX_SEQS = 8
PAGE_SIZE = 16
HIDDEN, TOP_K, EXPERT_INTER = 128, 8, 64


def config(num_layers: int = 4, experts: int = 64) -> ModelConfig:
    """A qwen3_5_moe of the real one's structure (GDN : attention 3 : 1, gated attention with
    partial multimodal rotary, routed + gated shared experts, untied lm_head) at small widths."""
    raw = {
        "model_type": "qwen3_5_moe_text", "hidden_size": HIDDEN, "num_hidden_layers": num_layers,
        "layer_types": (["linear_attention"] * 3 + ["full_attention"]) * (num_layers // 4),
        "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 64, "attn_output_gate": True,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.25,
                            "mrope_section": [11, 11, 10], "mrope_interleaved": True},
        "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 32,
        "linear_value_head_dim": 32, "linear_conv_kernel_dim": 4,
        "num_experts": experts, "num_experts_per_tok": TOP_K, "moe_intermediate_size": EXPERT_INTER,
        "shared_expert_intermediate_size": EXPERT_INTER, "norm_topk_prob": True,
        "vocab_size": 1024, "tie_word_embeddings": False, "max_position_embeddings": 262144,
        "rms_norm_eps": 1e-6, "eos_token_id": 2,
    }
    return ModelConfig.from_hf(raw, source="test_step_memory")


def prefill_temp(cfg: ModelConfig, max_model_len: int = 4096, decode: bool = False, stacked: bool = False) -> int:
    """XLA's temporaries of the T-token prefill step program (``decode``: the MAX_SEQS-row decode
    step's), fp32, compiled as start-up does; ``stacked``: with the params in the decoder's stacked
    layout (the engine's), whose repeating layers run as one scan."""
    dtype = jnp.float32
    buckets = runner.Buckets.for_limits(max_prefill_tokens=T, max_seqs=MAX_SEQS, max_model_len=max_model_len,
                                        page_size=PAGE_SIZE)
    plan = plan_pools(cfg, dtype, page_size=PAGE_SIZE, max_seqs=MAX_SEQS, num_pages=1024, num_slots=2 * MAX_SEQS + 1)
    program = ((MAX_SEQS, MAX_SEQS, buckets.snapshot_sizes(MAX_SEQS, True)[-1], True) if decode else
               (T, buckets.rows_for(T), buckets.snapshot_sizes(T, False)[-1], False))
    params = abstract_params(cfg, dtype)
    if stacked:
        params = decoder.stack_layers(cfg, params, decoder.stack_structs)
    mem = startup.StepCompiler(params, cfg, buckets).compile(
        program, startup.pool_structs(cfg, dtype, plan))
    return mem.temp_bytes


@pytest.fixture(scope="module")
def small_blocks():
    """An expansion budget of 4 MiB, so the routed experts run in blocks at this size (16 tokens:
    ``moe_token_block``'s floor) as they do in 256 MiB at the real one."""
    mp = pytest.MonkeyPatch()
    mp.setattr(layers, "MOE_EXPANSION_BYTES", 4 * MiB)
    yield
    mp.undo()


@pytest.fixture(scope="module")
def base(small_blocks) -> int:
    return prefill_temp(config())


def test_temporaries_do_not_grow_with_depth(base):
    """8 layers need what 4 do (one layer's activations at a time); the old step needed 24 % more
    here (165.6 -> 205.0 MiB), and at the real size 24 layers needed 2.4x what 4 did at 8192
    tokens (53.3 and 22.0 GiB)."""
    deeper = prefill_temp(config(num_layers=8))
    assert deeper <= 1.05 * base, f"8 layers: {deeper / MiB:.1f} MiB of temporaries, 4 layers: {base / MiB:.1f} MiB"


def test_decode_temporaries_do_not_grow_with_depth():
    """Nor do a decode step's (its layers run inline, each behind a barrier with its weights): the
    old one kept every layer's relaid-out expert weights at once, +24 MiB from 4 to 8 layers here."""
    base, deeper = (prefill_temp(config(num_layers=n), decode=True) for n in (4, 8))
    assert deeper <= 1.05 * base, f"8 layers: {deeper / MiB:.1f} MiB of temporaries, 4 layers: {base / MiB:.1f} MiB"


@pytest.mark.parametrize("decode", [False, True])
def test_stacked_temporaries_do_not_grow_with_depth(small_blocks, decode):
    """The stacked layout's scan: 3 repetitions of the period need what 2 do, and 2 need at most a
    layer's weights more than the list layout's 4 layers (each iteration reads one layer's row of
    the stacked weights, which XLA may lay out apart: a dynamic slice)."""
    two, three = (prefill_temp(config(num_layers=n), decode=decode, stacked=True) for n in (8, 12))
    assert three <= 1.05 * two, f"12 layers: {three / MiB:.1f} MiB of temporaries, 8 layers: {two / MiB:.1f} MiB"
    cfg = config()
    one_layer = sum(x.size * 4 for x in jax.tree.leaves(abstract_params(cfg, jnp.float32)["layers"][0]))
    listed = prefill_temp(cfg, decode=decode)
    assert two <= 1.05 * listed + one_layer, f"stacked: {two / MiB:.1f} MiB, list: {listed / MiB:.1f} MiB"


def test_temporaries_do_not_grow_with_the_page_table(base):
    """A 256k-token page table (W = 16384 pages a row) costs at most a few copies of the table
    itself ([B, W] int32, 512 KiB here), not a row of it per token ([T, W]: 32 MiB)."""
    wide = prefill_temp(config(), max_model_len=262144)
    table = MAX_SEQS * (262144 // PAGE_SIZE) * 4
    assert wide - base <= 4 * table, f"W = 16384: +{(wide - base) / MiB:.1f} MiB of temporaries over W = 256"


def test_routed_experts_are_bounded_by_the_expansion_budget(base):
    """64 experts cost at most a few expansion blocks (and the weights ``ragged_dot`` lays out
    again) more than 8 do; the dense expansion of the whole step would be
    T * top_k * 56 * H * 4 bytes = 112 MiB more."""
    few = prefill_temp(config(experts=8))
    block = layers.moe_token_block(64, TOP_K, HIDDEN, EXPERT_INTER, 4)
    expansion = block * TOP_K * 64 * HIDDEN * 4
    weights = 64 * HIDDEN * 3 * EXPERT_INTER * 4  # one layer's gate_up + down
    assert base - few <= 3 * expansion + 2 * weights, (
        f"64 experts: +{(base - few) / MiB:.1f} MiB of temporaries over 8 (block of {block} tokens: "
        f"{expansion / MiB:.1f} MiB of expansion)")
