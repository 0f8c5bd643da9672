"""Tiny random checkpoints of every supported family, written by transformers itself.

Runs in the torch reference environment (it imports transformers):

    python -m weights.tiny --family qwen3_5 --variant dense --out DIR [--seed 0]
    python -m weights.tiny --list

Each variant is a real ``save_pretrained`` folder (config.json, model.safetensors, tokenizer files,
generation_config.json), ~1 MB, so the loader and the models are tested against exactly what the
Hugging Face format holds. The variants differ where the families differ: MoE and dense, tied and
untied embeddings, head counts and dims, partial rotary, the multimodal wrapper, fused vs split
GDN projections. Weights are drawn with a larger init range than transformers' default so greedy
decoding has clear margins instead of near-ties.
"""

from __future__ import annotations

import argparse
import sys

VOCAB = 512
INIT_RANGE = 0.1

HYBRID_BASE = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-6,
    layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
    linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=16,
    linear_num_key_heads=2, linear_num_value_heads=4, max_position_embeddings=4096,
    initializer_range=INIT_RANGE,
)

# family -> variant -> (config overrides, multimodal wrapper?)
VARIANTS: dict[str, dict[str, tuple[dict, bool]]] = {
    "qwen3_5": {
        "dense": ({"tie_word_embeddings": True, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25}}, False),
        "untied": ({"tie_word_embeddings": False, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 64,
                    "linear_num_key_heads": 2, "linear_num_value_heads": 2, "linear_key_head_dim": 32, "linear_value_head_dim": 16,
                    "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"],
                    "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0, "partial_rotary_factor": 0.5}}, False),
        "vl": ({"tie_word_embeddings": False, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25, "mrope_section": [2, 1, 1]}}, True),
    },
    "qwen3_5_moe": {
        "moe": ({"tie_word_embeddings": False, "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                 "shared_expert_intermediate_size": 48, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25}}, False),
        "moe_tied": ({"tie_word_embeddings": True, "num_experts": 4, "num_experts_per_tok": 1, "moe_intermediate_size": 48,
                      "shared_expert_intermediate_size": 32, "num_attention_heads": 8, "num_key_value_heads": 8, "head_dim": 16,
                      "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 1.0}}, False),
        "vl": ({"tie_word_embeddings": False, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                "shared_expert_intermediate_size": 48, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                "partial_rotary_factor": 0.5, "mrope_section": [4, 2, 2]}}, True),
    },
    "qwen3_next": {
        "moe": ({"tie_word_embeddings": False, "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                 "shared_expert_intermediate_size": 48, "norm_topk_prob": True,
                 "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25}}, False),
        "sparse_step": ({"tie_word_embeddings": True, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                         "shared_expert_intermediate_size": 32, "norm_topk_prob": False, "decoder_sparse_step": 2,
                         "linear_num_key_heads": 1, "linear_num_value_heads": 4,
                         "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}}, False),
        "dense": ({"tie_word_embeddings": False, "num_experts": 0,
                   "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25}}, False),
    },
    "qwen3": {
        "base": ({"tie_word_embeddings": True}, False),
        "untied": ({"tie_word_embeddings": False, "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 16,
                    "attention_bias": True, "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0}}, False),
    },
    # Qwen3-VL: a plain-attention Qwen3 text model behind the same kind of tower, with deepstack.
    "qwen3_vl": {
        "vl": ({"tie_word_embeddings": False, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                "mrope_section": [6, 5, 5], "mrope_interleaved": True}}, True),
    },
}

# The vision tower of every multimodal variant (patch 8, merge 2: one soft token per 16x16 pixels).
VISION_BASE = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=8, spatial_merge_size=2,
                   temporal_patch_size=2, num_position_embeddings=16, initializer_range=INIT_RANGE)
# Special tokens of the multimodal variants, just under the tiny tokenizer's own specials: their
# tokenizer has them as special tokens at these ids (``VISION_SPECIALS``), as Qwen's tokenizers do.
IMAGE_TOKENS = dict(image_token_id=VOCAB - 4, video_token_id=VOCAB - 5, vision_start_token_id=VOCAB - 6,
                    vision_end_token_id=VOCAB - 7)
_VISION_NAMES = dict(image_token_id="<|image_pad|>", video_token_id="<|video_pad|>",
                     vision_start_token_id="<|vision_start|>", vision_end_token_id="<|vision_end|>")
VISION_SPECIALS = tuple(_VISION_NAMES[k] for k in sorted(IMAGE_TOKENS, key=IMAGE_TOKENS.get))  # in id order

# Kimi-Linear: KDA linear layers (3 of 4), MLA full attention, sigmoid-routed grouped experts with
# a selection bias (drawn at random below: transformers initialises it to zero, which would leave
# the bias path untested), shared experts, dense first layers.
KIMI_BASE = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=4, rms_norm_eps=1e-5, initializer_range=INIT_RANGE, tie_word_embeddings=False,
    kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, moe_intermediate_size=32,
    linear_attn_config={"kda_layers": [1, 2, 3], "full_attn_layers": [4], "head_dim": 16, "num_heads": 4,
                        "short_conv_kernel_size": 4},
    pad_token_id=0, bos_token_id=1, eos_token_id=2,
)
VARIANTS["kimi_linear"] = {
    "moe": ({"q_lora_rank": None, "num_experts": 4, "num_experts_per_tok": 2, "n_group": 2, "topk_group": 1,
             "first_k_dense_replace": 1, "n_shared_experts": 1}, False),
    "q_lora": ({"q_lora_rank": 24, "num_experts": 8, "num_experts_per_tok": 3, "n_group": 4, "topk_group": 2,
                "first_k_dense_replace": 0, "n_shared_experts": 2, "routed_scaling_factor": 1.5,
                "linear_attn_config": {"kda_layers": [1, 3, 4], "full_attn_layers": [2], "head_dim": 16,
                                       "num_heads": 2, "short_conv_kernel_size": 4}}, False),
}

QWEN3_BASE = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
    num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-6, max_position_embeddings=4096,
    initializer_range=INIT_RANGE, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
)


def _build(family: str, variant: str, seed: int):
    import torch
    import transformers as tf

    overrides, multimodal = VARIANTS[family][variant]
    torch.manual_seed(seed)
    if family == "qwen3":
        cfg = tf.Qwen3Config(**{**QWEN3_BASE, **overrides})
        return tf.Qwen3ForCausalLM(cfg)
    if family == "qwen3_vl":
        text = {**QWEN3_BASE, **overrides}
        tie = text.pop("tie_word_embeddings")
        vision = {**VISION_BASE, "out_hidden_size": text["hidden_size"], "deepstack_visual_indexes": [0, 1]}
        cfg = tf.Qwen3VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=tie, **IMAGE_TOKENS)
        return tf.Qwen3VLForConditionalGeneration(cfg)
    if family == "kimi_linear":
        model = tf.KimiLinearForCausalLM(tf.KimiLinearConfig(**{**KIMI_BASE, **overrides}))
        with torch.no_grad():
            for name, buf in model.named_buffers():
                if name.endswith("e_score_correction_bias"):
                    buf.normal_(0.0, 0.1)
        return model
    text_kwargs = {**HYBRID_BASE, **overrides}
    if family == "qwen3_next":
        return tf.Qwen3NextForCausalLM(tf.Qwen3NextConfig(**text_kwargs))
    if multimodal:
        tie = text_kwargs.pop("tie_word_embeddings")
        vision = {**VISION_BASE, "out_hidden_size": text_kwargs["hidden_size"]}
        if family == "qwen3_5":
            vision["depth"] = 1  # the variant the text-only differential tests have always used
        config_cls, model_cls = ((tf.Qwen3_5MoeConfig, tf.Qwen3_5MoeForConditionalGeneration) if family == "qwen3_5_moe"
                                 else (tf.Qwen3_5Config, tf.Qwen3_5ForConditionalGeneration))
        cfg = config_cls(text_config=text_kwargs, vision_config=vision, tie_word_embeddings=tie, **IMAGE_TOKENS)
        return model_cls(cfg)
    if family == "qwen3_5_moe":
        return tf.Qwen3_5MoeForCausalLM(tf.Qwen3_5MoeTextConfig(**text_kwargs))
    return tf.Qwen3_5ForCausalLM(tf.Qwen3_5TextConfig(**text_kwargs))


def write(family: str, variant: str, out: str, seed: int = 0) -> None:
    """Write the checkpoint folder; the eos token is the tokenizer's ``<|im_end|>``; a checkpoint
    with a tower gets the vision special tokens in its tokenizer."""
    from transformers import GenerationConfig

    from weights.tiny_tokenizer import save_tiny_tokenizer

    model = _build(family, variant, seed).eval()
    multimodal = VARIANTS[family][variant][1]
    tokenizer = save_tiny_tokenizer(out, VOCAB, VISION_SPECIALS if multimodal else ())
    if multimodal:
        for key, name in _VISION_NAMES.items():
            assert tokenizer.convert_tokens_to_ids(name) == IMAGE_TOKENS[key], (name, IMAGE_TOKENS[key])
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    model.config.eos_token_id = eos
    model.generation_config = GenerationConfig(eos_token_id=eos, do_sample=False)
    model.save_pretrained(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--family", choices=sorted(VARIANTS))
    ap.add_argument("--variant")
    ap.add_argument("--out")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--list", action="store_true", help="print family/variant pairs and exit")
    args = ap.parse_args(argv)
    if args.list:
        for fam, variants in VARIANTS.items():
            for var in variants:
                print(f"{fam} {var}")
        return 0
    if not (args.family and args.variant and args.out):
        ap.error("--family, --variant and --out are required")
    if args.variant not in VARIANTS[args.family]:
        ap.error(f"unknown variant {args.variant!r} for {args.family}; have {sorted(VARIANTS[args.family])}")
    write(args.family, args.variant, args.out, args.seed)
    return 0


if __name__ == "__main__":
    sys.exit(main())
