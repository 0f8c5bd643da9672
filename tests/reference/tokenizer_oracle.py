"""Torch-env oracle for the tokenizer tests: what transformers does on a tiny tokenizer.

    python -m tests.reference.tokenizer_oracle --cases cases.json --out-dir DIR --result result.json

Writes the tiny tokenizer (weights.tiny_tokenizer) to DIR, loads it back with AutoTokenizer, and
answers the cases: ``texts`` -> ``tokenizer(text)["input_ids"]``; ``id_lists`` -> ``decode`` with
and without skip_special_tokens; ``chats`` (each ``{"messages", "add_generation_prompt", "kwargs"}``
and optionally ``"chat_template"``) -> ``apply_chat_template(..., tokenize=False)``, or the
exception's type and message when the template raises. It also writes the tokenizer a second time
and reports whether the files are byte-identical (determinism of the factory).
"""

from __future__ import annotations

import argparse
import filecmp
import json
import os
import tempfile


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", required=True)
    ap.add_argument("--out-dir", required=True)
    ap.add_argument("--result", required=True)
    args = ap.parse_args()

    from transformers import AutoTokenizer

    from weights.tiny_tokenizer import save_tiny_tokenizer

    cases = json.load(open(args.cases, encoding="utf-8"))
    save_tiny_tokenizer(args.out_dir, cases["vocab_size"])
    with tempfile.TemporaryDirectory() as again:
        save_tiny_tokenizer(again, cases["vocab_size"])
        names = sorted(os.listdir(args.out_dir))
        match, mismatch, errors = filecmp.cmpfiles(args.out_dir, again, names, shallow=False)
        deterministic = names == sorted(os.listdir(again)) and not mismatch and not errors

    tok = AutoTokenizer.from_pretrained(args.out_dir)
    chats = []
    for case in cases["chats"]:
        try:
            text = tok.apply_chat_template(
                case["messages"],
                tokenize=False,
                add_generation_prompt=case.get("add_generation_prompt", False),
                chat_template=case.get("chat_template"),
                tools=case.get("tools"),
                **case.get("kwargs", {}),
            )
            chats.append({"text": text})
        except Exception as e:  # noqa: BLE001 - the error itself is the oracle's answer
            chats.append({"error": type(e).__name__, "message": str(e)})
    result = {
        "files": names,
        "deterministic": deterministic,
        "len": len(tok),
        "eos_token_id": tok.eos_token_id,
        "encode": [tok(t)["input_ids"] for t in cases["texts"]],
        "decode_skip": [tok.decode(ids, skip_special_tokens=True) for ids in cases["id_lists"]],
        "decode_keep": [tok.decode(ids, skip_special_tokens=False) for ids in cases["id_lists"]],
        "chats": chats,
    }
    with open(args.result, "w", encoding="utf-8") as f:
        json.dump(result, f, ensure_ascii=False)


if __name__ == "__main__":
    main()
