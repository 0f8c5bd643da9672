"""The ground-truth models' tokenizer: a byte-level BPE trained with ``tokenizers`` (engine env,
no transformers) on the task corpus, with Qwen's pre-tokenisation, specials and ChatML template.

Files written (the layout transformers v5 ``save_pretrained`` writes, and jaxserve.tokenizer
reads): ``tokenizer.json``, ``tokenizer_config.json`` (eos ``<|im_end|>``, pad ``<|endoftext|>``)
and ``chat_template.jinja``. Ids: the BPE tokens first (the 256 byte symbols, then merges), then
the specials ``<|endoftext|>``, ``<|im_start|>``, ``<|im_end|>`` as the last three ids, so
``vocab_size`` is exactly the tokenizer's size. Deterministic (single-threaded training on a
seeded corpus): every run writes identical files.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from weights.chatml import CHAT_TEMPLATE, QWEN_PRETOKENIZE_REGEX, SPECIAL_TOKENS
from weights.groundtruth import tasks

DEFAULT_VOCAB = 1024

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


def build(vocab_size: int = DEFAULT_VOCAB, seed: int = tasks.TRAIN_SEED):
    """The raw ``tokenizers.Tokenizer``: BPE over the task corpus + chat scaffolding, then specials."""
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


FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def save(out_dir: str | os.PathLike, vocab_size: int = DEFAULT_VOCAB, seed: int = tasks.TRAIN_SEED) -> Path:
    """Train the tokenizer on the task corpus and write ``FILES`` to ``out_dir``. The BPE merges
    follow the corpus, so a change to the task generators changes the ids: a model is only valid
    with the tokenizer files written beside it."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    build(vocab_size, seed).save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(TOKENIZER_CONFIG, indent=2) + "\n")
    (out / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    return out
