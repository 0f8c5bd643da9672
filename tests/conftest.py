"""Session-wide fixtures: the torch oracle records shared by the model and CLI tests."""

from __future__ import annotations

import json

import pytest

from tests.reference.bridge import run_torch

# Every family variant weights/tiny.py writes; each is checked against transformers.
CHECKPOINTS = [
    ("qwen3_5", "dense"), ("qwen3_5", "untied"), ("qwen3_5", "vl"),
    ("qwen3_5_moe", "moe"), ("qwen3_5_moe", "moe_tied"),
    ("qwen3_next", "moe"), ("qwen3_next", "sparse_step"), ("qwen3_next", "dense"),
    ("qwen3", "base"), ("qwen3", "untied"),
]
PROMPT_LEN, NEW_TOKENS = 100, 32


@pytest.fixture(scope="session")
def oracle_dir(tmp_path_factory):
    """One torch subprocess: writes every tiny checkpoint and its transformers record
    (prompt, greedy continuation, full-forward logits) under <dir>/<family>-<variant>/."""
    out = tmp_path_factory.mktemp("oracle")
    spec = {"checkpoints": [{"family": f, "variant": v, "seed": i} for i, (f, v) in enumerate(CHECKPOINTS)],
            "prompt_len": PROMPT_LEN, "new_tokens": NEW_TOKENS, "prompt_seed": 1234}
    (out / "spec.json").write_text(json.dumps(spec))
    run_torch("tests.reference.model_oracle", str(out / "spec.json"), str(out))
    return out
