"""The sampler (jaxserve/sampler.py) against a float64 numpy reference of top-k / top-p truncation,
greedy choice and the reported logprob; its greedy and full modes against each other."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxserve import sampler
from jaxserve.sampler import sample, truncation_mask

V = 64


def reference_mask(scaled: np.ndarray, top_k: int, top_p: float) -> np.ndarray:
    """The tokens a row may sample: the top_k largest (ties at the k-th kept), then the smallest
    prefix of the sorted distribution whose mass reaches top_p (all of it at top_p >= 1)."""
    order = np.argsort(-scaled, kind="stable")
    s = scaled[order].astype(np.float64)
    keep = np.ones(len(s), bool)
    if top_k > 0:
        keep &= s >= s[min(top_k, len(s)) - 1]
    if top_p < 1:
        p = np.exp(s - s.max())
        p /= p.sum()
        keep &= (np.cumsum(p) - p) < top_p
    threshold = s[keep].min()
    return scaled >= threshold


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), top_k=st.sampled_from([0, 1, 2, 5, V, V + 3]),
       top_p=st.sampled_from([1.0, 0.95, 0.5, 0.1, 1e-6]), spread=st.sampled_from([0.1, 1.0, 8.0]))
def test_truncation_mask_matches_the_reference(seed, top_k, top_p, spread):
    rng = np.random.default_rng(seed)
    scaled = (rng.standard_normal(V) * spread).astype(np.float32)
    got = np.asarray(truncation_mask(jnp.asarray(scaled)[None], jnp.array([top_k]), jnp.array([top_p], jnp.float32)))[0]
    want = reference_mask(scaled, top_k, top_p)
    # fp32 vs float64 mass can disagree only about a token whose mass_before sits at top_p itself
    probs = np.exp(scaled - scaled.max()) / np.exp(scaled - scaled.max()).sum()
    order = np.argsort(-scaled, kind="stable")
    before = np.empty(V)
    before[order] = np.cumsum(probs[order]) - probs[order]
    differ = got != want
    assert np.all(np.abs(before[differ] - top_p) < 1e-5), (np.flatnonzero(differ), before[differ])
    assert got[np.argmax(scaled)]  # the most likely token is always kept


def test_top_p_one_keeps_the_tail_where_fp32_mass_saturates():
    """One token holds all but ~1e-12 of the mass: its fp32 cumulative sum is 1.0 already, and a
    ``mass_before < 1`` rule would drop every other token. top_p = 1 is "off": all are kept."""
    scaled = np.full(V, -30.0, np.float32)
    scaled[3] = 0.0
    mask = np.asarray(truncation_mask(jnp.asarray(scaled)[None], jnp.array([0]), jnp.array([1.0], jnp.float32)))[0]
    assert mask.all()


def test_greedy_rows_take_the_argmax_and_report_the_raw_logprob():
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((4, V)).astype(np.float32) * 3
    keys = jax.vmap(jax.random.PRNGKey)(jnp.arange(4))
    temperature = jnp.array([0.0, 0.7, 0.0, 1.3], jnp.float32)
    tokens, logprobs = sample(jnp.asarray(logits), keys, temperature, jnp.array([0, 5, 3, 0]),
                              jnp.array([1.0, 0.9, 0.5, 1.0], jnp.float32))
    tokens, logprobs = np.asarray(tokens), np.asarray(logprobs)
    assert tokens[0] == logits[0].argmax() and tokens[2] == logits[2].argmax()
    lse = np.log(np.exp(logits.astype(np.float64)).sum(-1))
    np.testing.assert_allclose(logprobs, logits[np.arange(4), tokens] - lse, atol=1e-5)
    assert reference_mask(logits[1] / 0.7, 5, 0.9)[tokens[1]]  # a sampled row stays inside its truncation


def test_sampling_follows_the_truncated_distribution():
    """Over many keys, a top-k = 2 row samples its two tokens in proportion to their probabilities."""
    logits = np.array([[2.0, 1.0, 0.5, -1.0] + [-5.0] * (V - 4)], np.float32)
    n = 4000
    keys = jax.vmap(jax.random.PRNGKey)(jnp.arange(n))
    tokens, _ = jax.vmap(lambda k: sample(jnp.asarray(logits), k[None], jnp.array([1.0]), jnp.array([2]),
                                          jnp.array([1.0])))(keys)
    counts = np.bincount(np.asarray(tokens)[:, 0], minlength=V)
    assert counts[2:].sum() == 0
    p0 = 1 / (1 + np.exp(-1.0))
    assert abs(counts[0] / n - p0) < 4 * np.sqrt(p0 * (1 - p0) / n)


def _rows(rng: np.random.Generator, B: int, sampled: bool):
    """A [B, V] logits batch with its sampling fields; rows 1, 3, .. sample when ``sampled``. Ties
    at the maximum in row 0 (argmax must take the first)."""
    logits = (rng.standard_normal((B, V)) * 4).astype(np.float32)
    logits[0, [5, 9]] = logits[0].max() + 1
    temperature = np.where(np.arange(B) % 2 == 1, 0.8, 0.0).astype(np.float32) if sampled else np.zeros(B, np.float32)
    return (jnp.asarray(logits), rng.integers(0, 2**32, B, dtype=np.uint32), np.arange(B, dtype=np.int32),
            temperature, np.where(np.arange(B) % 3 == 0, 5, 0).astype(np.int32), np.full(B, 0.9, np.float32))


def _run(logits, seed, idx, temperature, top_k, top_p, mode, F=8):
    feed = jnp.full((F,), -7, jnp.int32)
    tokens, logprobs, feed_out = sampler.sample_step(logits, feed, seed, idx, temperature, top_k, top_p, mode)
    return np.asarray(tokens), np.asarray(logprobs), np.asarray(feed_out)


def test_sample_mode_is_greedy_only_without_a_positive_temperature():
    assert sampler.sample_mode(np.zeros(4, np.float32)) == sampler.GREEDY
    assert sampler.sample_mode(np.array([0.0, -1.0], np.float32)) == sampler.GREEDY  # sample() argmaxes these too
    assert sampler.sample_mode(np.array([0.0, 1e-3], np.float32)) == sampler.FULL


def test_greedy_mode_gives_the_full_modes_bits_for_greedy_rows():
    """The same logits through both programs: greedy rows get the same token and the same logprob
    bits (one ``chosen_logprob``), the argmax (first on ties) and the float64 reference's logprob;
    the feed buffer's head holds the tokens, its tail is untouched."""
    rng = np.random.default_rng(1)
    for B, F in ((1, 8), (4, 8), (16, 8)):
        args = _rows(rng, B, sampled=False)
        greedy, full = _run(*args, sampler.GREEDY, F), _run(*args, sampler.FULL, F)
        for g, f in zip(greedy, full):
            np.testing.assert_array_equal(g, f)
        logits = np.asarray(args[0]).astype(np.float64)
        tokens, logprobs, feed = greedy
        np.testing.assert_array_equal(tokens, logits.argmax(-1))
        assert tokens[0] == 5
        lse = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
        np.testing.assert_allclose(logprobs, logits[np.arange(B), tokens] - lse, atol=1e-5)
        n = min(B, F)
        np.testing.assert_array_equal(feed[:n], tokens[:n])
        assert np.all(feed[n:] == -7)


def test_full_mode_is_sample_with_the_rows_keys():
    """A mixed batch: the full program is ``sample`` with key = fold_in(key(seed), sample_idx); its
    greedy rows match the greedy program's bits on the same logits, and its sampled rows stay inside
    their truncation."""
    rng = np.random.default_rng(2)
    logits, seed, idx, temperature, top_k, top_p = args = _rows(rng, 8, sampled=True)
    tokens, logprobs, _ = _run(*args, sampler.FULL)
    keys = jax.vmap(lambda s, i: jax.random.fold_in(jax.random.PRNGKey(s), i))(seed, idx)
    want_tokens, want_logprobs = sample(logits, keys, temperature, top_k, top_p)
    np.testing.assert_array_equal(tokens, np.asarray(want_tokens))
    np.testing.assert_array_equal(logprobs, np.asarray(want_logprobs))
    g_tokens, g_logprobs, _ = _run(*args, sampler.GREEDY)
    greedy = temperature == 0
    np.testing.assert_array_equal(tokens[greedy], g_tokens[greedy])
    np.testing.assert_array_equal(logprobs[greedy], g_logprobs[greedy])
    for b in np.flatnonzero(~greedy):
        assert reference_mask(np.asarray(logits)[b] / temperature[b], top_k[b], top_p[b])[tokens[b]]
