"""Offline generation for one prompt: prefill, then one-token decode steps until a stop.

This is the straight-line path the CLI and the differential tests use; the serving engine
(scheduler + runner) batches many sequences over pooled state and must produce the same tokens.
Shapes are bucketed so repeated calls reuse compiled steps: the state's length is rounded up to a
multiple of ``LEN_BUCKET``, and decode always runs [1, 1].
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxserve.models import decoder, vision
from jaxserve.sampler import sample

LEN_BUCKET = 256


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()
    # Scheduling, read only by policies (jaxserve/engine/policy.py): lower priority values go first
    # under ``--policy priority`` (vLLM's convention); ``tenant`` is whom ``--policy fair`` shares by.
    priority: int = 0
    tenant: str = ""

    def __post_init__(self):
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")


@dataclasses.dataclass
class Generation:
    output_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" (eos / stop token) or "length"


def generate(params, cfg, prompt_ids: list[int], sampling: SamplingParams, dtype=jnp.float32,
             eos_token_ids: tuple[int, ...] = (), images=None) -> Generation:
    """``images``: the prompt's preprocessed images (``PixelPatches``, in order) when its
    placeholders are expanded (``jaxserve.multimodal.prompt.expand_placeholders``)."""
    if not prompt_ids:
        raise ValueError("prompt is empty")
    if max(prompt_ids) >= cfg.vocab_size or min(prompt_ids) < 0:
        raise ValueError(f"prompt token ids must be in [0, {cfg.vocab_size})")
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

