"""Export: the trained params pytree back to a Hugging Face folder (``build_params`` inverted).

``DIR/export`` = ``config.json`` (the keys transformers writes for the text config), bf16
``model.safetensors`` ([out, in] linears, split GDN in-projections and MLP gate / up, MoE experts
one by one as transformers' ``save_pretrained`` writes them), ``generation_config.json`` and the
tokenizer files. ``weights.load_model`` and transformers load it; the tests check the round trip
is exact (up to the bf16 rounding).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jax
import ml_dtypes
import numpy as np

from jaxserve.config import LINEAR_ATTENTION, ModelConfig
from weights.groundtruth import tokenizer as gt_tokenizer

# The budget of a shipped model.safetensors (the full-size configs fit it; tests check).
MAX_EXPORT_BYTES = 20 * 1024 * 1024


def to_hf_tensors(params: dict, cfg: ModelConfig) -> dict[str, np.ndarray]:
    """The params pytree back to HF-named host arrays ([out, in] linears). Experts are written per
    expert (``mlp.experts.{j}.{gate,up,down}_proj.weight``, what transformers' save_pretrained
    writes)."""
    assert not cfg.fused_linear_projections
    a = lambda x: np.asarray(jax.device_get(x))  # noqa: E731
    out: dict[str, np.ndarray] = {"model.embed_tokens.weight": a(params["embed"]), "model.norm.weight": a(params["norm"])}
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = a(params["lm_head"]).T

    def lin(name, p):
        out[f"{name}.weight"] = a(p["w"]).T
        if "b" in p:
            out[f"{name}.bias"] = a(p["b"])

    def swiglu(name, p):  # params.py's gate_up_proj merge, undone
        gate, up = np.split(a(p["gate_up_proj"]["w"]), 2, axis=1)
        lin(f"{name}.gate_proj", {"w": gate})
        lin(f"{name}.up_proj", {"w": up})
        lin(f"{name}.down_proj", p["down_proj"])

    for i, (layer, lt) in enumerate(zip(params["layers"], cfg.layer_types)):
        pre = f"model.layers.{i}"
        out[f"{pre}.input_layernorm.weight"] = a(layer["input_layernorm"])
        out[f"{pre}.post_attention_layernorm.weight"] = a(layer["post_attention_layernorm"])
        if lt == LINEAR_ATTENTION:
            la, p = f"{pre}.linear_attn", layer["linear_attn"]
            hv, vd, conv = cfg.linear_num_value_heads, cfg.linear_value_dim, cfg.linear_conv_dim
            parts = np.split(a(p["in_proj"]["w"]), np.cumsum([conv, vd, hv])[:], axis=1)  # params.py's merge, undone
            for k, w in zip(("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"), parts):
                lin(f"{la}.{k}", {"w": w})
            lin(f"{la}.out_proj", p["out_proj"])
            out[f"{la}.conv1d.weight"] = a(p["conv_w"])[:, None, :]
            out[f"{la}.dt_bias"] = a(p["dt_bias"])
            out[f"{la}.A_log"] = a(p["A_log"])
            out[f"{la}.norm.weight"] = a(p["norm"])
        else:
            sa, p = f"{pre}.self_attn", layer["self_attn"]
            for k in ("q_proj", "k_proj", "v_proj", "o_proj"):
                lin(f"{sa}.{k}", p[k])
            out[f"{sa}.q_norm.weight"] = a(p["q_norm"])
            out[f"{sa}.k_norm.weight"] = a(p["k_norm"])
        m, p = f"{pre}.mlp", layer["mlp"]
        if cfg.moe_layers[i]:
            router, gate = np.split(a(p["router"]), [cfg.num_experts], axis=1)  # [H, E] | the shared gate [H, 1]
            out[f"{m}.gate.weight"] = router.T
            gate_up = a(p["gate_up"]).transpose(0, 2, 1)  # [E, 2I, H]
            down = a(p["down"]).transpose(0, 2, 1)  # [E, H, I]
            inter = cfg.moe_intermediate_size
            for j in range(cfg.num_experts):
                out[f"{m}.experts.{j}.gate_proj.weight"] = gate_up[j, :inter]
                out[f"{m}.experts.{j}.up_proj.weight"] = gate_up[j, inter:]
                out[f"{m}.experts.{j}.down_proj.weight"] = down[j]
            swiglu(f"{m}.shared_expert", p["shared_expert"])
            out[f"{m}.shared_expert_gate.weight"] = gate.T
        else:
            swiglu(m, p)
    return {k: np.ascontiguousarray(v) for k, v in out.items()}


def export(params: dict, config: dict, out: str | Path, tokenizer_dir: str | Path, dtype: str = "bfloat16") -> Path:
    """Write a Hugging Face folder: config.json, model.safetensors, generation_config.json and the
    tokenizer files."""
    from safetensors.numpy import save_file

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    cfg = ModelConfig.from_hf(config)
    store = {"bfloat16": ml_dtypes.bfloat16, "float32": np.float32}[dtype]
    tensors = {k: v.astype(store) for k, v in to_hf_tensors(params, cfg).items()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    for f in gt_tokenizer.FILES:
        if Path(tokenizer_dir).resolve() != out.resolve():
            shutil.copy(Path(tokenizer_dir) / f, out / f)
    eos = json.loads((out / "tokenizer.json").read_text())
    eos_id = next(t["id"] for t in eos["added_tokens"] if t["content"] == "<|im_end|>")
    full = {**config, "eos_token_id": eos_id, "dtype": dtype, "transformers_version": "5.24.0"}
    (out / "config.json").write_text(json.dumps(dict(sorted(full.items())), indent=2) + "\n")
    gen = {"do_sample": False, "eos_token_id": eos_id, "transformers_version": "5.24.0"}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    return out
