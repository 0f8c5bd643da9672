"""Token sampling over a batch of logits rows.

Each row carries its own temperature, top-k and top-p, so greedy and sampled requests share a
batch. Temperature 0 means greedy (argmax). The returned logprob is the chosen token's
log-probability under the model's raw distribution (before temperature and truncation), which is
what OpenAI-style ``logprobs`` report and what differential tests compare.

The serving step samples through ``sample_rows`` in one of two static modes, picked on the host
from the batch's temperatures (``sample_mode``): ``full`` (``sample``: a full-vocabulary sort for
top-k / top-p, one PRNG draw per row) and ``greedy`` when no row samples (argmax only; the sort
alone cost ~1 ms of a ~10 ms batch-32 decode step on an H100). A greedy row gets the same token
and the same logprob bits in either mode: both take ``argmax`` and ``chosen_logprob``.
"""

from __future__ import annotations

import math

import numpy as np

import jax
import jax.numpy as jnp
from jax import lax

INT32_MAX = 2**31 - 1
FLOAT32_MAX = 3.4028234663852886e38
GREEDY, FULL = "greedy", "full"
MODES = (GREEDY, FULL)


def check_representable(temperature: float, top_k: int) -> None:
    """Raise ``ValueError`` unless a request's knobs fit the arrays ``sample`` takes (a finite
    float32, an int32; ``SamplingParams`` checks their ranges, top_p's included). Checked when a
    request enters the engine: a value that cannot be packed would otherwise fail the whole step
    that carries it, and with it every other request in that step."""
    if not (math.isfinite(temperature) and abs(temperature) <= FLOAT32_MAX):
        raise ValueError(f"temperature must be a finite float32, got {temperature}")
    if not -INT32_MAX - 1 <= top_k <= INT32_MAX:
        raise ValueError(f"top_k must fit an int32 (at most {INT32_MAX}), got {top_k}")


def truncation_mask(scaled: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """[B, V] bool: the tokens each row may sample from its temperature-scaled logits. top-k keeps
    the logits >= the k-th largest (0 = off); top-p keeps the smallest prefix of the sorted
    distribution whose mass reaches top_p. top_p >= 1 is off, exactly: an fp32 cumulative sum can
    reach 1 before the vocabulary's tail, which a plain ``mass < top_p`` would cut."""
    vocab = scaled.shape[-1]
    sorted_logits = jnp.sort(scaled, axis=-1)[:, ::-1]
    k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)
    kth = jnp.take_along_axis(sorted_logits, (k - 1)[:, None], axis=-1)
    sorted_probs = jax.nn.softmax(sorted_logits, axis=-1)
    mass_before = jnp.cumsum(sorted_probs, axis=-1) - sorted_probs
    keep_sorted = (mass_before < top_p[:, None]) | (top_p[:, None] >= 1)
    pth = jnp.min(jnp.where(keep_sorted, sorted_logits, jnp.inf), axis=-1, keepdims=True)
    return (scaled >= kth) & (scaled >= pth)


def chosen_logprob(logits: jax.Array, tokens: jax.Array) -> jax.Array:
    """[B] fp32: each row's ``tokens`` log-probability under its raw ``logits`` [B, V]. The one
    formula of both modes, so a greedy row reports the same bits whichever program sampled it.
    The barrier keeps its row sums out of fusions with the mode's other reductions of ``logits``
    (argmax, the sort's), which could otherwise reorder them differently in each program."""
    logits = lax.optimization_barrier(logits)
    return jnp.take_along_axis(jax.nn.log_softmax(logits, axis=-1), tokens[:, None], axis=-1)[:, 0]


@jax.jit
def sample(logits: jax.Array, keys: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array):
    """logits [B, V] fp32; keys [B] PRNG keys; temperature [B] (0 = greedy); top_k [B] (0 = off);
    top_p [B] (1 = off). Returns (tokens [B] int32, logprobs [B] fp32)."""
    greedy = jnp.argmax(logits, axis=-1)
    scaled = logits / jnp.maximum(temperature, 1e-6)[:, None]
    masked = jnp.where(truncation_mask(scaled, top_k, top_p), scaled, -jnp.inf)
    sampled = jax.vmap(jax.random.categorical)(keys, masked)
    tokens = jnp.where(temperature > 0, sampled, greedy).astype(jnp.int32)
    return tokens, chosen_logprob(logits, tokens)


def sample_mode(temperature: np.ndarray) -> str:
    """The static mode of a batch with these host-side temperatures: ``GREEDY`` when no row has
    temperature > 0 (exactly the rows ``sample`` takes the argmax of; padding rows have 0)."""
    return FULL if bool(np.any(np.asarray(temperature) > 0)) else GREEDY


def sample_rows(logits: jax.Array, feed_tokens: jax.Array, seed: jax.Array, sample_idx: jax.Array,
                temperature: jax.Array, top_k: jax.Array, top_p: jax.Array, mode: str):
    """The serving step's sampler: logits [B, V] fp32 of each row's last token, the feed buffer
    [F] int32, the batch's per-row seed / sample_idx / temperature / top_k / top_p and a static
    ``mode`` (``sample_mode``). Returns (tokens [B] int32, logprobs [B] fp32, feed_out [F]): the
    tokens also written over the start of the feed buffer, the next step's ``feed_tokens``.

    ``GREEDY`` is only correct for a batch ``sample_mode`` calls greedy: it ignores temperature
    and never draws. ``FULL`` is ``sample`` with key = fold_in(key(seed), sample_idx) per row."""
    with jax.named_scope("sample"):
        if mode == GREEDY:
            tokens = jnp.argmax(logits, axis=-1).astype(jnp.int32)
            logprobs = chosen_logprob(logits, tokens)
        elif mode == FULL:
            keys = jax.vmap(lambda s, i: jax.random.fold_in(jax.random.PRNGKey(s), i))(seed, sample_idx)
            tokens, logprobs = sample(logits, keys, temperature, top_k, top_p)
        else:
            raise ValueError(f"unknown sampling mode {mode!r}; one of {MODES}")
        feed_out = lax.dynamic_update_slice(feed_tokens, tokens[: feed_tokens.shape[0]], (0,))
    return tokens, logprobs, feed_out


# One program per (B, mode): the feed buffer is donated (updated in place), the logits are not.
sample_step = jax.jit(sample_rows, static_argnames=("mode",), donate_argnames=("feed_tokens",))
