"""The HF config (``config.json``, text config) of a ground-truth model: the shipped sizes, the
MoE variant, and ``--config KEY=VALUE`` overrides.

The dense model is a qwen3_5_text hybrid (every 4th layer full attention, as Qwen3.5); the MoE
variant (qwen3_5_moe_text) has the same mixer and a shared expert as wide as the dense MLP, so a
dense export upcycles into it exactly (``start.upcycle_dense_mlp``).
"""

from __future__ import annotations

import json

_COMMON = dict(
    hidden_act="silu", rms_norm_eps=1e-6, attention_bias=False, attention_dropout=0.0,
    linear_conv_kernel_dim=4, max_position_embeddings=8192, tie_word_embeddings=True,
    initializer_range=0.02, use_cache=True, bos_token_id=None, pad_token_id=None,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
)


def _layer_types(n: int, every: int = 4) -> list[str]:
    """GDN : full attention = (every - 1) : 1 (every ``every``-th layer full attention; 4 as Qwen3.5)."""
    return ["full_attention" if (i + 1) % every == 0 else "linear_attention" for i in range(n)]


# Derived override keys (not HF config keys) accepted by ``model_config``'s ``overrides``.
DERIVED_OVERRIDES = ("partial_rotary_factor", "attention_every")


def _apply_overrides(cfg: dict, overrides: dict) -> dict:
    """``cfg`` with ``overrides``: keys of the HF config replace their values; ``partial_rotary_factor``
    goes into ``rope_parameters``; ``attention_every=N`` makes every N-th layer full attention
    (``layer_types`` is rebuilt too when ``num_hidden_layers`` changes). Unknown keys raise."""
    unknown = sorted(k for k in overrides if k not in cfg and k not in DERIVED_OVERRIDES)
    if unknown:
        raise ValueError(f"unknown config override(s) {unknown}; allowed: the model's HF config keys "
                         f"{sorted(cfg)} and {list(DERIVED_OVERRIDES)}")
    cfg = {**cfg, **{k: v for k, v in overrides.items() if k not in DERIVED_OVERRIDES}}
    if "partial_rotary_factor" in overrides:
        f = overrides["partial_rotary_factor"]
        if not isinstance(f, (int, float)) or not 0 < f <= 1:
            raise ValueError(f"partial_rotary_factor must be in (0, 1], got {f!r}")
        cfg["rope_parameters"] = {**cfg["rope_parameters"], "partial_rotary_factor": float(f)}
    every = overrides.get("attention_every")
    if every is not None and (not isinstance(every, int) or isinstance(every, bool) or every < 1):
        raise ValueError(f"attention_every must be a positive integer, got {every!r}")
    if "layer_types" in overrides and ("attention_every" in overrides or len(cfg["layer_types"]) != cfg["num_hidden_layers"]):
        raise ValueError("layer_types override conflicts with attention_every / num_hidden_layers")
    if "layer_types" not in overrides and (every is not None or "num_hidden_layers" in overrides):
        cfg["layer_types"] = _layer_types(cfg["num_hidden_layers"], every or 4)
    return cfg


def model_config(vocab_size: int, *, moe_variant: bool, smoke: bool, overrides: dict | None = None) -> dict:
    """The HF config.json (text config) of the model to train; ``overrides`` (``--config KEY=VALUE``)
    change it, see ``_apply_overrides``. The MoE variant's shared expert is as wide as the dense
    MLP (``shared_expert_intermediate_size == intermediate_size``), so a dense export upcycles into
    it exactly (``start.upcycle_dense_mlp``); its routed experts are narrow, to stay in the export budget."""
    if smoke:
        size = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=2,
                    num_key_value_heads=1, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=2,
                    linear_key_head_dim=8, linear_value_head_dim=8)
        moe_size = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8, shared_expert_intermediate_size=64)
    else:
        size = dict(hidden_size=256, intermediate_size=768, num_hidden_layers=8, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=64, linear_num_key_heads=4, linear_num_value_heads=8,
                    linear_key_head_dim=32, linear_value_head_dim=32)
        moe_size = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=768)
    cfg = {**_COMMON, **size, "vocab_size": vocab_size, "layer_types": _layer_types(size["num_hidden_layers"])}
    if moe_variant:
        cfg.pop("intermediate_size")
        cfg.update(moe_size, router_aux_loss_coef=0.001, output_router_logits=False)
        cfg = {"architectures": ["Qwen3_5MoeForCausalLM"], "model_type": "qwen3_5_moe_text", **cfg}
    else:
        cfg = {"architectures": ["Qwen3_5ForCausalLM"], "model_type": "qwen3_5_text", **cfg}
    return _apply_overrides(cfg, overrides) if overrides else cfg


def parse_config_overrides(items: list[str] | None) -> dict:
    """``["KEY=VALUE", ...]`` (``--config``) -> dict; VALUE is JSON (``1.0``, ``2``, ``true``, ``[...]``),
    or the bare string where it is not valid JSON."""
    out: dict = {}
    for item in items or ():
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--config expects KEY=VALUE, got {item!r}")
        try:
            out[key.strip()] = json.loads(value)
        except json.JSONDecodeError:
            out[key.strip()] = value
    return out
