"""Model configuration read from a Hugging Face ``config.json``.

One frozen dataclass covers every supported family; each field says which HF key it comes from.
Multimodal checkpoints (``Qwen3_5ForConditionalGeneration``, ``Qwen3_5MoeForConditionalGeneration``,
``Qwen3VLForConditionalGeneration``) nest the language model's settings under ``text_config`` and the
vision tower's under ``vision_config`` (``VisionConfig``).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

SUPPORTED_MODEL_TYPES = ("qwen3", "qwen3_5", "qwen3_5_moe", "qwen3_next", "kimi_linear")

# Text-config model types map onto the family they belong to.
_TEXT_MODEL_TYPES = {"qwen3_5_text": "qwen3_5", "qwen3_5_moe_text": "qwen3_5_moe", "qwen3_vl_text": "qwen3"}

FULL_ATTENTION = "full_attention"
LINEAR_ATTENTION = "linear_attention"
SLIDING_ATTENTION = "sliding_attention"

# Linear-attention state snapshots sit on multiples of this many tokens (ARCHITECTURE.md invariant 1),
# and attention visits keys in blocks of the same size; a page size must divide it, so page, key
# block and snapshot boundaries coincide. Every part that needs the number imports it from here.
SNAPSHOT_INTERVAL = 64

# Rows of more than one token a mixed / prefill step may hold (the scheduler keeps to it): the
# GDN / KDA chunk grid of a step is sized for this many such rows (``ModelConfig.chunked_rows``).
CHUNKED_ROWS = 8


class ConfigError(ValueError):
    """A config.json that jaxserve cannot serve, with the file and key named."""


@dataclasses.dataclass(frozen=True)
class VisionConfig:
    """The Qwen3.5 / Qwen3-VL vision tower (``vision_config``) and the special tokens of its images.

    A patch is ``temporal_patch_size`` frames of ``patch_size``² pixels (a still image repeats its one
    frame); ``spatial_merge_size``² neighbouring patches merge into one soft token of the text model's
    width. ``deepstack_layers`` (Qwen3-VL): after these tower blocks an extra merger's output is added
    to the text model's hidden state at the image tokens, after text layer 0, 1, ... in that order."""

    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    patch_size: int
    temporal_patch_size: int
    spatial_merge_size: int
    in_channels: int
    out_hidden_size: int
    num_position_embeddings: int
    rope_theta: float
    hidden_act: str
    image_token_id: int
    vision_start_token_id: int
    vision_end_token_id: int
    deepstack_layers: tuple[int, ...] = ()

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_dim(self) -> int:
        """Values per flattened patch: channels x frames x pixels."""
        return self.in_channels * self.temporal_patch_size * self.patch_size**2

    @classmethod
    def from_hf(cls, raw: dict[str, Any], source: str) -> "VisionConfig":
        v = raw["vision_config"]
        try:
            act = v.get("hidden_act", "gelu_pytorch_tanh")
            if act not in ("gelu_pytorch_tanh", "gelu"):
                raise ConfigError(f"{source}: vision_config.hidden_act {act!r} is not supported")
            return cls(
                depth=v["depth"], hidden_size=v["hidden_size"], intermediate_size=v["intermediate_size"],
                num_heads=v["num_heads"], patch_size=v.get("patch_size", 16),
                temporal_patch_size=v.get("temporal_patch_size", 2), spatial_merge_size=v.get("spatial_merge_size", 2),
                in_channels=v.get("in_channels", 3), out_hidden_size=v["out_hidden_size"],
                num_position_embeddings=v["num_position_embeddings"],
                rope_theta=float((v.get("rope_parameters") or {}).get("rope_theta", 10000.0)), hidden_act=act,
                image_token_id=raw["image_token_id"], vision_start_token_id=raw["vision_start_token_id"],
                vision_end_token_id=raw["vision_end_token_id"],
                deepstack_layers=tuple(v.get("deepstack_visual_indexes") or ()),
            )
        except KeyError as e:
            raise ConfigError(f"{source}: missing required key {e.args[0]!r} for the vision tower") from None


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    model_type: str  # family: one of SUPPORTED_MODEL_TYPES
    vocab_size: int
    hidden_size: int
    num_layers: int
    layer_types: tuple[str, ...]  # per layer: full_attention | linear_attention | sliding_attention
    rms_norm_eps: float
    tie_word_embeddings: bool
    hidden_act: str

    # Full attention.
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rotary_dim: int  # head_dim * partial_rotary_factor; the rest of each head passes through
    attention_bias: bool
    attn_output_gate: bool  # q_proj also emits a sigmoid gate on the attention output (qwen3_5/next)
    zero_centered_norm: bool  # RMSNorm scales by (1 + w) instead of w (qwen3_5/next)
    sliding_window: int | None

    # Dense MLP (layers without experts).
    intermediate_size: int

    # Mixture of experts (num_experts == 0: dense everywhere).
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = True
    moe_layers: tuple[bool, ...] = ()
    # Router: "softmax" top-k (Qwen) or "sigmoid" (Kimi-Linear / DeepSeek-V3: sigmoid scores plus a
    # per-expert selection bias, the top ``topk_groups`` of ``num_expert_groups`` groups first, the
    # weights scaled by ``routed_scaling_factor``); Qwen's shared expert has a sigmoid gate, Kimi's not.
    router_scoring: str = "softmax"
    num_expert_groups: int = 1
    topk_groups: int = 1
    routed_scaling_factor: float = 1.0
    shared_expert_gate: bool = True

    # Multi-head latent attention (kimi_linear; 0: plain attention). Keys are
    # [k_nope (per head), k_rope (shared by the heads; Kimi-Linear applies no rotary to it)], so
    # ``head_dim`` = qk_nope + qk_rope is the key/query dim and ``v_head_dim`` the value dim.
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0

    # Gated DeltaNet layers.
    linear_conv_kernel: int = 4
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    fused_linear_projections: bool = False  # qwen3_next: in_proj_qkvz/in_proj_ba; qwen3_5: split ones
    # Kimi Delta Attention (kimi_linear): a per-channel decay [Hv, dk] from low-rank projections,
    # separate q/k/v projections and convs, a sigmoid-gated output norm.
    kda: bool = False

    eos_token_ids: tuple[int, ...] = ()
    max_position_embeddings: int = 32768
    has_vision_tower: bool = False
    vision: VisionConfig | None = None
    # Multimodal rotary (t, h, w): frequency i of the rotary half rotates by the h position when
    # i % 3 == 1 and i < 3 * mrope_section[1], by w when i % 3 == 2 and i < 3 * mrope_section[2], else
    # by t (the interleaved layout of Qwen3-VL / Qwen3.5). Text tokens have t = h = w, where this is
    # plain RoPE. Empty: no multimodal rotary.
    mrope_section: tuple[int, ...] = ()

    # Execution, not checkpoint: kernels or jnp references for the mixer backends (static under
    # jit): "auto" | "jnp" | "pallas" | "pallas-interpret"; jaxserve/models/backends.py says what each does.
    kernels: str = "auto"
    # Execution: the routed experts are split by expert id over the ``"tp"`` axis of the mesh the step
    # is traced under (static under jit; only ``TensorParallel.configure`` sets it), so ``layers.moe``
    # runs each device's own experts under ``shard_map`` (``layers.expert_parallel``).
    expert_parallel: bool = False
    # Execution: the engine's promise that at most this many rows of a mixed / prefill step hold more
    # than one token (the scheduler keeps it: ``CHUNKED_ROWS``, ``Buckets.chunked_rows``); 0: none. With it the
    # GDN / KDA layers run the one-token rows by the recurrent rule and size the chunk grid for the
    # others only (``gated_deltanet._mixed_rule``), not for the worst raggedness of every row.
    chunked_rows: int = 0

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def value_head_dim(self) -> int:
        """The attention value dim: ``head_dim`` except under MLA."""
        return self.v_head_dim or self.head_dim

    @property
    def is_hybrid(self) -> bool:
        return LINEAR_ATTENTION in self.layer_types

    @property
    def linear_key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def linear_value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def linear_conv_dim(self) -> int:
        """Channels of the short causal conv: q, k and v concatenated."""
        return 2 * self.linear_key_dim + self.linear_value_dim

    @classmethod
    def from_file(cls, path: str | Path) -> "ModelConfig":
        path = Path(path)
        try:
            raw = json.loads(path.read_text())
        except FileNotFoundError:
            raise ConfigError(f"{path}: no config.json; not a Hugging Face checkpoint folder") from None
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}: not valid JSON ({e})") from None
        return cls.from_hf(raw, source=str(path))

    @classmethod
    def from_hf(cls, raw: dict[str, Any], source: str = "config.json") -> "ModelConfig":
        top_type = raw.get("model_type")
        text = raw.get("text_config") or raw
        family = _TEXT_MODEL_TYPES.get(text.get("model_type"), top_type)
        if family not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(
                f"{source}: unknown model_type {top_type!r}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )

        def need(key: str) -> Any:
            if key not in text:
                raise ConfigError(f"{source}: missing required key {key!r} for model_type {family!r}")
            return text[key]

        def get(key: str, default: Any) -> Any:
            value = text.get(key)
            return default if value is None else value

        num_layers = need("num_hidden_layers")
        num_heads = need("num_attention_heads")
        hidden = need("hidden_size")
        head_dim = get("head_dim", hidden // num_heads)
        rope = get("rope_parameters", {}) or {}
        rope_theta = rope.get("rope_theta", get("rope_theta", 10000.0))
        rope_type = rope.get("rope_type", "default")
        if rope_type != "default":
            raise ConfigError(f"{source}: rope_type {rope_type!r} is not supported yet (only 'default')")
        partial = rope.get("partial_rotary_factor", get("partial_rotary_factor", 1.0))
        rotary_dim = int(head_dim * partial)

        hybrid = family != "qwen3"
        if hybrid:
            default_types = [
                FULL_ATTENTION if (i + 1) % get("full_attention_interval", 4) == 0 else LINEAR_ATTENTION
                for i in range(num_layers)
            ]
        else:
            window_layers = get("max_window_layers", num_layers)
            sliding = bool(get("use_sliding_window", False))
            default_types = [
                SLIDING_ATTENTION if sliding and i >= window_layers else FULL_ATTENTION for i in range(num_layers)
            ]
        layer_types = tuple(get("layer_types", default_types))
        if len(layer_types) != num_layers:
            raise ConfigError(f"{source}: layer_types has {len(layer_types)} entries for {num_layers} layers")
        unknown = set(layer_types) - {FULL_ATTENTION, LINEAR_ATTENTION, SLIDING_ATTENTION}
        if unknown:
            raise ConfigError(f"{source}: unsupported layer types {sorted(unknown)}")

        num_experts = get("num_experts", 0) if family in ("qwen3_5_moe", "qwen3_next") else 0
        if family == "qwen3_5_moe":
            moe_layers = tuple(True for _ in range(num_layers))
        elif num_experts:
            sparse_step = get("decoder_sparse_step", 1)
            mlp_only = set(get("mlp_only_layers", []))
            moe_layers = tuple(i not in mlp_only and (i + 1) % sparse_step == 0 for i in range(num_layers))
        else:
            moe_layers = tuple(False for _ in range(num_layers))
        if family == "qwen3_5_moe" and not num_experts:
            raise ConfigError(f"{source}: qwen3_5_moe config without num_experts")

        hidden_act = get("hidden_act", "silu")
        if hidden_act != "silu":
            raise ConfigError(f"{source}: hidden_act {hidden_act!r} is not supported (only 'silu')")

        eos = raw.get("eos_token_id", text.get("eos_token_id"))
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        tie = raw.get("tie_word_embeddings", text.get("tie_word_embeddings", False))

        fields = dict(
            model_type=family,
            vocab_size=need("vocab_size"),
            hidden_size=hidden,
            num_layers=num_layers,
            layer_types=layer_types,
            rms_norm_eps=get("rms_norm_eps", 1e-6),
            tie_word_embeddings=bool(tie),
            hidden_act=hidden_act,
            num_heads=num_heads,
            num_kv_heads=get("num_key_value_heads", num_heads),
            head_dim=head_dim,
            rope_theta=float(rope_theta),
            rotary_dim=rotary_dim,
            attention_bias=bool(get("attention_bias", False)),
            attn_output_gate=hybrid,
            zero_centered_norm=hybrid,
            sliding_window=get("sliding_window", None) if SLIDING_ATTENTION in layer_types else None,
            intermediate_size=get("intermediate_size", 0),
            num_experts=num_experts,
            num_experts_per_tok=get("num_experts_per_tok", 0) if num_experts else 0,
            moe_intermediate_size=get("moe_intermediate_size", 0) if num_experts else 0,
            shared_expert_intermediate_size=get("shared_expert_intermediate_size", 0) if num_experts else 0,
            norm_topk_prob=bool(get("norm_topk_prob", True)) if family != "qwen3_5_moe" else True,
            moe_layers=moe_layers,
            linear_conv_kernel=get("linear_conv_kernel_dim", 4) if hybrid else 0,
            linear_num_key_heads=get("linear_num_key_heads", 0) if hybrid else 0,
            linear_num_value_heads=get("linear_num_value_heads", 0) if hybrid else 0,
            linear_key_head_dim=get("linear_key_head_dim", 0) if hybrid else 0,
            linear_value_head_dim=get("linear_value_head_dim", 0) if hybrid else 0,
            fused_linear_projections=family == "qwen3_next",
            eos_token_ids=eos_ids,
            max_position_embeddings=get("max_position_embeddings", 32768),
            has_vision_tower="vision_config" in raw,
            vision=VisionConfig.from_hf(raw, source) if "vision_config" in raw else None,
            mrope_section=(tuple(rope.get("mrope_section") or ((24, 20, 20) if family == "qwen3" else (11, 11, 10)))
                           if "vision_config" in raw else ()),  # transformers' defaults when the config has none
        )
        if family == "kimi_linear":
            fields.update(_kimi_linear_fields(get, need, source, num_layers))
        if fields["num_experts"] and not 0 < fields["num_experts_per_tok"] <= fields["num_experts"]:
            raise ConfigError(f"{source}: {fields['num_experts']} routed experts but {fields['num_experts_per_tok']} "
                              "per token (num_experts_per_tok must be 1..num_experts)")
        return cls(**fields)


def _kimi_linear_fields(get, need, source: str, num_layers: int) -> dict[str, Any]:
    """What Kimi-Linear's config.json (as transformers' ``KimiLinearConfig`` writes it) sets
    differently from the Qwen hybrids: KDA linear layers, MLA full attention without rotary,
    plain RMSNorm, sigmoid-routed experts with groups and a bias, an ungated shared expert."""
    aliases = {"num_experts_per_token": "num_experts_per_tok", "num_expert_group": "n_group",
               "num_shared_experts": "n_shared_experts", "num_experts": "num_local_experts"}

    def get_kimi(key: str, default: Any) -> Any:  # transformers' KimiLinearConfig.attribute_map names too
        return get(key, get(aliases[key], default))

    lin = get("linear_attn_config", {}) or {}
    full = set(lin.get("full_attn_layers", []))  # 1-based, as the checkpoint lists them
    layer_types = tuple(get("layer_types", [FULL_ATTENTION if i + 1 in full else LINEAR_ATTENTION
                                            for i in range(num_layers)]))
    first_dense = get("first_k_dense_replace", 0)
    mlp_types = get("mlp_layer_types", ["dense" if i < first_dense else "sparse" for i in range(num_layers)])
    if len(layer_types) != num_layers or len(mlp_types) != num_layers:
        raise ConfigError(f"{source}: layer_types / mlp_layer_types must have {num_layers} entries")
    heads = get("linear_num_heads", lin.get("num_heads", 0))
    head_dim = get("linear_head_dim", lin.get("head_dim", 0))
    nope, rope, v_dim = need("qk_nope_head_dim"), need("qk_rope_head_dim"), need("v_head_dim")
    experts = get_kimi("num_experts", 0)
    moe_inter = get("moe_intermediate_size", 0)
    return dict(
        layer_types=layer_types, attn_output_gate=False, zero_centered_norm=False, rotary_dim=0,
        num_kv_heads=need("num_attention_heads"), head_dim=nope + rope,
        q_lora_rank=get("q_lora_rank", 0), kv_lora_rank=need("kv_lora_rank"),
        qk_nope_head_dim=nope, qk_rope_head_dim=rope, v_head_dim=v_dim,
        num_experts=experts, num_experts_per_tok=get_kimi("num_experts_per_token", 0) if experts else 0,
        moe_intermediate_size=moe_inter if experts else 0,
        shared_expert_intermediate_size=moe_inter * get_kimi("num_shared_experts", 0) if experts else 0,
        norm_topk_prob=bool(get("moe_renormalize", True)),
        moe_layers=tuple(bool(experts) and t == "sparse" for t in mlp_types),
        router_scoring="sigmoid", num_expert_groups=get_kimi("num_expert_group", 1), topk_groups=get("topk_group", 1),
        routed_scaling_factor=float(get("routed_scaling_factor", 1.0)), shared_expert_gate=False,
        linear_conv_kernel=get("linear_conv_kernel_dim", lin.get("short_conv_kernel_size", 4)),
        linear_num_key_heads=heads, linear_num_value_heads=heads,
        linear_key_head_dim=head_dim, linear_value_head_dim=head_dim, kda=True,
    )
