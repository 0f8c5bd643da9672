"""weights.random_checkpoint writes folders our loader reads as any Hugging Face checkpoint."""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.models import decoder
from weights import load_model
from weights.random_checkpoint import DEFAULT_DONOR, write_random_checkpoint


@pytest.mark.parametrize("overrides", [{}, {"model_type": "qwen3_5_moe_text", "num_experts": 4, "num_experts_per_tok": 2,
                                            "moe_intermediate_size": 16, "shared_expert_intermediate_size": 16}])
def test_random_checkpoint_loads_and_runs(tmp_path, overrides):
    config = {**json.loads((DEFAULT_DONOR / "config.json").read_text()), **overrides}
    folder = write_random_checkpoint(config, tmp_path / "ck", dtype="float32", seed=3)
    model = load_model(folder, dtype="float32", progress=False)
    assert model.config.model_type == ("qwen3_5_moe" if overrides else "qwen3_5")
    state = decoder.init_state(model.config, 1, 64, jnp.float32)
    logits, _ = decoder.forward(model.params, model.config, jnp.arange(10)[None], jnp.arange(10)[None], state)
    assert np.isfinite(np.asarray(logits)).all()
    assert (folder / "tokenizer.json").exists()
