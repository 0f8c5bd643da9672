"""The whole engine on tiny checkpoints of every family: scheduler + radix cache + pooled runner.

"Hit equals cold" (ARCHITECTURE.md invariant 6) end to end: the same prompt served cold and then from
the prefix cache — hits at several depths, one boundary short of the prompt end, after a finished
multi-turn answer — gives the greedy tokens of the straight-line ``jaxserve.generate`` path (itself
checked against transformers), while other requests decode in the same batches and some streams
are aborted midway. The invariant check runs after every step and the pools drain to free.
"""

from __future__ import annotations

import random

import pytest

from jaxserve.engine.llm import LLM
from jaxserve.generate import generate
from jaxserve.sampling_params import SamplingParams
from tests.engine.checks import assert_pools_free_after_flush, drive

FAMILIES = ["qwen3_5-dense", "qwen3_5_moe-moe", "qwen3_next-moe", "qwen3-base", "kimi_linear-moe"]
VOCAB = 500  # the tiny checkpoints' vocab is 512; stay below the special tokens


def greedy(n):
    return SamplingParams(max_tokens=n, ignore_eos=True)


def make_llm(folder, **kw):
    args = dict(dtype="float32", page_size=16, max_prefill_length=64, max_running_requests=4, num_pages=96,
                num_slots=24, debug_snapshot_checksums=True, progress=False)
    return LLM(str(folder), **{**args, **kw})


def cold(llm, prompt, n):
    eng = llm.engine
    ex = eng.executor
    return generate(ex.params, ex.cfg, prompt, greedy(n)).output_ids


@pytest.fixture(scope="module", params=FAMILIES)
def llm(request, oracle_dir):
    return make_llm(oracle_dir / request.param)


def test_hits_equal_cold_with_concurrent_decodes_and_aborts(llm):
    rng = random.Random(0)
    engine = llm.engine
    base = [rng.randrange(VOCAB) for _ in range(192)]
    # Hits at several depths; p129 and p192 end one token / one boundary past their hit.
    prompts = {"p150": base[:150], "p129": base[:129], "p192": base[:192], "p70": base[:70]}
    expected = {k: cold(llm, p, 6) for k, p in prompts.items()}
    neighbour_prompt = [rng.randrange(VOCAB) for _ in range(40)]

    # Cold: the longest prompt, beside a decoding neighbour and a stream aborted midway.
    first = engine.add_request(prompts["p150"], greedy(6))
    neighbour = engine.add_request(neighbour_prompt, greedy(30))
    doomed = engine.add_request(base[:100] + [1, 2, 3], greedy(30))
    outs = drive(engine, abort_at={3: [doomed]})
    assert outs[first].output_ids == expected["p150"] and outs[first].cached_tokens == 0
    assert outs[neighbour].output_ids == cold(llm, neighbour_prompt, 30)
    assert doomed not in outs

    # Hits, all in flight together with a new decoding neighbour and another aborted stream.
    rids = {k: engine.add_request(p, greedy(6)) for k, p in prompts.items()}
    neighbour = engine.add_request(neighbour_prompt + [7], greedy(20))
    doomed = engine.add_request(base[:140] + [9], greedy(30))
    outs = drive(engine, abort_at={2: [doomed]})
    unit = 64 if engine.scheduler.hybrid else 16
    for k, rid in rids.items():
        assert outs[rid].output_ids == expected[k], f"{k}: hit {outs[rid].output_ids} != cold {expected[k]}"
        # The cold pass cached base[:150]: a hit is the last usable unit of both (the last token is recomputed).
        assert outs[rid].cached_tokens == min((len(prompts[k]) - 1) // unit, 150 // unit) * unit, k
    assert outs[neighbour].output_ids == cold(llm, neighbour_prompt + [7], 20)
    assert engine.snapshot_checksum_mismatches == 0
    assert_pools_free_after_flush(engine)


def test_multi_turn_follow_up_hits_and_equals_cold(llm):
    rng = random.Random(1)
    engine = llm.engine
    turn1 = [rng.randrange(VOCAB) for _ in range(90)]
    ans = engine.generate([turn1], greedy(45))[0]
    turn2 = turn1 + ans.output_ids + [rng.randrange(VOCAB) for _ in range(20)]
    out = engine.generate([turn2], greedy(5))[0]
    assert out.output_ids == cold(llm, turn2, 5)
    assert out.cached_tokens == 128  # 90 + 45 = 135 tokens computed: the last ×64 boundary (and page) is 128
    assert engine.snapshot_checksum_mismatches == 0
    assert_pools_free_after_flush(engine)


@pytest.mark.parametrize("max_prefill", [16, 32])
def test_chunked_prefill_lengths_give_one_prefill_tokens(oracle_dir, max_prefill):
    llm = make_llm(oracle_dir / "qwen3_5-dense", max_prefill_length=max_prefill)
    rng = random.Random(2)
    prompts = [[rng.randrange(VOCAB) for _ in range(n)] for n in (100, 37, 64)]
    outs = llm.generate(prompts, greedy(5))
    for p, o in zip(prompts, outs):
        assert o.output_ids == cold(llm, p, 5)
    assert_pools_free_after_flush(llm.engine)


def test_sampling_is_seeded_per_request_and_top_k_1_is_greedy(llm):
    rng = random.Random(3)
    engine = llm.engine
    p = [rng.randrange(VOCAB) for _ in range(30)]
    hot = lambda seed, **kw: SamplingParams(max_tokens=12, temperature=1.0, seed=seed, ignore_eos=True, **kw)  # noqa: E731
    # Batched together with each other and a greedy request: seeds decide, not batch composition.
    a, b, c, g, k1 = engine.generate([p, p, p, p, p], [hot(1), hot(1), hot(2), greedy(12), hot(5, top_k=1)])
    assert a.output_ids == b.output_ids
    assert a.output_ids != c.output_ids
    assert k1.output_ids == g.output_ids == cold(llm, p, 12)
    alone = engine.generate([p], hot(1))[0]
    assert alone.output_ids == a.output_ids
    assert_pools_free_after_flush(engine)


@pytest.mark.parametrize("scan_layers", [True, False])
def test_scan_layers_serves_as_the_unrolled_layers(oracle_dir, scan_layers):
    """``scan_layers`` (the default): the engine loads the repeating layers stacked and scans them;
    ``scan_layers=False`` keeps them as a list. Either way its greedy tokens, prefix hits included,
    are those of the unrolled layers (``generate`` on the list layout)."""
    from weights.loader import load_model

    folder = oracle_dir / "qwen3_5_moe-moe"
    llm = make_llm(folder, scan_layers=scan_layers)
    layers = llm.engine.executor.params["layers"]
    assert set(layers) == {"head", "period", "tail"} if scan_layers else isinstance(layers, list)
    unrolled = load_model(folder, dtype="float32", progress=False)
    rng = random.Random(4)
    base = [rng.randrange(VOCAB) for _ in range(150)]
    prompts = [base, base[:140] + [5, 6], [rng.randrange(VOCAB) for _ in range(30)]]
    first = llm.generate(prompts[:1], greedy(8))
    rest = llm.generate(prompts[1:], greedy(8))
    assert rest[0].cached_tokens == 128
    for p, o in zip(prompts, first + rest):
        assert o.output_ids == generate(unrolled.params, unrolled.config, p, greedy(8)).output_ids
    assert llm.engine.snapshot_checksum_mismatches == 0
    assert_pools_free_after_flush(llm.engine)


def test_a_longer_snapshot_interval_snapshots_less_and_hits_equal_cold(oracle_dir):
    """``snapshot_interval=128``: a prompt leaves snapshots only at multiples of 128 (half the slots of
    64), a hit resumes from the last of them, and its tokens are still the cold ones."""
    llm = make_llm(oracle_dir / "qwen3_5-dense", snapshot_interval=128)
    engine = llm.engine
    rng = random.Random(4)
    base = [rng.randrange(VOCAB) for _ in range(300)]
    first = engine.generate([base], greedy(4))[0]
    assert first.output_ids == cold(llm, base, 4)
    cache = engine.scheduler.cache
    held = [b for b in (64, 128, 192, 256) if cache.has_snapshot_at(base[:b + 1], b)]
    assert held == [128, 256] and cache.num_snapshots == 2, held
    for n in (200, 299):  # shares 200 / 299 tokens: resumes at 128 / 256
        out = engine.generate([base[:n] + [7]], greedy(4))[0]
        assert out.cached_tokens == (n // 128) * 128
        assert out.output_ids == cold(llm, base[:n] + [7], 4)
    assert engine.snapshot_checksum_mismatches == 0
    assert_pools_free_after_flush(engine)
