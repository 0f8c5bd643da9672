"""Session-wide fixtures: the torch oracle records shared by the model and CLI tests."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import jax
import pytest

from tests.reference.bridge import run_torch

# No persistent compilation cache in tests, whatever the environment says: every test compiles
# in-process (a CI run crashed inside the cache's compile-and-write path on an interpret-mode
# kernel; the cache buys nothing for one-off test programs).
jax.config.update("jax_enable_compilation_cache", False)
# ... and none in the subprocesses they start (`jaxserve serve` / `generate` turn it on by default,
# into ~/.cache/jaxserve/xla): a test that wants one passes its own directory.
os.environ["JAXSERVE_COMPILE_CACHE"] = "off"


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """After each test module, drop JAX's caches of compiled programs. Each XLA CPU executable holds
    memory mappings of its own; one long process (tests/engine compiles hundreds of programs) grew
    to ~60,000 mappings, next to the kernel's vm.max_map_count (65,530), and the next compile died
    in XLA (SIGSEGV or SIGABRT, in whichever test came next). Executables a live fixture still
    holds stay valid; a later call of a dropped program compiles it again."""
    yield
    jax.clear_caches()


# Every family variant weights/tiny.py writes; each is checked against transformers.
CHECKPOINTS = [
    ("qwen3_5", "dense"), ("qwen3_5", "untied"), ("qwen3_5", "vl"),
    ("qwen3_5_moe", "moe"), ("qwen3_5_moe", "moe_tied"),
    ("qwen3_next", "moe"), ("qwen3_next", "sparse_step"), ("qwen3_next", "dense"),
    ("qwen3", "base"), ("qwen3", "untied"),
    ("kimi_linear", "moe"), ("kimi_linear", "q_lora"),
]
PROMPT_LEN, NEW_TOKENS = 100, 32
# Checkpoints we ship (name -> folder), checked against transformers the same way, on a real chat prompt.
SHIPPED = {name: Path(__file__).resolve().parents[1] / "weights" / name for name in ("default", "moe")}


def shipped_prompt(folder: Path) -> list[int]:
    """PROMPT_LEN ids of a chat conversation in the shipped model's own tokenizer (a recall probe
    followed by arithmetic turns, cut to length), so its record exercises trained behaviour."""
    from jaxserve.tokenizer import Tokenizer
    from weights.groundtruth import tasks

    tok = Tokenizer.from_dir(folder)
    text = "".join(tok.apply_chat_template(tasks.recall(random.Random(i)), add_generation_prompt=False)
                   for i in range(4))
    ids = tok.encode(text)
    assert len(ids) >= PROMPT_LEN, len(ids)
    return ids[:PROMPT_LEN]


@pytest.fixture(scope="session")
def oracle_dir(tmp_path_factory):
    """One torch subprocess: writes every tiny checkpoint and its transformers record
    (prompt, greedy continuation, full-forward logits) under <dir>/<family>-<variant>/."""
    out = tmp_path_factory.mktemp("oracle")
    tiny = [{"family": f, "variant": v, "seed": i} for i, (f, v) in enumerate(CHECKPOINTS)]
    shipped = [{"name": n, "path": str(p), "prompt": shipped_prompt(p)} for n, p in SHIPPED.items()]
    spec = {"checkpoints": tiny + shipped,
            "prompt_len": PROMPT_LEN, "new_tokens": NEW_TOKENS, "prompt_seed": 1234}
    (out / "spec.json").write_text(json.dumps(spec))
    run_torch("tests.reference.model_oracle", str(out / "spec.json"), str(out))
    return out
