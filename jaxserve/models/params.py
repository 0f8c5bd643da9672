"""Map Hugging Face tensor names onto the params pytree of decoder.py.

``hf_shapes(cfg)`` is the contract with the checkpoint loader: the exact set of canonical tensor
names a checkpoint of this config must hold, with their shapes. Canonical names are HF's, after the
loader has (a) dropped the multimodal prefix ``model.language_model.`` -> ``model.`` and (b) stacked
per-expert tensors into ``mlp.experts.gate_up_proj`` [E, 2I, H] and ``mlp.experts.down_proj``
[E, H, I] (the fused layout transformers itself uses for these families).

``build_params`` turns those tensors into the pytree: linear weights transposed to [in, out],
expert weights to [E, in, out], and a GDN layer's in-projections (Qwen3.5's ``in_proj_qkv`` /
``in_proj_z`` / ``in_proj_b`` / ``in_proj_a``, or Qwen3-Next's head-grouped ``in_proj_qkvz`` /
``in_proj_ba`` permuted into that order) as one ``in_proj`` ``[H, conv_dim + vd + 2 hv]``, and a
SwiGLU MLP's ``gate_proj`` / ``up_proj`` (dense MLPs, the shared experts) as one ``gate_up_proj``
``[H, 2I]``; Qwen's ``shared_expert_gate`` rides as the MoE ``router``'s last column ``[H, E + 1]``.
"""

from __future__ import annotations

from typing import Mapping

import numpy as np

from jaxserve.config import LINEAR_ATTENTION, ModelConfig
from jaxserve.models import vision


def _linear_shapes(name: str, out_dim: int, in_dim: int, bias: bool = False) -> dict[str, tuple[int, ...]]:
    shapes = {f"{name}.weight": (out_dim, in_dim)}
    if bias:
        shapes[f"{name}.bias"] = (out_dim,)
    return shapes


def _mlp_shapes(prefix: str, hidden: int, inter: int) -> dict[str, tuple[int, ...]]:
    return {
        **_linear_shapes(f"{prefix}.gate_proj", inter, hidden),
        **_linear_shapes(f"{prefix}.up_proj", inter, hidden),
        **_linear_shapes(f"{prefix}.down_proj", hidden, inter),
    }


def _kda_shapes(la: str, cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Kimi Delta Attention (kimi_linear's linear layers, under ``self_attn``)."""
    H, h, d = cfg.hidden_size, cfg.linear_num_value_heads, cfg.linear_value_head_dim
    shapes: dict[str, tuple[int, ...]] = {}
    for x in ("q", "k", "v"):
        shapes.update(_linear_shapes(f"{la}.{x}_proj", h * d, H))
        shapes[f"{la}.{x}_conv1d.weight"] = (h * d, 1, cfg.linear_conv_kernel)
    shapes.update({f"{la}.A_log": (1, 1, h, 1), f"{la}.dt_bias": (h * d,), f"{la}.o_norm.weight": (d,)})
    for name, out_dim, in_dim in (("f_a_proj", d, H), ("f_b_proj", h * d, d), ("b_proj", h, H),
                                  ("g_a_proj", d, H), ("g_b_proj", h * d, d), ("o_proj", H, h * d)):
        shapes.update(_linear_shapes(f"{la}.{name}", out_dim, in_dim))
    return shapes


def _mla_shapes(sa: str, cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Multi-head latent attention (kimi_linear's full-attention layers)."""
    H, nh, qk = cfg.hidden_size, cfg.num_heads, cfg.head_dim
    shapes: dict[str, tuple[int, ...]] = {}
    if cfg.q_lora_rank:
        shapes.update(_linear_shapes(f"{sa}.q_a_proj", cfg.q_lora_rank, H, cfg.attention_bias))
        shapes[f"{sa}.q_a_layernorm.weight"] = (cfg.q_lora_rank,)
        shapes.update(_linear_shapes(f"{sa}.q_b_proj", nh * qk, cfg.q_lora_rank))
    else:
        shapes.update(_linear_shapes(f"{sa}.q_proj", nh * qk, H))
    shapes.update(_linear_shapes(f"{sa}.kv_a_proj_with_mqa", cfg.kv_lora_rank + cfg.qk_rope_head_dim, H,
                                 cfg.attention_bias))
    shapes[f"{sa}.kv_a_layernorm.weight"] = (cfg.kv_lora_rank,)
    shapes.update(_linear_shapes(f"{sa}.kv_b_proj", nh * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank))
    shapes.update(_linear_shapes(f"{sa}.o_proj", H, nh * cfg.v_head_dim, cfg.attention_bias))
    return shapes


def hf_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every canonical tensor name the checkpoint must contain, with its shape."""
    H = cfg.hidden_size
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (cfg.vocab_size, H), "model.norm.weight": (H,)}
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, H)
    for i, layer_type in enumerate(cfg.layer_types):
        pre = f"model.layers.{i}"
        shapes[f"{pre}.input_layernorm.weight"] = (H,)
        shapes[f"{pre}.post_attention_layernorm.weight"] = (H,)
        if layer_type == LINEAR_ATTENTION and cfg.kda:
            shapes.update(_kda_shapes(f"{pre}.self_attn", cfg))
        elif cfg.is_mla:
            shapes.update(_mla_shapes(f"{pre}.self_attn", cfg))
        elif layer_type == LINEAR_ATTENTION:
            la = f"{pre}.linear_attn"
            hv, vd, kd = cfg.linear_num_value_heads, cfg.linear_value_dim, cfg.linear_key_dim
            if cfg.fused_linear_projections:
                shapes.update(_linear_shapes(f"{la}.in_proj_qkvz", 2 * kd + 2 * vd, H))
                shapes.update(_linear_shapes(f"{la}.in_proj_ba", 2 * hv, H))
            else:
                shapes.update(_linear_shapes(f"{la}.in_proj_qkv", cfg.linear_conv_dim, H))
                shapes.update(_linear_shapes(f"{la}.in_proj_z", vd, H))
                shapes.update(_linear_shapes(f"{la}.in_proj_b", hv, H))
                shapes.update(_linear_shapes(f"{la}.in_proj_a", hv, H))
            shapes[f"{la}.conv1d.weight"] = (cfg.linear_conv_dim, 1, cfg.linear_conv_kernel)
            shapes[f"{la}.dt_bias"] = (hv,)
            shapes[f"{la}.A_log"] = (hv,)
            shapes[f"{la}.norm.weight"] = (cfg.linear_value_head_dim,)
            shapes.update(_linear_shapes(f"{la}.out_proj", H, vd))
        else:
            sa, hd = f"{pre}.self_attn", cfg.head_dim
            q_out = cfg.num_heads * hd * (2 if cfg.attn_output_gate else 1)
            shapes.update(_linear_shapes(f"{sa}.q_proj", q_out, H, cfg.attention_bias))
            shapes.update(_linear_shapes(f"{sa}.k_proj", cfg.num_kv_heads * hd, H, cfg.attention_bias))
            shapes.update(_linear_shapes(f"{sa}.v_proj", cfg.num_kv_heads * hd, H, cfg.attention_bias))
            shapes.update(_linear_shapes(f"{sa}.o_proj", H, cfg.num_heads * hd, cfg.attention_bias))
            shapes[f"{sa}.q_norm.weight"] = (hd,)
            shapes[f"{sa}.k_norm.weight"] = (hd,)
        if cfg.moe_layers[i]:
            E, inter = cfg.num_experts, cfg.moe_intermediate_size
            shapes[f"{pre}.mlp.gate.weight"] = (E, H)
            shapes[f"{pre}.mlp.experts.gate_up_proj"] = (E, 2 * inter, H)
            shapes[f"{pre}.mlp.experts.down_proj"] = (E, H, inter)
            if cfg.shared_expert_gate:  # Qwen: one sigmoid-gated shared expert
                shapes.update(_mlp_shapes(f"{pre}.mlp.shared_expert", H, cfg.shared_expert_intermediate_size))
                shapes[f"{pre}.mlp.shared_expert_gate.weight"] = (1, H)
            else:  # Kimi: shared experts (one MLP of n times the width), ungated; a selection bias
                shapes.update(_mlp_shapes(f"{pre}.mlp.shared_experts", H, cfg.shared_expert_intermediate_size))
            if cfg.router_scoring == "sigmoid":
                shapes[f"{pre}.mlp.gate.e_score_correction_bias"] = (E,)
        else:
            shapes.update(_mlp_shapes(f"{pre}.mlp", H, cfg.intermediate_size))
    if cfg.vision is not None:
        shapes.update(vision.hf_shapes(cfg.vision))
    return shapes


def _unfuse_qwen3_next(cfg: ModelConfig, qkvz: np.ndarray, ba: np.ndarray) -> dict[str, np.ndarray]:
    """Qwen3-Next groups its fused projections by key head: for head g the rows are
    [q (dk), k (dk), v (r*dv), z (r*dv)] and [b (r), a (r)] with r = Hv / Hk, value head g*r + j.
    Regroup them into the split layout (all q rows, all k rows, all v rows; z; b; a)."""
    hk, dk = cfg.linear_num_key_heads, cfg.linear_key_head_dim
    r, dv = cfg.linear_num_value_heads // hk, cfg.linear_value_head_dim
    grouped = qkvz.reshape(hk, 2 * dk + 2 * r * dv, -1)
    q, k, v, z = np.split(grouped, [dk, 2 * dk, 2 * dk + r * dv], axis=1)
    flat = lambda t: t.reshape(-1, t.shape[-1])  # noqa: E731 - (heads, rows, H) -> (heads*rows, H)
    b, a = np.split(ba.reshape(hk, 2 * r, -1), [r], axis=1)
    return {
        "in_proj_qkv": np.concatenate([flat(q), flat(k), flat(v)], axis=0),
        "in_proj_z": flat(z),
        "in_proj_b": flat(b),
        "in_proj_a": flat(a),
    }


def _kda_params(la: str, cfg: ModelConfig, t: Mapping[str, np.ndarray], lin, to_device, contiguous) -> dict:
    """Kimi Delta Attention into the GDN layer's pytree keys where the math is shared: the q, k, v
    projections as one ``in_proj_qkv`` and their three depthwise convs as one ``conv_w`` (a
    depthwise conv of concatenated channels is the three convs), ``norm`` / ``out_proj``; plus the
    low-rank forget gate (``f_a``, ``f_b``, ``dt_bias`` [Hv, dk]), ``b_proj`` and the output gate
    (``g_a``, ``g_b``)."""
    h, d = cfg.linear_num_value_heads, cfg.linear_value_head_dim
    qkv = np.concatenate([t[f"{la}.{x}_proj.weight"] for x in ("q", "k", "v")], axis=0)
    conv = np.concatenate([t[f"{la}.{x}_conv1d.weight"][:, 0, :] for x in ("q", "k", "v")], axis=0)
    return {
        "in_proj_qkv": {"w": to_device(contiguous(qkv.T))},
        "conv_w": to_device(np.ascontiguousarray(conv)),
        "A_log": to_device(t[f"{la}.A_log"].reshape(h)),
        "dt_bias": to_device(t[f"{la}.dt_bias"].reshape(h, d)),
        "norm": to_device(t[f"{la}.o_norm.weight"]),
        **{k: lin(f"{la}.{k}_proj") for k in ("f_a", "f_b", "b", "g_a", "g_b")},
        "out_proj": lin(f"{la}.o_proj"),
    }


def build_params(cfg: ModelConfig, tensors: Mapping[str, np.ndarray], to_device,
                 contiguous=np.ascontiguousarray) -> dict:
    """Arrange canonical HF tensors (already validated against ``hf_shapes``) into the pytree.

    ``to_device(array)`` converts one host array to a device array of the chosen dtype; it is
    called once per leaf so the host copy can be freed as loading goes. A transposed weight reaches
    it through ``contiguous``, which lays it out on the host (the default); a caller whose
    ``to_device`` permutes axes on the device passes a no-op and gets the transposes as views of
    the stored bytes (``weights.loader``: a host transpose ran at ~0.2 GB/s on one core), as does
    ``abstract_params``, which only reads shapes. Where weights are joined, the stored
    [out, in] matrices are concatenated (a contiguous copy) and the result transposed as a view.
    """
    t = tensors

    def lin(name: str) -> dict:
        p = {"w": to_device(contiguous(t[f"{name}.weight"].T))}
        if f"{name}.bias" in t:
            p["b"] = to_device(t[f"{name}.bias"])
        return p

    def mlp_params(prefix: str) -> dict:
        # gate and up side by side as one gate_up_proj [H, 2I] (gate columns, then up), so a step
        # multiplies by one weight (one kernel) where two would be two; layers.mlp cuts it
        gate_up = np.concatenate([t[f"{prefix}.{k}.weight"] for k in ("gate_proj", "up_proj")], axis=0).T
        return {"gate_up_proj": {"w": to_device(contiguous(gate_up))}, "down_proj": lin(f"{prefix}.down_proj")}

    layers = []
    for i, layer_type in enumerate(cfg.layer_types):
        pre = f"model.layers.{i}"
        layer = {
            "input_layernorm": to_device(t[f"{pre}.input_layernorm.weight"]),
            "post_attention_layernorm": to_device(t[f"{pre}.post_attention_layernorm.weight"]),
        }
        if layer_type == LINEAR_ATTENTION and cfg.kda:
            layer["linear_attn"] = _kda_params(f"{pre}.self_attn", cfg, t, lin, to_device, contiguous)
        elif cfg.is_mla:
            sa = f"{pre}.self_attn"
            names = ["kv_a_proj_with_mqa", "kv_b_proj", "o_proj"]
            names += ["q_a_proj", "q_b_proj"] if cfg.q_lora_rank else ["q_proj"]
            layer["self_attn"] = {k: lin(f"{sa}.{k}") for k in names}
            layer["self_attn"]["kv_a_layernorm"] = to_device(t[f"{sa}.kv_a_layernorm.weight"])
            if cfg.q_lora_rank:
                layer["self_attn"]["q_a_layernorm"] = to_device(t[f"{sa}.q_a_layernorm.weight"])
        elif layer_type == LINEAR_ATTENTION:
            la = f"{pre}.linear_attn"
            if cfg.fused_linear_projections:
                split = _unfuse_qwen3_next(cfg, t[f"{la}.in_proj_qkvz.weight"], t[f"{la}.in_proj_ba.weight"])
            else:
                split = {k: t[f"{la}.{k}.weight"] for k in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")}
            # one in-projection [H, conv_dim + vd + 2 hv]: q k v | z | b | a side by side, so a step
            # multiplies by one weight (one kernel) where four would be four; gated_deltanet.project cuts it
            merged = np.concatenate([split[k] for k in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")], axis=0).T
            layer["linear_attn"] = {
                "in_proj": {"w": to_device(contiguous(merged))},
                "conv_w": to_device(t[f"{la}.conv1d.weight"][:, 0, :]),
                "dt_bias": to_device(t[f"{la}.dt_bias"]),
                "A_log": to_device(t[f"{la}.A_log"]),
                "norm": to_device(t[f"{la}.norm.weight"]),
                "out_proj": lin(f"{la}.out_proj"),
            }
        else:
            sa = f"{pre}.self_attn"
            layer["self_attn"] = {
                **{k: lin(f"{sa}.{k}") for k in ("q_proj", "k_proj", "v_proj", "o_proj")},
                "q_norm": to_device(t[f"{sa}.q_norm.weight"]),
                "k_norm": to_device(t[f"{sa}.k_norm.weight"]),
            }
        if cfg.moe_layers[i]:
            m = f"{pre}.mlp"
            router = t[f"{m}.gate.weight"]
            if cfg.shared_expert_gate:  # Qwen: the shared expert's gate as the router's last column
                router = np.concatenate([router, t[f"{m}.shared_expert_gate.weight"]], axis=0)
            router = router.T
            layer["mlp"] = {
                "router": to_device(contiguous(router)),
                "gate_up": to_device(contiguous(t[f"{m}.experts.gate_up_proj"].transpose(0, 2, 1))),
                "down": to_device(contiguous(t[f"{m}.experts.down_proj"].transpose(0, 2, 1))),
            }
            layer["mlp"]["shared_expert"] = mlp_params(f"{m}.shared_expert" if cfg.shared_expert_gate
                                                       else f"{m}.shared_experts")
            if cfg.router_scoring == "sigmoid":
                layer["mlp"]["router_bias"] = to_device(t[f"{m}.gate.e_score_correction_bias"])
        else:
            layer["mlp"] = mlp_params(f"{pre}.mlp")
        layers.append(layer)

    params = {"embed": to_device(t["model.embed_tokens.weight"]), "layers": layers, "norm": to_device(t["model.norm.weight"])}
    if not cfg.tie_word_embeddings:
        params["lm_head"] = to_device(contiguous(t["lm_head.weight"].T))
    if cfg.vision is not None:
        params["vision"] = vision.build_params(cfg.vision, t, to_device)
    return params


def abstract_params(cfg: ModelConfig, dtype) -> dict:
    """The params pytree of ``build_params`` as ``jax.ShapeDtypeStruct``s of ``dtype`` (every leaf
    in one dtype, as the loader makes them), without a byte of weights: the tensors are zero-stride
    views of one byte, so only shapes flow through the layout code (the few concatenations of fused
    layouts copy at most one layer's projection, as int8). For compiling step programs of a model
    too large to hold (``benchmarks/step_memory.py``)."""
    import jax  # the rest of this module is numpy only

    if cfg.vision is not None:
        raise ValueError("abstract_params covers the text stack only")
    one = np.zeros((), np.int8)
    tensors = {name: np.lib.stride_tricks.as_strided(one, shape, (0,) * len(shape))
               for name, shape in hf_shapes(cfg).items()}
    return build_params(cfg, tensors, lambda a: jax.ShapeDtypeStruct(np.shape(a), dtype), contiguous=lambda a: a)
