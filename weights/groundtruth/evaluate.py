"""Held-out accuracy of an export through the serving code path: the folder is reloaded with
``weights.load_model`` and ``tasks.probes`` are decoded greedily (``jaxserve.generate.generate``,
or ``greedy_pieces``: the same tokens with far fewer compilations), scored by exact match.

    .venv/bin/python -c 'from weights.groundtruth.evaluate import evaluate; print(evaluate("runs/dense/export", 100, mode="pieces"))'
"""

from __future__ import annotations

from pathlib import Path

import jax.numpy as jnp

from jaxserve.config import ModelConfig
from jaxserve.models import decoder
from weights.groundtruth import tasks

def greedy_pieces(params, cfg: ModelConfig, prompt_ids: list[int], max_tokens: int, eos_ids, max_len: int) -> list[int]:
    """Greedy decoding like ``generate`` (prefill, then one-token steps through
    ``decoder.forward``), with the prompt prefilled in power-of-two pieces (2048, 1024, ..., 1)
    into one fixed-size state, so a few hundred prompts of distinct lengths compile a dozen shapes
    instead of one per length. GDN chunks are aligned to absolute positions, so pieces compute
    what one prefill would; tests check it returns what ``generate`` returns."""
    state = decoder.init_state(cfg, 1, max_len, jnp.float32)
    pos, logits, n = 0, None, len(prompt_ids)
    piece = 2048
    while pos < n:
        while piece > n - pos:
            piece //= 2
        toks = jnp.asarray([prompt_ids[pos:pos + piece]], jnp.int32)
        logits, state = decoder.forward(params, cfg, toks, jnp.arange(pos, pos + piece, dtype=jnp.int32)[None],
                                        state, last_only=True)
        pos += piece
    out: list[int] = []
    for step in range(max_tokens):
        tok = int(jnp.argmax(logits[0]))
        out.append(tok)
        if tok in eos_ids or step + 1 == max_tokens:
            break
        logits, state = decoder.forward(params, cfg, jnp.asarray([[tok]], jnp.int32),
                                        jnp.asarray([[n + step]], jnp.int32), state, last_only=True)
    return out


def evaluate(folder: str | Path, n_per_kind: int, needle_tokens=(1000, 4000), seed: int = tasks.PROBE_SEED,
             max_tokens: int = 12, mode: str = "generate", misses: list | None = None,
             kinds: tuple[str, ...] = tasks.KINDS) -> dict:
    """Accuracy per task on held-out probes, greedy, on the model reloaded from ``folder``.
    ``mode``: ``generate`` (jaxserve.generate.generate; compiles one prefill per distinct prompt
    length) or ``pieces`` (``greedy_pieces``: same tokens, a dozen compiled shapes).
    ``misses``, when given, gets one dict per wrong answer (kind, prompt tokens, question,
    expected, got): where a model fails (borrow chains, needle lengths) without a second pass.
    ``kinds``: score only these (the probes are drawn for every kind first, so a kind's probes are
    the same whichever others are asked for)."""
    from jaxserve.generate import generate
    from jaxserve.sampling_params import SamplingParams
    from jaxserve.tokenizer import Tokenizer
    from weights import load_model

    model = load_model(folder, dtype="float32", progress=False)
    tok = Tokenizer.from_dir(folder)
    eos = tuple(tok.eos_token_ids)
    sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    count = lambda s: len(tok.encode(s))  # noqa: E731
    unknown = set(kinds) - set(tasks.KINDS)
    if unknown:
        raise ValueError(f"evaluate: no probe kind {sorted(unknown)}; kinds are {list(tasks.KINDS)}")
    probes = [pr for pr in tasks.probes(n_per_kind, seed, needle_tokens, count) if pr.kind in kinds]
    encoded = [tok.encode(tok.apply_chat_template(pr.messages, add_generation_prompt=True)) for pr in probes]
    max_len = -(-(max(map(len, encoded)) + max_tokens) // 256) * 256
    right: dict[str, int] = {k: 0 for k in kinds}
    total: dict[str, int] = {k: 0 for k in kinds}
    for pr, ids in zip(probes, encoded):
        if mode == "generate":
            out = generate(model.params, model.config, ids, sampling, eos_token_ids=eos).output_ids
        else:
            out = greedy_pieces(model.params, model.config, ids, max_tokens, eos, max_len)
        total[pr.kind] += 1
        got = tok.decode(out)
        ok = tasks.score(pr.answer, got)
        right[pr.kind] += ok
        if not ok and misses is not None:
            misses.append({"kind": pr.kind, "prompt_tokens": len(ids), "question": pr.messages[-1]["content"],
                           "expected": pr.answer, "got": got})
    return {k: {"right": right[k], "n": total[k], "accuracy": right[k] / max(total[k], 1)} for k in kinds}
