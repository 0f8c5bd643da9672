"""Hit equals cold (ARCHITECTURE.md invariant 6) in bfloat16, on the CPU.

The fp32 tests (test_engine.py, test_scheduler.py) demand identical greedy tokens. In bf16 a hit
and its cold run may round differently where their steps differ in shape: the cold run computed the
tokens after the hit boundary inside a longer prefill chunk, the hit computes them as a row of their
own (one token after a boundary takes the one-step delta rule, not the chunked one). So a bf16 hit
must give the cold run's tokens, with logprobs within ``BF16_TOL``, except at a near-tie, where the
two tokens' logits are within ``BF16_TOL`` (``assert_same_or_near_tie``, shared with
test_batch_invariance.py). On this model and these prompts the largest logprob drift measured was
0.025 nats (the 129-token prompt); a hit that restores the wrong state fails the same check.

A tiny random Qwen3.5 (GDN + attention) checkpoint, with a 80-token step budget so the cold prefill
chunks do not end where the hits begin.
"""

from __future__ import annotations

import numpy as np
import pytest

from jaxserve.engine.llm import LLM
from jaxserve.sampling_params import SamplingParams
from tests.engine.checks import assert_pools_free_after_flush
from tests.engine.faults import FaultyScheduler
from tests.engine.test_batch_invariance import _HYBRID, assert_same_or_near_tie, next_logits
from weights.random_checkpoint import write_random_checkpoint

BF16_TOL = 0.05  # nats (logprobs) and logit units (near-ties): a few bf16 roundings of this model's logits
TOKENS = 12


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    config = dict(model_type="qwen3_5_text", tie_word_embeddings=False, **_HYBRID)
    folder = write_random_checkpoint(config, tmp_path_factory.mktemp("bf16") / "qwen3_5", dtype="float32", seed=3,
                                     init_std=0.1)
    return LLM(str(folder), dtype="bfloat16", page_size=16, max_prefill_length=80, max_running_requests=2,
               num_pages=64, num_slots=12, progress=False, compile_cache=False, debug_snapshot_checksums=True)


def _cold_then_hit(engine, prompt):
    engine.scheduler.cache.flush()
    sampling = SamplingParams(max_tokens=TOKENS, ignore_eos=True)
    (cold,) = engine.generate([prompt], sampling)
    (hit,) = engine.generate([prompt], sampling)
    assert cold.cached_tokens == 0
    return cold, hit


def test_bf16_hit_equals_cold_up_to_near_ties(llm):
    engine = llm.engine
    ex = engine.executor
    assert ex.cfg.is_hybrid and ex.params["embed"].dtype == np.dtype("bfloat16")
    rng = np.random.default_rng(0)
    # 129: the hit recomputes one token after the 128 boundary; 200: eight after 192, which the cold
    # run computed inside its 160..200 chunk
    for length, cached in [(129, 128), (200, 192)]:
        prompt = rng.integers(0, 500, length).tolist()
        cold, hit = _cold_then_hit(engine, prompt)
        assert hit.cached_tokens == cached
        assert_same_or_near_tie(prompt, (cold.output_ids, cold.logprobs), (hit.output_ids, hit.logprobs),
                                lambda ids: next_logits(ex.params, ex.cfg, ids), tol=BF16_TOL)
    assert engine.snapshot_checksum_mismatches == 0
    assert_pools_free_after_flush(engine)


def test_bf16_check_catches_a_stale_snapshot(llm):
    """Not vacuous at this tolerance: a hit that skips its state restore fails the same check.

    129 tokens, so the hit resumes one token after the 128 boundary: this random model's gates
    forget fast, and after eight recomputed tokens (the 200-token prompt) a stale state can drift
    less than a bf16 rounding does."""
    engine = llm.engine
    ex = engine.executor
    scheduler_class = type(engine.scheduler)
    prompt = np.random.default_rng(1).integers(0, 500, 129).tolist()
    FaultyScheduler.corrupt(engine.scheduler, "stale-snapshot")
    try:
        cold, hit = _cold_then_hit(engine, prompt)
    finally:
        engine.scheduler.__class__ = scheduler_class
    assert hit.cached_tokens == 128
    with pytest.raises(AssertionError, match="drift|not a near-tie"):
        assert_same_or_near_tie(prompt, (cold.output_ids, cold.logprobs), (hit.output_ids, hit.logprobs),
                                lambda ids: next_logits(ex.params, ex.cfg, ids), tol=BF16_TOL)
    assert_pools_free_after_flush(engine)
