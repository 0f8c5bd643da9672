"""weights.loader on hand-made safetensors checkpoints (every layout and every error) and on
checkpoints that transformers itself saved (weights.tiny, through the torch bridge)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.numpy import save_file

from jaxserve.config import ConfigError, ModelConfig
from jaxserve.models.params import build_params, hf_shapes
from weights import CheckpointError, LoadedModel, load_model
from weights.loader import check_checkpoint
from weights.loader import load_tensors, put_permuted

BF16 = np.dtype(ml_dtypes.bfloat16)

_HYBRID = dict(
    vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2,
    num_key_value_heads=1, head_dim=16, rms_norm_eps=1e-6, layer_types=["linear_attention", "full_attention"],
    linear_conv_kernel_dim=4, linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2,
    linear_num_value_heads=4, rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
)
_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=24)
CONFIGS = {
    "qwen3": dict(model_type="qwen3", vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                  num_attention_heads=2, num_key_value_heads=1, head_dim=16, tie_word_embeddings=False),
    "qwen3_5": dict(model_type="qwen3_5_text", tie_word_embeddings=False, **_HYBRID),
    "qwen3_5_moe": dict(model_type="qwen3_5_moe_text", tie_word_embeddings=False, **_HYBRID, **_MOE),
    "qwen3_next": dict(model_type="qwen3_next", tie_word_embeddings=False, **_HYBRID, **_MOE),
}
EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(gate_up_proj|down_proj)$")


def make_tensors(raw_config: dict, seed: int = 0) -> tuple[ModelConfig, dict[str, np.ndarray]]:
    """Random float32 tensors for exactly hf_shapes(config): canonical names, fused experts."""
    cfg = ModelConfig.from_hf(raw_config)
    rng = np.random.default_rng(seed)
    return cfg, {k: rng.standard_normal(s, dtype=np.float32) for k, s in hf_shapes(cfg).items()}


def per_expert(tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The layout transformers v5 writes: fused experts split into experts.{j}.{gate,up,down}_proj.weight."""
    out = {}
    for name, t in tensors.items():
        m = EXPERT.match(name)
        if not m:
            out[name] = t
        elif m[2] == "down_proj":
            out.update({f"{m[1]}.{j}.down_proj.weight": t[j] for j in range(t.shape[0])})
        else:
            inter = t.shape[1] // 2
            for j in range(t.shape[0]):
                out[f"{m[1]}.{j}.gate_proj.weight"] = t[j, :inter]
                out[f"{m[1]}.{j}.up_proj.weight"] = t[j, inter:]
    return out


def write_checkpoint(folder: Path, raw_config: dict, tensors: dict[str, np.ndarray], shards: int = 1) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(raw_config))
    tensors = {k: np.ascontiguousarray(v) for k, v in tensors.items()}
    if shards == 1:
        save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
        return folder
    names = sorted(tensors)
    weight_map = {}
    for s in range(shards):
        fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = names[s::shards]
        save_file({k: tensors[k] for k in part}, str(folder / fname), metadata={"format": "pt"})
        weight_map.update({k: fname for k in part})
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return folder


def assert_tree_equal(params, expected) -> None:
    flat, tree = jax.tree.flatten(params)
    flat_e, tree_e = jax.tree.flatten(expected)
    assert tree == tree_e
    for a, b in zip(flat, flat_e, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def reference_params(cfg, tensors, dtype):
    return build_params(cfg, {k: v.astype(dtype) for k, v in tensors.items()}, lambda a: np.asarray(a, dtype))


# -- layouts --------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_single_file_equals_source(tmp_path, family):
    cfg, tensors = make_tensors(CONFIGS[family])
    folder = write_checkpoint(tmp_path / family, CONFIGS[family], tensors)
    model = load_model(folder, progress=False)
    assert isinstance(model, LoadedModel) and model.config == cfg and model.path == folder
    assert_tree_equal(model.params, reference_params(cfg, tensors, np.float32))
    # Spot checks of the layout, independent of build_params: linear weights are [in, out].
    p = model.params
    np.testing.assert_array_equal(p["embed"], tensors["model.embed_tokens.weight"])
    np.testing.assert_array_equal(p["lm_head"], tensors["lm_head.weight"].T)
    if not cfg.moe_layers[0]:
        gate_up = np.concatenate([tensors[f"model.layers.0.mlp.{k}.weight"].T for k in ("gate_proj", "up_proj")], axis=1)
        np.testing.assert_array_equal(p["layers"][0]["mlp"]["gate_up_proj"]["w"], gate_up)
    else:
        np.testing.assert_array_equal(
            p["layers"][0]["mlp"]["gate_up"], tensors["model.layers.0.mlp.experts.gate_up_proj"].transpose(0, 2, 1)
        )
    attn = p["layers"][1]["self_attn"]
    np.testing.assert_array_equal(attn["o_proj"]["w"], tensors["model.layers.1.self_attn.o_proj.weight"].T)
    loaded = load_tensors(folder, hf_shapes(cfg), "float32")
    assert loaded.keys() == tensors.keys()
    for k in tensors:
        np.testing.assert_array_equal(loaded[k], tensors[k])


@pytest.mark.parametrize("family", ["qwen3", "qwen3_next"])
def test_sharded_with_index(tmp_path, family):
    cfg, tensors = make_tensors(CONFIGS[family], seed=1)
    folder = write_checkpoint(tmp_path, CONFIGS[family], per_expert(tensors), shards=3)
    assert not (folder / "model.safetensors").exists()
    assert_tree_equal(load_model(folder, progress=False).params, reference_params(cfg, tensors, np.float32))


@pytest.mark.parametrize("family", ["qwen3_5_moe", "qwen3_next"])
def test_per_expert_tensors_stack_to_fused(tmp_path, family):
    cfg, tensors = make_tensors(CONFIGS[family], seed=2)
    split = per_expert(tensors)
    assert "model.layers.0.mlp.experts.3.up_proj.weight" in split and "model.layers.0.mlp.experts.gate_up_proj" not in split
    fused = load_tensors(write_checkpoint(tmp_path / "fused", CONFIGS[family], tensors), hf_shapes(cfg))
    stacked = load_tensors(write_checkpoint(tmp_path / "split", CONFIGS[family], split), hf_shapes(cfg))
    for k in tensors:
        np.testing.assert_array_equal(stacked[k], fused[k])
        np.testing.assert_array_equal(stacked[k], tensors[k])
    # gate rows first, then up rows, expert j at index j
    gu = stacked["model.layers.1.mlp.experts.gate_up_proj"]
    np.testing.assert_array_equal(gu[2, :16], split["model.layers.1.mlp.experts.2.gate_proj.weight"])
    np.testing.assert_array_equal(gu[2, 16:], split["model.layers.1.mlp.experts.2.up_proj.weight"])


def test_multimodal_prefix_and_skipped_tensors(tmp_path, capfd):
    # No vision_config: the checkpoint's tower tensors are not the model's, so they are skipped.
    raw = {"model_type": "qwen3_5", "tie_word_embeddings": False, "text_config": CONFIGS["qwen3_5"]}
    cfg, tensors = make_tensors(raw)
    stored = {(k.replace("model.", "model.language_model.", 1) if k.startswith("model.") else k): v for k, v in tensors.items()}
    rng = np.random.default_rng(3)
    stored.update({f"model.visual.blocks.{i}.attn.qkv.weight": rng.standard_normal((6, 4), dtype=np.float32) for i in range(3)})
    stored.update({"mtp.fc.weight": np.ones((4, 4), np.float32), "mtp.layers.0.input_layernorm.weight": np.ones(4, np.float32)})
    folder = write_checkpoint(tmp_path, raw, stored, shards=2)
    capfd.readouterr()
    model = load_model(folder, progress=False)
    err = capfd.readouterr().err
    assert_tree_equal(model.params, reference_params(cfg, tensors, np.float32))
    lines = [line for line in err.splitlines() if "skipping" in line]
    assert len(lines) == 1, err
    assert "3 vision-tower tensors" in lines[0] and "2 multi-token-prediction tensors" in lines[0] and str(folder) in lines[0]


def test_tied_and_untied(tmp_path, capfd):
    raw = dict(CONFIGS["qwen3_5"], tie_word_embeddings=True)
    cfg, tensors = make_tensors(raw)
    assert "lm_head.weight" not in tensors
    model = load_model(write_checkpoint(tmp_path / "tied", raw, tensors), progress=False)
    assert "lm_head" not in model.params
    np.testing.assert_array_equal(model.params["embed"], tensors["model.embed_tokens.weight"])
    # A tied config ignores a stored lm_head.weight, as transformers does, and says so.
    extra = dict(tensors, **{"lm_head.weight": np.zeros((96, 32), np.float32)})
    capfd.readouterr()
    model = load_model(write_checkpoint(tmp_path / "tied_extra", raw, extra), progress=False)
    assert "lm_head" not in model.params and "lm_head.weight" in capfd.readouterr().err
    # Untied: lm_head is its own tensor.
    raw = dict(raw, tie_word_embeddings=False)
    cfg, tensors = make_tensors(raw, seed=4)
    model = load_model(write_checkpoint(tmp_path / "untied", raw, tensors), progress=False)
    np.testing.assert_array_equal(model.params["lm_head"], tensors["lm_head.weight"].T)


@pytest.mark.parametrize("stored", [np.float32, BF16, np.float16], ids=["f32", "bf16", "f16"])
@pytest.mark.parametrize("target", ["float32", "bfloat16", jnp.bfloat16, jnp.float32], ids=["f32", "bf16", "jnp_bf16", "jnp_f32"])
def test_storage_and_target_dtypes(tmp_path, stored, target):
    cfg, tensors = make_tensors(CONFIGS["qwen3_next"], seed=5)
    tensors = {k: v.astype(stored) for k, v in tensors.items()}
    # Mixed storage too: a few tensors (one expert among them) in float32 whatever the rest is.
    split = per_expert(tensors)
    for k in ("model.norm.weight", "model.layers.0.linear_attn.A_log", "model.layers.0.mlp.experts.1.up_proj.weight"):
        split[k] = split[k].astype(np.float32)
    model = load_model(write_checkpoint(tmp_path, CONFIGS["qwen3_next"], split), dtype=target, progress=False)
    want = np.dtype(jnp.dtype(target))
    assert model.dtype == want
    assert {leaf.dtype for leaf in jax.tree.leaves(model.params)} == {want}
    assert_tree_equal(model.params, reference_params(cfg, {k: v.astype(np.float32) for k, v in tensors.items()}, want))


def test_progress_bar_does_not_break_loading(tmp_path):
    cfg, tensors = make_tensors(CONFIGS["qwen3"])
    model = load_model(write_checkpoint(tmp_path, CONFIGS["qwen3"], tensors), progress=True)
    assert_tree_equal(model.params, reference_params(cfg, tensors, np.float32))


# -- errors: one CheckpointError / ConfigError naming the file and the tensor -----------------------


@pytest.fixture
def good(tmp_path):
    """(raw config, canonical tensors) of a small qwen3_next checkpoint, stored per expert."""
    cfg, tensors = make_tensors(CONFIGS["qwen3_next"])
    return CONFIGS["qwen3_next"], per_expert(tensors)


def _fails(folder: Path, *fragments: str, error=CheckpointError) -> str:
    """``load_model`` fails naming ``fragments``, and ``check_checkpoint`` (the header checks a
    background load is preceded by) fails alike, reading no weight."""
    with pytest.raises(error) as info:
        load_model(folder, progress=False)
    msg = str(info.value)
    with pytest.raises(error) as early:
        check_checkpoint(folder)
    assert str(early.value) == msg
    for frag in fragments:
        assert frag in msg, f"{frag!r} not in {msg!r}"
    return msg


def test_error_not_a_checkpoint(tmp_path, good):
    _fails(tmp_path / "nowhere", "nowhere", "no such checkpoint folder")
    (tmp_path / "empty").mkdir()
    _fails(tmp_path / "empty", "config.json", error=ConfigError)
    (tmp_path / "cfg_only").mkdir()
    (tmp_path / "cfg_only" / "config.json").write_text(json.dumps(good[0]))
    (tmp_path / "cfg_only" / "pytorch_model.bin").write_bytes(b"")
    _fails(tmp_path / "cfg_only", "cfg_only", "model.safetensors")


def test_error_missing_tensor(tmp_path, good):
    raw, tensors = good
    del tensors["model.layers.1.self_attn.k_norm.weight"]
    _fails(write_checkpoint(tmp_path / "one", raw, tensors), "model.layers.1.self_attn.k_norm.weight", "model.safetensors")
    msg = _fails(write_checkpoint(tmp_path / "sharded", raw, tensors, shards=2), "model.layers.1.self_attn.k_norm.weight")
    assert "model-00001-of-00002.safetensors" in msg and "model-00002-of-00002.safetensors" in msg


def test_error_missing_expert(tmp_path, good):
    raw, tensors = good
    del tensors["model.layers.1.mlp.experts.2.down_proj.weight"]
    _fails(write_checkpoint(tmp_path, raw, tensors), "model.layers.1.mlp.experts.2.down_proj.weight", str(tmp_path))


@pytest.mark.parametrize("name", ["model.layers.0.linear_attn.in_proj_qkvz.weight", "model.layers.1.mlp.experts.0.gate_proj.weight"])
def test_error_shape_mismatch(tmp_path, good, name):
    raw, tensors = good
    expected = list(tensors[name].shape)
    tensors[name] = np.zeros((expected[0] + 1, expected[1]), np.float32)
    _fails(write_checkpoint(tmp_path, raw, tensors), "model.safetensors", name, str(expected), str([expected[0] + 1, expected[1]]))


def test_error_index_names_missing_shard(tmp_path, good):
    folder = write_checkpoint(tmp_path, *good, shards=2)
    (folder / "model-00002-of-00002.safetensors").unlink()
    _fails(folder, "model.safetensors.index.json", "model-00002-of-00002.safetensors")


def test_error_index_disagrees_with_shard(tmp_path, good):
    folder = write_checkpoint(tmp_path, *good, shards=2)
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    shard = index["weight_map"]["model.norm.weight"]
    index["weight_map"]["model.norm.weight"] = shard.replace("00001-of", "0000X-of").replace("00002-of", "00001-of").replace("0000X-of", "00002-of")
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    _fails(folder, "model.safetensors.index.json", "model.norm.weight")


@pytest.mark.parametrize(
    "extra", ["model.layers.2.input_layernorm.weight", "model.layers.0.mlp.experts.4.up_proj.weight", "model.foo.weight"]
)
def test_error_unexpected_tensor(tmp_path, good, extra):
    raw, tensors = good
    tensors[extra] = np.ones((16, 32), np.float32)
    _fails(write_checkpoint(tmp_path, raw, tensors), "model.safetensors", extra, "unexpected")


def test_error_untied_config_without_lm_head(tmp_path, good):
    raw, tensors = good
    del tensors["lm_head.weight"]
    _fails(write_checkpoint(tmp_path, raw, tensors), "lm_head.weight", "missing")


def test_error_unknown_model_type(tmp_path, good):
    raw, tensors = good
    _fails(write_checkpoint(tmp_path, dict(raw, model_type="llama"), tensors), "config.json", "llama", error=ConfigError)


def test_error_unsupported_stored_dtype(tmp_path, good):
    raw, tensors = good
    tensors["model.layers.1.self_attn.q_proj.weight"] = tensors["model.layers.1.self_attn.q_proj.weight"].astype(np.int8)
    _fails(write_checkpoint(tmp_path, raw, tensors), "model.safetensors", "model.layers.1.self_attn.q_proj.weight", "I8")


def test_error_truncated_or_corrupt_file(tmp_path, good):
    folder = write_checkpoint(tmp_path / "trunc", *good)
    data = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(data[:-100])
    _fails(folder, "model.safetensors", "outside the file")
    (folder / "model.safetensors").write_bytes(b"\x05\x00")
    _fails(folder, "model.safetensors", "not a safetensors file")
    (folder / "model.safetensors").write_bytes(len(b"[1,2]").to_bytes(8, "little") + b"[1,2]")
    _fails(folder, "model.safetensors", "not a safetensors file")


def test_error_duplicate_tensor(tmp_path, good):
    raw, tensors = good
    folder = write_checkpoint(tmp_path / "dup", raw, tensors)
    # The same tensor under its plain and its multimodal-prefixed name.
    tensors["model.language_model.norm.weight"] = tensors["model.norm.weight"]
    _fails(write_checkpoint(tmp_path / "dup2", raw, tensors), "model.norm.weight", "twice")
    assert load_model(folder, progress=False)


def test_error_bad_dtype_argument(tmp_path, good):
    with pytest.raises(ValueError, match="int8"):
        load_model(write_checkpoint(tmp_path, *good), dtype="int8", progress=False)


# -- checkpoints written by transformers (weights/tiny.py) ----------------------------------------

# One variant per family, chosen to cover every naming difference the loader handles: qwen3 with
# attention biases; the qwen3_5 multimodal wrapper (language_model prefix + vision tower); per-expert
# MoE with tied embeddings; qwen3_next's fused GDN projections with MoE and dense layers mixed. The
# model differential tests (tests/models) load every variant through load_model as well.
TRANSFORMERS_CHECKPOINTS = [("qwen3", "untied"), ("qwen3_5", "vl"), ("qwen3_5_moe", "moe_tied"), ("qwen3_next", "sparse_step"),
                            ("kimi_linear", "q_lora")]


@pytest.fixture(scope="module")
def hf_dir(oracle_dir):
    """The session's transformers-written checkpoints (tests/conftest.py writes every variant once)."""
    return oracle_dir


def _stored_tensors(folder: Path) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    return load_file(str(folder / "model.safetensors"))  # tiny.py writes float32


@pytest.mark.parametrize("family,variant", TRANSFORMERS_CHECKPOINTS)
def test_transformers_checkpoint_loads(hf_dir, capfd, family, variant):
    folder = hf_dir / f"{family}-{variant}"
    capfd.readouterr()
    model = load_model(folder, progress=False)
    err = capfd.readouterr().err
    assert model.config.model_type == family
    assert "unexpected" not in err
    skip_lines = [line for line in err.splitlines() if "skipping" in line]
    assert skip_lines == []  # a vl variant's tower is loaded (tests/models/test_vision.py checks it)
    assert ("vision" in model.params) == (variant == "vl")
    stored = _stored_tensors(folder)
    plain = {k.replace("model.language_model.", "model."): v for k, v in stored.items() if "visual" not in k}
    # What transformers v5 writes: per-expert MoE tensors (it fuses them only in memory).
    if model.config.num_experts and family == "kimi_linear":
        # Kimi-Linear's own names: block_sparse_moe, experts' w1 (gate), w3 (up), w2 (down)
        e0, mlp = "model.layers.1.block_sparse_moe.experts.0", model.params["layers"][1]["mlp"]
        np.testing.assert_array_equal(mlp["gate_up"][0], np.concatenate([plain[f"{e0}.w1.weight"], plain[f"{e0}.w3.weight"]]).T)
        np.testing.assert_array_equal(mlp["down"][0], plain[f"{e0}.w2.weight"].T)
    elif model.config.num_experts:
        assert "model.layers.1.mlp.experts.0.gate_proj.weight" in plain
    assert not any(k.endswith("gate_up_proj") for k in plain)
    assert_tree_equal(model.params, reference_params(model.config, load_tensors(
        folder, hf_shapes(model.config), tie_word_embeddings=model.config.tie_word_embeddings), np.float32))
    np.testing.assert_array_equal(model.params["embed"], plain["model.embed_tokens.weight"])
    if "lm_head.weight" in plain:
        np.testing.assert_array_equal(model.params["lm_head"], plain["lm_head.weight"].T)


def test_error_routed_experts_but_none_per_token(tmp_path, good):
    raw, tensors = good
    _fails(write_checkpoint(tmp_path, dict(raw, num_experts_per_tok=0), tensors), "config.json", "0 per token",
           error=ConfigError)


def test_kimi_linear_reads_transformers_alias_keys():
    """KimiLinearConfig accepts ``num_experts_per_tok``, ``n_group``, ``n_shared_experts`` as aliases
    (its attribute_map) and writes ``num_experts_per_token`` & co.: both spellings mean the same model."""
    raw = dict(model_type="kimi_linear", vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
               num_attention_heads=2, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8,
               moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2, n_group=2, n_shared_experts=1,
               linear_attn_config={"full_attn_layers": [2], "head_dim": 8, "num_heads": 2})
    canonical = {k: v for k, v in raw.items() if k not in ("num_experts_per_tok", "n_group", "n_shared_experts")}
    canonical.update(num_experts_per_token=2, num_expert_group=2, num_shared_experts=1)
    a, b = ModelConfig.from_hf(raw), ModelConfig.from_hf(canonical)
    assert a == b and a.num_experts_per_tok == 2 and a.num_expert_groups == 2 and a.shared_expert_intermediate_size == 16


@settings(max_examples=25, deadline=None)
@given(shape=st.lists(st.integers(1, 5), min_size=1, max_size=4), data=st.data(),
       dtype=st.sampled_from([np.float32, BF16]))
def test_put_permuted_equals_a_host_layout(shape, data, dtype):
    """Any axis permutation of a stored buffer (the transposed weights ``build_params`` hands over as
    views), and views that are no permutation (a strided slice), reach the device equal to the host
    layout ``np.asarray(view, dtype)``, in ``dtype``."""
    stored = np.arange(int(np.prod(shape)), dtype=np.float32).reshape(shape).astype(BF16)
    axes = data.draw(st.permutations(range(len(shape))))
    for view in (stored.transpose(axes), stored[..., ::2].transpose(axes)):
        got = put_permuted(view, np.dtype(dtype))
        assert got.dtype == dtype and got.shape == view.shape
        np.testing.assert_array_equal(np.asarray(got), np.asarray(view, dtype))


def test_a_large_tensor_reads_in_pieces_and_a_truncated_one_is_an_error(tmp_path, monkeypatch):
    """A tensor of several read pieces comes back whole; a file cut short is a CheckpointError."""
    from weights import loader

    monkeypatch.setattr(loader, "_READ_PIECE", 64)
    w = np.arange(1000, dtype=np.float32).reshape(10, 100)
    save_file({"w": w}, str(tmp_path / "model.safetensors"))
    entry = loader._read_header(tmp_path / "model.safetensors")["w"]
    np.testing.assert_array_equal(entry.read(), w)
    with open(tmp_path / "model.safetensors", "r+b") as f:
        f.truncate(entry.end - 10)
    with pytest.raises(CheckpointError, match="truncated"):
        entry.read()
