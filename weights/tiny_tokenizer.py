"""A tiny, deterministic Qwen-style tokenizer for tiny random checkpoints (runs in the TORCH env).

``save_tiny_tokenizer(out_dir, vocab_size)`` trains a byte-level BPE on the small corpus below and
saves it through transformers' ``PreTrainedTokenizerFast.save_pretrained``, so the files on disk are
exactly the ones a real Hugging Face checkpoint ships (tokenizer.json, tokenizer_config.json and,
with transformers v5, chat_template.jinja). The engine's tokenizer is tested against transformers
on these files, and tiny checkpoints carry them so that every path of the server runs end to end.

Invariants:
- ``len(vocab) == vocab_size`` exactly: byte-level BPE tokens (the 256 byte symbols first, then
  merges), then the ``extra_specials`` in order, then the three specials ``<|endoftext|>``,
  ``<|im_start|>``, ``<|im_end|>``, whose ids are therefore ``vocab_size - 3 .. vocab_size - 1``.
  A tiny model config with the same ``vocab_size`` can emit every id the tokenizer knows and
  nothing else. Checkpoints with a vision tower pass Qwen's four vision tokens as
  ``extra_specials`` (``weights/tiny.py``), so they are special tokens at the ids the config names,
  as in real Qwen3.5 / Qwen3-VL tokenizers.
- Deterministic: the BPE trainer breaks count ties by pair ids, the corpus is a constant, and the
  training is single threaded, so every run writes byte-identical files.
- Pre-tokenisation is Qwen2's (the regex that splits digits one by one, then byte-level without a
  prefix space), the normaliser NFC, the decoder byte-level: the same pipeline as the real Qwen3 /
  Qwen3.5 tokenizers, so tokenizer-level behaviour (emoji split across tokens, specials inside
  text) matches what the engine meets in production.
"""

from __future__ import annotations

import argparse
import os

from weights.chatml import CHAT_TEMPLATE, QWEN_PRETOKENIZE_REGEX, SPECIAL_TOKENS

CORPUS = """\
The quick brown fox jumps over the lazy dog. The dog sleeps in the sun, and the fox runs into the
forest. A small model can learn a small language: it reads the same words again and again, and the
most common pairs of letters become single tokens. This is how byte pair encoding works. It starts
from the 256 possible bytes and merges the pair that appears most often, then the next pair, and so
on until the vocabulary is full.

Once upon a time there was a little girl who lived in a village near the forest. Every morning she
walked to the river to fetch water for her mother. One day she met a wolf on the path. The wolf
asked her where she was going, and she told him that she was going to see her grandmother, who lived
on the other side of the hill. The wolf smiled and said that he knew a shorter way.

The weather today is cold and windy, with a chance of rain in the afternoon. Tomorrow will be warmer,
with clear skies in the morning and clouds later in the day. The temperature will reach 18 degrees
at noon and fall to 7 degrees at night. On Saturday the wind will turn to the north and it may snow
in the mountains above 1200 metres.

Hello, how are you? I am fine, thank you. What is your name? My name is Anna. Where do you live?
I live in a house with a red door and a green garden. Do you like reading? Yes, I read every day:
books about history, science and music. What time is it? It is half past three. Can you help me with
this question? Of course, I would be happy to help you. Please tell me what you need.

A server receives a request, puts it in a queue, and the scheduler decides which requests to run in
the next step. The model reads the prompt, writes the first token, and then writes one token at a
time until it reaches the end of the answer or the limit of tokens. The cache keeps the state of
each prompt so that the next request with the same prefix can start from where the last one stopped.
Every page of the cache holds sixteen tokens, and every snapshot holds the state at a boundary of
sixty four tokens.

Numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 21 22 23 24 25 32 64 100 128 256 512
1000 1024 2048 4096 65536 3.14159 2.71828 1.41421 0.5 0.25 0.125 -1 -42 +7 1e-6 3e8 2024-06-01
12:30:45 $19.99 100% 7/8 x=3, y=4, z=5; 3 + 4 = 7; 6 * 7 = 42; 10 - 3 = 7; 81 / 9 = 9; 2^10 = 1024.
Call 555-0100 before 9:00 or after 17:30. The order 00451 ships on day 3 of week 27.

def add(a, b):
    return a + b

for i in range(10):
    print(i, i * i)

The people of the town met in the square to talk about the new bridge. Some of them wanted a bridge
of stone, and others wanted a bridge of steel. The mayor said that they would vote on it next week.
In the end they built a bridge of wood, because it was the cheapest, and it stood for a hundred
years. Children played on it in the summer and skated under it in the winter when the river froze.

Questions and answers. Question: What is the capital of France? Answer: Paris. Question: How many
days are there in a week? Answer: Seven. Question: What is two plus two? Answer: Four. Question: Who
wrote the play about the prince of Denmark? Answer: William Shakespeare. Question: What colour is the
sky on a clear day? Answer: Blue. Question: Which planet is the largest? Answer: Jupiter.

She said: "I think that we should go now, because it is getting late and the last train leaves at
eleven." He answered: "You are right, but I would like to finish my coffee first." They laughed,
paid the bill and walked together to the station, where the train was already waiting for them.
"""


def build_tokenizer(vocab_size: int, extra_specials: tuple[str, ...] = ()):
    """The raw ``tokenizers.Tokenizer`` (BPE trained on CORPUS, then ``extra_specials`` and the
    three specials)."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

    n_regular = vocab_size - len(extra_specials) - len(SPECIAL_TOKENS)
    if n_regular < 256:
        raise ValueError(f"vocab_size {vocab_size} is too small: a byte-level BPE needs 256 + "
                         f"{len(extra_specials) + len(SPECIAL_TOKENS)} tokens at least")
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=n_regular,
        min_frequency=1,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
    )
    # One "document" per line keeps the trainer's input order (and so its output) fixed.
    tok.train_from_iterator(CORPUS.splitlines(keepends=True), trainer=trainer)
    if tok.get_vocab_size() != n_regular:
        raise ValueError(
            f"the built-in corpus only supports {tok.get_vocab_size()} BPE tokens, "
            f"fewer than the {n_regular} needed for vocab_size {vocab_size}"
        )
    tok.add_special_tokens(list(extra_specials) + list(SPECIAL_TOKENS))
    assert tok.get_vocab_size() == vocab_size
    return tok


def save_tiny_tokenizer(out_dir: str | os.PathLike, vocab_size: int = 512, extra_specials: tuple[str, ...] = ()):
    """Write a Qwen-style tokenizer of exactly ``vocab_size`` tokens to ``out_dir`` with
    ``save_pretrained`` (``extra_specials``: more special tokens, just below the three); returns the
    transformers tokenizer object."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # single-threaded training: deterministic
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(
        tokenizer_object=build_tokenizer(vocab_size, tuple(extra_specials)),
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        bos_token=None,
        chat_template=CHAT_TEMPLATE,
        model_max_length=32768,
        clean_up_tokenization_spaces=False,
        split_special_tokens=False,
    )
    hf.save_pretrained(str(out_dir))
    return hf


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--vocab-size", type=int, default=512)
    args = ap.parse_args()
    save_tiny_tokenizer(args.out, args.vocab_size)


if __name__ == "__main__":
    main()
