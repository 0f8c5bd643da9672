"""weights.groundtruth.grow: a grown model (more layers, more attention heads) computes exactly
the export's function, the new elements are marked exactly, and --grow trains them faster."""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxserve.config import ModelConfig
from jaxserve.models import decoder
from jaxserve.models.params import build_params
from jaxserve.tokenizer import Tokenizer
from weights.groundtruth import grow, train
from weights.groundtruth.architecture import model_config
from weights.groundtruth.export import export
from weights.groundtruth.start import grown_tensors, init_tensors
from weights.groundtruth import tokenizer as gt_tokenizer

L, F = "linear_attention", "full_attention"


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> Tokenizer:
    return Tokenizer.from_dir(gt_tokenizer.save(tmp_path_factory.mktemp("gt_tok")))


def _config(vocab: int, types: list[str], heads: int = 2, kv: int = 1) -> dict:
    raw = model_config(vocab, moe_variant=False, smoke=True)
    return {**raw, "num_hidden_layers": len(types), "layer_types": types,
            "num_attention_heads": heads, "num_key_value_heads": kv}


@settings(max_examples=50, deadline=None)
@given(st.lists(st.sampled_from([L, F]), min_size=1, max_size=8), st.data())
def test_layer_map_keeps_the_old_layers_in_order(old, data):
    new = list(old)
    for _ in range(data.draw(st.integers(0, 4))):
        new.insert(data.draw(st.integers(0, len(new))), data.draw(st.sampled_from([L, F])))
    m = grow.layer_map(old, new)
    kept = [j for j in m if j is not None]
    assert kept == list(range(len(old)))  # every old layer, once, in order
    assert all(new[i] == old[j] for i, j in enumerate(m) if j is not None)
    assert sum(j is None for j in m) == len(new) - len(old)


def test_layer_map_refuses_what_does_not_fit():
    with pytest.raises(ValueError, match="in order"):
        grow.layer_map([L, F], [F, L])
    with pytest.raises(ValueError, match="in order"):
        grow.layer_map([L, F, L], [L, F])


def test_grown_model_computes_the_exports_function(tmp_path, tok):
    """L F with 2/1 heads grown to L F F L F with 4/2 heads: identical logits (fp32), the new parts
    random but their output projections 0, and ``new_elements`` marking exactly what is not the
    export's (as many elements as the parameter count grew)."""
    old_config, new_config = _config(tok.vocab_size, [L, F]), _config(tok.vocab_size, [L, F, F, L, F], 4, 2)
    old_cfg, new_cfg = ModelConfig.from_hf(old_config), ModelConfig.from_hf(new_config)
    old = build_params(old_cfg, init_tensors(old_cfg, 4, init_std=0.1), jnp.asarray)
    folder = export(old, old_config, tmp_path / "old", Path(tok.source), dtype="float32")
    tensors, new = grown_tensors(folder, new_cfg, new_config, seed=5)
    assert grow.layer_map(old_config["layer_types"], new_config["layer_types"]) == [0, 1, None, None, None]
    for i in (2, 3, 4):
        assert not tensors[f"model.layers.{i}.mlp.down_proj.weight"].any()
        assert tensors[f"model.layers.{i}.mlp.up_proj.weight"].std() > 0.01
    assert not tensors["model.layers.3.linear_attn.out_proj.weight"].any()
    o_proj, hd = tensors["model.layers.1.self_attn.o_proj.weight"], new_cfg.head_dim
    assert not o_proj[:, 2 * hd:].any() and o_proj[:, : 2 * hd].std() > 0.05
    assert tensors["model.layers.1.self_attn.q_proj.weight"][4 * hd:].std() > 0.01  # new heads' rows random
    n_old = sum(x.size for x in jax.tree.leaves(old))
    n_new = sum(v.size for v in tensors.values())
    assert sum(int(m.sum()) for m in new.values()) == n_new - n_old > 0
    assert not new["model.embed_tokens.weight"].any() and new["model.layers.2.self_attn.q_proj.weight"].all()
    assert not new["model.layers.1.self_attn.q_proj.weight"][: 4 * hd].any()
    assert new["model.layers.1.self_attn.q_proj.weight"][4 * hd:].all()

    grown = build_params(new_cfg, tensors, jnp.asarray)
    tokens = jax.random.randint(jax.random.PRNGKey(1), (2, 40), 0, tok.vocab_size)
    pos = jnp.broadcast_to(jnp.arange(40), (2, 40))
    want, _ = decoder.forward(old, old_cfg, tokens, pos, decoder.init_state(old_cfg, 2, 64, jnp.float32))
    got, _ = decoder.forward(grown, new_cfg, tokens, pos, decoder.init_state(new_cfg, 2, 64, jnp.float32))
    assert float(jnp.abs(want).max()) > 0.1
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("bad, match", [
    ({"hidden_size": 64}, "differs"),
    ({"num_attention_heads": 4}, "same factor"),  # 4/1 would move old heads onto other KV heads
    ({"num_attention_heads": 1, "num_key_value_heads": 1}, "same factor"),
    ({"layer_types": [F, L], "num_hidden_layers": 2}, "in order"),
])
def test_growth_refuses_what_it_cannot_preserve(bad, match):
    old = _config(300, [L, F])
    with pytest.raises(ValueError, match=match):
        grow.check_growth(old, {**old, **bad})


def test_train_grow_moves_new_weights_k_times_faster(tmp_path, tok):
    """train(grow=True): the run starts from the grown export (the export's weights where they are
    the export's) and ``grow_lr_scale`` scales the new elements' updates only."""
    old_config = model_config(tok.vocab_size, moe_variant=False, smoke=True)
    old_cfg = ModelConfig.from_hf(old_config)
    old = build_params(old_cfg, init_tensors(old_cfg, 3), jnp.asarray)
    folder = export(old, old_config, tmp_path / "old", Path(tok.source), dtype="float32")
    overrides = {"num_hidden_layers": 5, "layer_types": old_config["layer_types"] + [F],
                 "num_attention_heads": 4, "num_key_value_heads": 2}
    kw = dict(smoke=True, kinds=("arithmetic",), batch_tokens=512, log_every=100, warmup=1, lr=1e-3,
              init_from=folder, grow=True, config_overrides=overrides, log=lambda *_: None)
    start = train.train(tmp_path / "start", 3, stop_at=0, **kw)["final_params"]
    assert len(start["layers"]) == 5
    for a, b in zip(jax.tree.leaves(old["layers"][0]), jax.tree.leaves(start["layers"][0])):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    moved = {}
    for k in (1.0, 8.0):
        end = train.train(tmp_path / f"k{k}", 2, grow_lr_scale=k, **kw)["final_params"]
        delta = lambda p: float(jnp.abs(p - start_p).mean())  # noqa: E731
        start_p = start["layers"][4]["mlp"]["down_proj"]["w"]
        new_move = delta(end["layers"][4]["mlp"]["down_proj"]["w"])
        start_p = start["layers"][0]["mlp"]["down_proj"]["w"]
        old_move = delta(end["layers"][0]["mlp"]["down_proj"]["w"])
        moved[k] = (new_move, old_move)
    assert moved[8.0][0] == pytest.approx(8 * moved[1.0][0], rel=0.05)  # the first update: Adam's sign-like step, x8
    assert moved[8.0][1] == pytest.approx(moved[1.0][1], rel=0.05)
    with pytest.raises(ValueError, match="only with grow"):
        train.train(tmp_path / "bad", 2, smoke=True, grow_lr_scale=2.0, log=lambda *_: None)
