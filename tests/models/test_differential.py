"""Differential tests: jaxserve's functional models against transformers (torch, fp32).

One torch subprocess writes a tiny random checkpoint of every family variant with transformers'
own ``save_pretrained`` and records, per checkpoint, a greedy 32-token continuation of a random
prompt and the logits of one full forward over prompt + continuation. Against that record:

- a full forward here gives the same logits (max |Δ| ≤ 1e-4 · max |logit|);
- prefill then 32 one-token decode steps gives the same logits at every step;
- the prompt prefilled in chunks split at arbitrary, non-×64 points gives the same logits;
- greedy generation here gives exactly transformers' tokens.

Sequence lengths are shared across variants (prompt 100, total 132, chunks 37/40/23) so each
shape compiles once per variant.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.generate import generate
from jaxserve.sampling_params import SamplingParams
from jaxserve.models import decoder
from tests.conftest import CHECKPOINTS, NEW_TOKENS, PROMPT_LEN, SHIPPED
from weights import load_model

MAX_LEN = 160
CHUNKS = (37, 40, 23)  # cuts at 37 and 77: the middle chunk starts unaligned and crosses the ×64 edge
REL_TOL = 1e-4


CASES = [f"{f}-{v}" for f, v in CHECKPOINTS] + list(SHIPPED)


@pytest.fixture(scope="module", params=CASES)
def case(request, oracle_dir):
    """(model, record); tiny checkpoints live next to their record, shipped ones where we ship them."""
    record = dict(np.load(oracle_dir / request.param / "oracle.npz"))
    model = load_model(SHIPPED.get(request.param, oracle_dir / request.param), dtype="float32", progress=False)
    return model, record


def _close(ours: np.ndarray, theirs: np.ndarray) -> None:
    scale = np.max(np.abs(theirs))
    err = np.max(np.abs(ours - theirs))
    assert err <= REL_TOL * scale, f"max |Δlogit| {err:.3g} > {REL_TOL} · max |logit| {scale:.3g}"


def _run(model, tokens: np.ndarray, start: int, state):
    pos = jnp.arange(start, start + len(tokens), dtype=jnp.int32)[None]
    logits, state = decoder.forward(model.params, model.config, jnp.asarray(tokens, jnp.int32)[None], pos, state)
    return np.asarray(logits[0]), state


def test_full_forward_matches_transformers(case):
    model, rec = case
    full = np.concatenate([rec["prompt"], rec["generated"]])
    logits, _ = _run(model, full, 0, decoder.init_state(model.config, 1, MAX_LEN, jnp.float32))
    _close(logits, rec["logits"])


def test_prefill_then_decode_matches_one_forward(case):
    model, rec = case
    state = decoder.init_state(model.config, 1, MAX_LEN, jnp.float32)
    logits, state = _run(model, rec["prompt"], 0, state)
    steps = [logits]
    for i, tok in enumerate(rec["generated"][:-1]):
        step_logits, state = _run(model, np.asarray([tok]), PROMPT_LEN + i, state)
        steps.append(step_logits)
    ours = np.concatenate(steps)
    _close(ours, rec["logits"][: PROMPT_LEN + NEW_TOKENS - 1])


def test_chunked_prefill_matches_one_prefill(case):
    model, rec = case
    state = decoder.init_state(model.config, 1, MAX_LEN, jnp.float32)
    start, pieces = 0, []
    for n in CHUNKS:
        logits, state = _run(model, rec["prompt"][start : start + n], start, state)
        pieces.append(logits)
        start += n
    assert start == PROMPT_LEN
    _close(np.concatenate(pieces), rec["logits"][:PROMPT_LEN])
    # The state left behind must continue exactly like the one-prefill state.
    step_logits, _ = _run(model, rec["generated"][:1], PROMPT_LEN, state)
    _close(step_logits, rec["logits"][PROMPT_LEN : PROMPT_LEN + 1])


def test_greedy_generation_matches_transformers(case):
    model, rec = case
    result = generate(model.params, model.config, rec["prompt"].tolist(),
                      SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True))
    assert result.output_ids == rec["generated"].tolist()
    assert result.finish_reason == "length"
    # Logprobs are the model's: log_softmax of transformers' logits at each chosen token.
    ref = rec["logits"][PROMPT_LEN - 1 : -1]
    ref_lp = ref - np.log(np.sum(np.exp(ref - ref.max(-1, keepdims=True)), -1, keepdims=True)) - ref.max(-1, keepdims=True)
    np.testing.assert_allclose(result.logprobs, ref_lp[np.arange(NEW_TOKENS), rec["generated"]], atol=1e-3)
