"""Diagnostic: where a ground-truth model's full-attention heads look when it answers a needle.

For short needle probes (a handful of ``The code for NAME is DDDDDD.`` lines, one question), the
weights of every full-attention head from the position that predicts the answer's first token
(the one that must pick the line): the share on the target line, on all context lines, and on the
target code's first digit, beside the share a head that cannot tell lines apart would give the
target line (1 / lines). A model that has learnt retrieval puts most of its weight on the target
line in some head; models trained on open-vocabulary names attended to every line's first digit
about evenly. Runs the training forward (dense attention, fp32) on the CPU in about a minute:

    python -m weights.groundtruth.needle_attention weights/default [--probes 30] [--seed 11]
"""

from __future__ import annotations

import argparse
import json
import random

import jax.numpy as jnp
import numpy as np

from jaxserve.models.layers import attention_in
from weights.groundtruth import forward, tasks


def _recorder(store: list):
    """A ``train_logits`` attention backend: dense attention that also appends each layer's weights
    ``[B, heads, T, T]`` to ``store``."""
    def attend(p, cfg, x, positions, B, T):
        q, k, _, _ = attention_in(p, cfg, x, positions)
        store.append(forward.causal_attention_weights(q, k, cfg, B, T).reshape(B, cfg.num_heads, T, T))
        return forward.dense_causal_attention(p, cfg, x, positions, B, T)
    return attend


def needle_attention(folder: str, probes: int = 30, seed: int = 11, context=(40, 120)) -> dict:
    """Per full-attention layer (in order), per head, means over ``probes`` needles: ``target`` (weight
    on the target line), ``lines`` (on all context lines), ``first_digit`` (on the target code's first
    digit); ``uniform_target``: the mean of 1 / lines; ``first_token_right``: greedy first tokens right."""
    from jaxserve.tokenizer import Tokenizer
    from weights import load_model

    model = load_model(folder, dtype="float32", progress=False)
    tok = Tokenizer.from_dir(folder)
    rng = random.Random(seed)
    rows, right, inv_lines = [], [], []
    for _ in range(probes):
        msgs = tasks.needle(rng, rng.randint(*context), lambda s: len(tok.encode(s)))
        ids, mask = tasks.encode(tok, msgs)
        at = int(np.argmax(mask)) - 1  # predicts the answer's first token
        ids = list(ids[: at + 1])
        lines = msgs[0]["content"].split("\n\n")[0].split("\n")
        target = msgs[0]["content"].rsplit("What is the code for ", 1)[1].rstrip("?")
        # token spans of the context lines: each starts at "The"; the target line is the one with its name
        starts = [i for i, t in enumerate(ids) if tok.decode([t]) == "The"]
        spans = [(a, b) for a, b in zip(starts, starts[1:] + [ids.index(tok.encode("\n\n")[0], starts[-1]) + 1])]
        which = next(j for j, line in enumerate(lines) if f" {target} " in line)
        name_at = spans[which][0] + 3  # The, code, for, NAME
        store: list = []
        logits = forward.train_logits(model.params, model.config, jnp.asarray([ids]), False, "highest", _recorder(store))
        right.append(tok.decode([int(jnp.argmax(logits[0, -1]))]) == msgs[1]["content"][0])
        inv_lines.append(1 / len(spans))
        per_layer = []
        for w in store:
            row = np.asarray(w[0, :, -1])  # [heads, T]: from the answer position
            a, b = spans[which]
            per_layer.append((row[:, a:b].sum(-1), sum(row[:, s:e].sum(-1) for s, e in spans), row[:, name_at + 3]))
        rows.append(per_layer)
    out = {"probes": probes, "first_token_right": float(np.mean(right)), "uniform_target": float(np.mean(inv_lines)),
           "layers": []}
    for li in range(len(rows[0])):
        mean = lambda k: [round(float(x), 3) for x in np.mean([r[li][k] for r in rows], 0)]  # noqa: E731
        out["layers"].append({"target": mean(0), "lines": mean(1), "first_digit": mean(2)})
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("folder")
    ap.add_argument("--probes", type=int, default=30)
    ap.add_argument("--seed", type=int, default=11)
    args = ap.parse_args(argv)
    print(json.dumps(needle_attention(args.folder, args.probes, args.seed)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
