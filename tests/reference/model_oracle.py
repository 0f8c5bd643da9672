"""Torch side of the model differential tests (runs in the torch reference environment).

    python -m tests.reference.model_oracle SPEC.json OUT_DIR

SPEC.json: {"checkpoints": [{"family", "variant", "seed"} | {"name", "path", "prompt"}], "prompt_len",
"new_tokens", "prompt_seed"}. For each tiny checkpoint it writes the folder with weights.tiny
(OUT_DIR/<family>-<variant>); a shipped checkpoint (``path``, e.g. the trained default model) is read
where it is, with its own ``prompt`` ids, and its record goes to OUT_DIR/<name>. Then, with
transformers in fp32:
- greedy-generates ``new_tokens`` tokens from a random prompt with eos ignored (``generate``);
- runs one full forward over prompt + generated tokens and keeps every position's logits.
Results go to OUT_DIR/<family>-<variant>/oracle.npz (prompt, generated, logits).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import torch
import transformers

from weights.tiny import VOCAB, write


def _causal_lm(folder: Path):
    config = transformers.AutoConfig.from_pretrained(folder)
    if getattr(config, "text_config", None) is not None and config.model_type == "qwen3_5":
        return transformers.Qwen3_5ForConditionalGeneration.from_pretrained(folder, dtype=torch.float32)
    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)


def main(spec_path: str, out_dir: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    rng = np.random.default_rng(spec["prompt_seed"])
    # Token ids below the three special tokens at the top of the tiny vocab.
    prompt = rng.integers(0, VOCAB - 8, size=spec["prompt_len"]).astype(np.int64)
    torch.set_grad_enabled(False)
    for ck in spec["checkpoints"]:
        if "path" in ck:
            folder = Path(out_dir) / ck["name"]
            folder.mkdir(parents=True, exist_ok=True)
            model = _causal_lm(Path(ck["path"])).eval()
            ck_prompt = np.asarray(ck["prompt"], np.int64)
        else:
            folder = Path(out_dir) / f"{ck['family']}-{ck['variant']}"
            write(ck["family"], ck["variant"], str(folder), ck.get("seed", 0))
            model = _causal_lm(folder).eval()
            ck_prompt = prompt
        ids = torch.from_numpy(ck_prompt)[None]
        gen = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=spec["new_tokens"], min_new_tokens=spec["new_tokens"],
            do_sample=False, eos_token_id=None, pad_token_id=0,
        )
        full = gen[0]
        logits = model(full[None]).logits[0].float().numpy()
        new = full[len(ck_prompt):]
        np.savez(folder / "oracle.npz", prompt=ck_prompt, generated=new.numpy(), logits=logits)
        print(f"{folder.name}: generated {new.tolist()[:8]}...", file=sys.stderr)


if __name__ == "__main__":
    main(*sys.argv[1:])
