"""Token sampling over a batch of logits rows, one jitted function for every request mix.

Each row carries its own temperature, top-k and top-p, so greedy and sampled requests share a
batch. Temperature 0 means greedy (argmax). The returned logprob is the chosen token's
log-probability under the model's raw distribution (before temperature and truncation), which is
what OpenAI-style ``logprobs`` report and what differential tests compare.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

INT32_MAX = 2**31 - 1
FLOAT32_MAX = 3.4028234663852886e38


def check_representable(temperature: float, top_k: int) -> None:
    """Raise ``ValueError`` unless a request's knobs fit the arrays ``sample`` takes (a finite
    float32, an int32; ``SamplingParams`` checks their ranges, top_p's included). Checked when a
    request enters the engine: a value that cannot be packed would otherwise fail the whole step
    that carries it, and with it every other request in that step."""
    if not (math.isfinite(temperature) and abs(temperature) <= FLOAT32_MAX):
        raise ValueError(f"temperature must be a finite float32, got {temperature}")
    if not -INT32_MAX - 1 <= top_k <= INT32_MAX:
        raise ValueError(f"top_k must fit an int32 (at most {INT32_MAX}), got {top_k}")


@jax.jit
def sample(logits: jax.Array, keys: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array):
    """logits [B, V] fp32; keys [B] PRNG keys; temperature [B] (0 = greedy); top_k [B] (0 = off);
    top_p [B] (1 = off). Returns (tokens [B] int32, logprobs [B] fp32)."""
    logprobs_all = jax.nn.log_softmax(logits, axis=-1)
    greedy = jnp.argmax(logits, axis=-1)

    vocab = logits.shape[-1]
    scaled = logits / jnp.maximum(temperature, 1e-6)[:, None]
    sorted_logits = jnp.sort(scaled, axis=-1)[:, ::-1]
    # top-k: keep logits >= the k-th largest.
    k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)
    kth = jnp.take_along_axis(sorted_logits, (k - 1)[:, None], axis=-1)
    # top-p: keep the smallest prefix of the sorted distribution whose mass reaches top_p.
    sorted_probs = jax.nn.softmax(sorted_logits, axis=-1)
    mass_before = jnp.cumsum(sorted_probs, axis=-1) - sorted_probs
    keep_sorted = mass_before < top_p[:, None]
    pth = jnp.min(jnp.where(keep_sorted, sorted_logits, jnp.inf), axis=-1, keepdims=True)
    masked = jnp.where((scaled >= kth) & (scaled >= pth), scaled, -jnp.inf)
    sampled = jax.vmap(jax.random.categorical)(keys, masked)

    tokens = jnp.where(temperature > 0, sampled, greedy).astype(jnp.int32)
    return tokens, jnp.take_along_axis(logprobs_all, tokens[:, None], axis=-1)[:, 0]
