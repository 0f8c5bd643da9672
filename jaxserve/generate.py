"""The reference generation path: one prompt, prefill, then one-token decode steps until a stop.

No scheduler, no pools, no prefix cache: the differential tests compare the serving engine with it
(they must produce the same tokens) and the ground-truth trainer evaluates with it. Everything that
serves requests, ``jaxserve generate`` and ``LLM.generate`` included, goes through
``Engine.generate`` instead. Shapes are bucketed so repeated calls reuse compiled steps: the
state's length is rounded up to a multiple of ``LEN_BUCKET``, and decode always runs [1, 1].
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxserve.models import decoder, vision
from jaxserve.sampler import sample
from jaxserve.sampling_params import SamplingParams, check_prompt_ids

LEN_BUCKET = 256


@dataclasses.dataclass
class Generation:
    output_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" (eos / stop token) or "length"


def generate(params, cfg, prompt_ids: list[int], sampling: SamplingParams, dtype=jnp.float32,
             eos_token_ids: tuple[int, ...] = (), images=None) -> Generation:
    """``images``: the prompt's preprocessed images (``PixelPatches``, in order) when its
    placeholders are expanded (``jaxserve.multimodal.prompt.expand_placeholders``)."""
    check_prompt_ids(prompt_ids, cfg.vocab_size)
    total = len(prompt_ids) + sampling.max_tokens
    if total > cfg.max_position_embeddings:
        raise ValueError(
            f"prompt ({len(prompt_ids)} tokens) + max_tokens ({sampling.max_tokens}) exceeds the model's "
            f"context of {cfg.max_position_embeddings} tokens"
        )
    max_len = -(-total // LEN_BUCKET) * LEN_BUCKET
    stops = set(sampling.stop_token_ids) | (set() if sampling.ignore_eos else set(eos_token_ids or cfg.eos_token_ids))

    state = decoder.init_state(cfg, 1, max_len, dtype)
    n = len(prompt_ids)
    tokens = jnp.asarray([prompt_ids], jnp.int32)
    mm, delta = vision.dense_images(params, cfg, prompt_ids, images) if images else (None, 0)
    logits, state = decoder.forward(params, cfg, tokens, jnp.arange(n, dtype=jnp.int32)[None], state, last_only=True,
                                    images=mm)

    key = jax.random.PRNGKey(sampling.seed)
    knobs = (jnp.asarray([sampling.temperature], jnp.float32), jnp.asarray([sampling.top_k], jnp.int32),
             jnp.asarray([sampling.top_p], jnp.float32))
    out, logprobs = [], []
    for step in range(sampling.max_tokens):
        key, sub = jax.random.split(key)
        tok, lp = sample(logits, sub[None], *knobs)
        tok_id = int(tok[0])
        out.append(tok_id)
        logprobs.append(float(lp[0]))
        if tok_id in stops:
            return Generation(out, logprobs, "stop")
        if step + 1 == sampling.max_tokens:
            break
        pos = jnp.asarray([[n + step]], jnp.int32)
        step_mm = vision.text_only(cfg, pos, delta, cfg.hidden_size, params["embed"].dtype) if images else None
        logits, state = decoder.forward(params, cfg, tok[:, None], pos, state, last_only=True, images=step_mm)
    return Generation(out, logprobs, "length")

