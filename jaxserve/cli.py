"""The ``jaxserve`` command line.

    jaxserve generate [--model DIR] (--prompt TEXT | --prompt-ids 1,2,3) [--max-tokens N]
                      [--temperature T] [--top-p P] [--top-k K] [--seed S] [--dtype float32|bfloat16]
                      [--chat] [--ignore-eos] [--json]

``--json`` prints one JSON object: output_ids, text, logprobs (the chosen token's logprob at each
step), finish_reason, prompt_tokens. Every user error (bad folder, bad flag value, prompt too long)
goes to stderr as one line and exits with code 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

# The small model the project ships; `jaxserve generate` / `serve` use it when --model is not given.
DEFAULT_MODEL_DIR = Path(__file__).resolve().parents[1] / "weights" / "default"


class UsageError(Exception):
    pass


def _parse_ids(text: str) -> list[int]:
    try:
        ids = [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        raise UsageError(f"--prompt-ids must be comma-separated integers, got {text!r}") from None
    if not ids:
        raise UsageError("--prompt-ids is empty")
    return ids


def _generate(args: argparse.Namespace) -> dict:
    import jax.numpy as jnp

    from jaxserve.generate import SamplingParams, generate
    from jaxserve.tokenizer import Tokenizer
    from weights import load_model

    dtype = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}[args.dtype]
    args.model = args.model or str(DEFAULT_MODEL_DIR)
    model = load_model(args.model, dtype=args.dtype, progress=not args.json)
    tokenizer = Tokenizer.from_dir(args.model)
    if args.prompt_ids is not None:
        prompt_ids = _parse_ids(args.prompt_ids)
    else:
        text = args.prompt
        if args.chat:
            text = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
        prompt_ids = tokenizer.encode(text)
    sampling = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                              top_k=args.top_k, seed=args.seed, ignore_eos=args.ignore_eos)
    eos = tuple(sorted(set(model.config.eos_token_ids) | set(tokenizer.eos_token_ids)))
    result = generate(model.params, model.config, prompt_ids, sampling, dtype=dtype, eos_token_ids=eos)
    return {
        "output_ids": result.output_ids,
        "text": tokenizer.decode(result.output_ids),
        "logprobs": result.logprobs,
        "finish_reason": result.finish_reason,
        "prompt_tokens": len(prompt_ids),
    }


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="jaxserve", description="JAX/Pallas serving engine for hybrid linear-attention LLMs")
    sub = ap.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate a completion offline for one prompt")
    g.add_argument("--model", default=None, help="Hugging Face checkpoint folder (default: the model shipped in weights/default)")
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text")
    src.add_argument("--prompt-ids", help="prompt as comma-separated token ids")
    g.add_argument("--chat", action="store_true", help="wrap --prompt as a user message with the chat template")
    g.add_argument("--max-tokens", type=int, default=16)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-sequence tokens")
    g.add_argument("--dtype", choices=("float32", "bfloat16"), default="bfloat16")
    g.add_argument("--json", action="store_true", help="print one JSON object")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "generate":
            if args.chat and args.prompt is None:
                raise UsageError("--chat needs --prompt")
            out = _generate(args)
            print(json.dumps(out) if args.json else out["text"])
            return 0
    except (UsageError, ValueError, FileNotFoundError) as e:
        # ConfigError, CheckpointError and SamplingParams' checks are ValueErrors.
        print(f"jaxserve: error: {e}", file=sys.stderr)
        return 2
    return 1


if __name__ == "__main__":
    sys.exit(main())
