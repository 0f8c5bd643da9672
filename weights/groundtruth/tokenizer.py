"""The ground-truth models' tokenizer: a byte-level BPE trained with ``tokenizers`` (engine env,
no transformers) on the task corpus, with Qwen's pre-tokenisation, specials and ChatML template.

Files written (the layout transformers v5 ``save_pretrained`` writes, and jaxserve.tokenizer
reads): ``tokenizer.json``, ``tokenizer_config.json`` (eos ``<|im_end|>``, pad ``<|endoftext|>``)
and ``chat_template.jinja``. Ids, in three ranges: the trained BPE tokens (``BASE_VOCAB - 3`` of
them: the 256 byte symbols, then merges), the specials ``<|endoftext|>``, ``<|im_start|>``,
``<|im_end|>`` (ids ``BASE_VOCAB - 3 .. BASE_VOCAB - 1``), then the name tokens that
``with_single_token_names`` appends so that every needle NAME of ``tasks.NAME_POOL`` is one
token. ``vocab_size`` is exactly the tokenizer's size. The first two ranges are the whole
tokenizer of the earliest exports (1024 ids), so ``with_single_token_names`` can extend such a model's
tokenizer (and ``train --extend-vocab`` its embeddings) without moving an id. Deterministic
(single-threaded training on a seeded corpus): every run writes identical files.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from weights.chatml import CHAT_TEMPLATE, QWEN_PRETOKENIZE_REGEX, SPECIAL_TOKENS
from weights.groundtruth import tasks

BASE_VOCAB = 1024  # trained BPE tokens + the three specials; name tokens come after

TOKENIZER_CONFIG = {
    "backend": "tokenizers",
    "bos_token": None,
    "clean_up_tokenization_spaces": False,
    "eos_token": "<|im_end|>",
    "model_max_length": 32768,
    "pad_token": "<|endoftext|>",
    "split_special_tokens": False,
    "tokenizer_class": "TokenizersBackend",
    "unk_token": None,
}


def build_base(vocab_size: int = BASE_VOCAB, seed: int = tasks.TRAIN_SEED):
    """The trained byte-level BPE (``vocab_size - 3`` tokens) plus the specials: the first two id
    ranges (see the module doc)."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

    n_regular = vocab_size - len(SPECIAL_TOKENS)
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=n_regular, min_frequency=2, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=[])
    text = tasks.corpus(seed) + ["system", "user", "assistant", "You are a helpful assistant."] * 50
    tok.train_from_iterator(text, trainer=trainer)
    # A corpus too small for the requested size yields fewer merges: pad with unused byte-pair
    # tokens would change nothing useful, so report it instead.
    if tok.get_vocab_size() != n_regular:
        raise ValueError(f"task corpus gives {tok.get_vocab_size()} BPE tokens, fewer than {n_regular}")
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    assert tok.get_vocab_size() == vocab_size
    return tok


def with_single_token_names(tok, names=tasks.NAME_POOL):
    """``tok`` (a ``tokenizers.Tokenizer``, byte-level BPE) with merges and tokens appended so that
    ``" " + name`` is ONE token for every name; every existing id and merge is kept.

    For a name that ``tok`` splits into pieces p0 p1 ... pn, the chain of merges (p0, p1),
    (p0p1, p2), ... is appended (each new string gets the next id). Appended merges rank after all
    existing ones, so a word first tokenises as before and then the chain joins it; a chain's left
    element always begins with the space symbol (a name's first piece) and no middle piece does,
    so two chains never compete inside one word. Checked: every name encodes to one token."""
    import json

    from tokenizers import Tokenizer

    spec = json.loads(tok.to_str())
    vocab, merges = spec["model"]["vocab"], spec["model"]["merges"]
    have = {tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in merges}
    # The specials' ids sit below the appended tokens: list them in the model vocab too, or
    # ``from_str`` would renumber them to the end.
    for added in spec["added_tokens"]:
        vocab.setdefault(added["content"], added["id"])
    next_id = tok.get_vocab_size(with_added_tokens=True)
    for name in names:
        pieces = [tok.id_to_token(i) for i in tok.encode(" " + name).ids]
        cur = pieces[0]
        for p in pieces[1:]:
            if (cur, p) not in have:
                have.add((cur, p))
                merges.append([cur, p] if not merges or isinstance(merges[0], list) else f"{cur} {p}")
            cur = cur + p
            if cur not in vocab:
                vocab[cur] = next_id
                next_id += 1
    out = Tokenizer.from_str(json.dumps(spec))
    split = [n for n in names if len(out.encode(" " + n).ids) != 1]
    if split:
        raise ValueError(f"{len(split)} names still split, e.g. {split[:3]}")
    moved = [a["content"] for a in spec["added_tokens"] if out.token_to_id(a["content"]) != a["id"]]
    assert not moved, f"special tokens renumbered: {moved}"
    return out


def build(seed: int = tasks.TRAIN_SEED):
    """The ground-truth tokenizer: ``build_base`` + ``with_single_token_names``."""
    return with_single_token_names(build_base(BASE_VOCAB, seed))


FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def save(out_dir: str | os.PathLike, seed: int = tasks.TRAIN_SEED, tokenizer=None) -> Path:
    """Write ``FILES`` to ``out_dir``: ``tokenizer`` (a ``tokenizers.Tokenizer``), by default
    ``build(seed)`` trained on the task corpus. The BPE merges follow the corpus, so a change to
    the task generators changes the ids: a model is only valid with the tokenizer files written
    beside it."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (tokenizer or build(seed)).save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(TOKENIZER_CONFIG, indent=2) + "\n")
    (out / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    return out
