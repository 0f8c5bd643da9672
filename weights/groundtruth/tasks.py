"""Seeded, deterministic generators for the ground-truth tasks, their token/loss-mask encoding,
held-out probes and the exact-match scorer.

User-message forms (issue 5, exactly):
- arithmetic: ``What is A + B?`` / ``What is A - B?`` with 0 <= A, B <= 9999 -> the bare result
  (``-512``);
- needle: a context of filler lines ``The code for NAME is DDDDDD.`` (NAME a capitalised word,
  DDDDDD six digits, names distinct within a context), then ``What is the code for NAME?`` ->
  ``DDDDDD``. The context and the question are one user message (context, blank line, question);
- recall: ``Remember: my ATTR is VALUE.`` -> ``OK.``, then other turns (arithmetic, small talk),
  then ``What is my ATTR?`` -> ``VALUE``.

A conversation is a list of ``{"role", "content"}`` messages; the last one is the assistant's
answer. ``encode`` renders it with the chat template (the system prompt comes from the template)
and returns token ids plus a loss mask that is 1 exactly on the tokens of every assistant message's
content and the ``<|im_end|>`` that closes it.
"""

from __future__ import annotations

import dataclasses
import random
from typing import Callable

import numpy as np

KINDS = ("arithmetic", "needle", "recall")
# Training-only kinds (no probes, no chat template): see ``needle_echo``.
TRAIN_KINDS = KINDS + ("echo",)
TRAIN_SEED = 0
PROBE_SEED = 1_000_003  # held-out probes: a different stream from any training seed

_ONSETS = ["b", "br", "c", "ch", "d", "dr", "f", "g", "gr", "h", "j", "k", "l", "m", "n", "p", "pr",
           "r", "s", "sh", "st", "t", "tr", "v", "w", "z"]
_VOWELS = ["a", "e", "i", "o", "u", "ai", "ea", "io", "ou"]
_CODAS = ["", "", "n", "r", "l", "s", "th", "x", "m", "k"]

ATTRIBUTES: dict[str, list[str]] = {
    "favourite colour": ["red", "blue", "green", "yellow", "purple", "orange", "black", "white", "pink", "grey"],
    "name": ["Anna", "Ben", "Clara", "David", "Elena", "Felix", "Grace", "Hugo", "Iris", "Jonas", "Karin", "Leo"],
    "city": ["Paris", "Berlin", "Madrid", "Rome", "Vienna", "Oslo", "Lisbon", "Prague", "Dublin", "Warsaw"],
    "pet": ["cat", "dog", "rabbit", "parrot", "hamster", "turtle", "goldfish", "horse"],
    "favourite number": [str(n) for n in range(1, 100)],
    "job": ["teacher", "doctor", "baker", "pilot", "farmer", "nurse", "engineer", "painter", "writer"],
    "favourite food": ["pizza", "pasta", "soup", "rice", "bread", "cheese", "apples", "salad", "fish"],
    "car": ["Volvo", "Fiat", "Toyota", "Skoda", "Renault", "Honda", "Ford", "Mazda"],
    "password": [],  # six digits, generated
}

SMALL_TALK: list[tuple[str, str]] = [
    ("Hello!", "Hello! How can I help you?"),
    ("How are you?", "I am fine, thank you."),
    ("Thank you.", "You are welcome."),
    ("What a nice day.", "Yes, it is a nice day."),
    ("Can you help me?", "Of course."),
    ("Good morning.", "Good morning!"),
    ("I like music.", "Music is great."),
    ("Tell me something.", "The sky is blue."),
]


def _pseudo_word(rng: random.Random) -> str:
    """A capitalised pseudo-word of 2-3 syllables."""
    syll = [rng.choice(_ONSETS) + rng.choice(_VOWELS) for _ in range(rng.randint(2, 3))]
    return ("".join(syll) + rng.choice(_CODAS)).capitalize()


def _name_pool(size: int, seed: int) -> tuple[str, ...]:
    rng, seen, pool = random.Random(seed), set(), []
    while len(pool) < size:
        w = _pseudo_word(rng)
        if w not in seen:
            seen.add(w)
            pool.append(w)
    return tuple(pool)


# Needle NAMEs come from a fixed pool of capitalised pseudo-words, large enough for the longest
# context (a 4k-token context holds ~300 lines, names distinct) and small enough that the
# tokenizer gives every name ONE token (``tokenizer.build``): retrieval then matches one key
# token instead of 2-5 BPE pieces. Models trained on open-vocabulary names learnt copying
# but not name-to-line selection in ~4k steps. Probes draw from the same
# pool; the held-out part of a probe is its (context, names, codes, target) combination.
NAME_POOL_SIZE = 1024
NAME_POOL: tuple[str, ...] = _name_pool(NAME_POOL_SIZE, seed=20261203)


def name(rng: random.Random) -> str:
    """A needle NAME: one of ``NAME_POOL``."""
    return NAME_POOL[rng.randrange(len(NAME_POOL))]


def _operand(rng: random.Random, mixed_digits: bool) -> int:
    """0..9999 uniformly (probes), or (training, ``mixed_digits``) first a digit count 1..4 uniformly,
    then a number of that many digits: short operands teach digit alignment and carries early
    instead of 90 % of examples being 4-digit."""
    if not mixed_digits:
        return rng.randint(0, 9999)
    n = rng.randint(1, 4)
    return rng.randint(0 if n == 1 else 10 ** (n - 1), 10**n - 1)


def arithmetic(rng: random.Random, mixed_digits: float = 0.0) -> list[dict]:
    """``What is A op B?`` and its answer. Training option (probes leave it at 0, the probes'
    random stream): ``mixed_digits``, the fraction of problems whose operands are drawn by digit
    count (``_operand``; True = all, the rest uniform over 0..9999 as the probes draw them; only a
    fraction strictly between 0 and 1 costs a draw, so 0 and 1 keep their streams)."""
    if not 0.0 <= mixed_digits <= 1.0:
        raise ValueError(f"mixed_digits={mixed_digits}: a fraction in [0, 1]")
    mixed = mixed_digits >= 1.0 or (mixed_digits > 0.0 and rng.random() < mixed_digits)
    a, b = _operand(rng, mixed), _operand(rng, mixed)
    op = rng.choice("+-")
    return [{"role": "user", "content": f"What is {a} {op} {b}?"},
            {"role": "assistant", "content": str(a + b if op == "+" else a - b)}]


def needle_lines(rng: random.Random, n_lines: int) -> tuple[list[str], list[tuple[str, str]]]:
    names: list[str] = []
    seen = set()
    while len(names) < n_lines:
        n = name(rng)
        if n not in seen:
            seen.add(n)
            names.append(n)
    pairs = [(n, f"{rng.randint(0, 999999):06d}") for n in names]
    return [f"The code for {n} is {c}." for n, c in pairs], pairs


def _line(name_: str, code: str) -> str:
    return f"The code for {name_} is {code}."


def _context_pairs(rng: random.Random, context_tokens: int,
                   count_tokens: Callable[[str], int] | None) -> list[tuple[str, str]]:
    """(NAME, code) of a needle context's lines, names distinct, until the lines (each with its
    newline) reach ``context_tokens`` (``count_tokens`` measures a line; without it a line counts
    12 tokens, about what the shipped tokenizer gives). The draw order is part of the probes'
    held-out stream: keep it."""
    pairs: list[tuple[str, str]] = []
    total, seen = 0, set()
    while total < context_tokens or not pairs:
        n = name(rng)
        if n in seen:
            continue
        seen.add(n)
        code = f"{rng.randint(0, 999999):06d}"
        pairs.append((n, code))
        total += count_tokens(_line(n, code) + "\n") if count_tokens else 12
    return pairs


def needle(rng: random.Random, context_tokens: int, count_tokens: Callable[[str], int] | None = None,
           follow_ups: int = 0, shared_prefix: float = 0.0) -> list[dict]:
    """A needle conversation whose context is about ``context_tokens`` tokens (``_context_pairs``).
    The probe form has ``follow_ups=0`` and ``shared_prefix=0``: one user message, one answer.
    Training only: ``follow_ups`` more questions about the same context in later turns (every
    answer is supervised, so a sequence teaches retrieval several times instead of once: a single
    7-token answer per 1k-token sequence left the model at chance after 1000 needle steps), and
    in a ``shared_prefix`` fraction of conversations distractor lines whose codes start like the
    asked ones (``_share_prefixes``)."""
    pairs = _context_pairs(rng, context_tokens, count_tokens)
    target, _ = rng.choice(pairs)
    others = [n for n, _ in rng.sample(pairs, min(len(pairs), follow_ups))]
    if shared_prefix > 0.0 and rng.random() < shared_prefix:  # no draw at 0: the probes' stream is kept
        pairs = _share_prefixes(rng, pairs, [target, *others])
    code_of = dict(pairs)
    context = "\n".join(_line(n, c) for n, c in pairs)
    msgs = [{"role": "user", "content": f"{context}\n\nWhat is the code for {target}?"},
            {"role": "assistant", "content": code_of[target]}]
    for other in others:
        msgs += [{"role": "user", "content": f"What is the code for {other}?"},
                 {"role": "assistant", "content": code_of[other]}]
    return msgs


def _share_prefixes(rng: random.Random, pairs: list[tuple[str, str]], asked: list[str],
                    most: int = 3) -> list[tuple[str, str]]:
    """``pairs`` with, for each asked name, 1 to ``most`` other (not asked) lines whose codes now
    share the asked code's first 1-5 digits (then differ). Why: a third of the default model's
    needle misses copied the right first digit(s) and then went on from another line whose code
    starts the same way (``871439`` -> ``871578``): digit-by-digit copying must keep to the asked
    line, which uniformly drawn codes rarely test."""
    code_of = dict(pairs)
    free = [n for n, _ in pairs if n not in set(asked)]
    for name_ in dict.fromkeys(asked):
        for other in rng.sample(free, min(len(free), rng.randint(1, most))):
            free.remove(other)  # one asked code per distractor (a later one would overwrite it)
            code, k = code_of[name_], rng.randint(1, 5)
            rest = "".join(rng.choice("0123456789") for _ in range(6 - k))
            if rest[0] == code[k]:  # differ right after the shared prefix
                rest = str((int(rest[0]) + 1) % 10) + rest[1:]
            code_of[other] = code[:k] + rest
    return [(n, code_of[n]) for n, _ in pairs]


def needle_echo(rng: random.Random, context_tokens: int, count_tokens: Callable[[str], int] | None = None,
                n_echo: int = 8) -> list[tuple[str, bool]]:
    """Training only: a needle context as plain text (no chat template), a blank line, then 1 to
    ``n_echo`` of its lines restated in random order. Returned as (text, supervised) segments: the
    restated lines' codes are the supervised ones.

    Why: the needle's first answer digit needs a match of the asked NAME against "the NAME three
    tokens back" at every code's first digit. In the chat form the asked NAME sits six tokens
    before the answer (behind ``? <|im_end|> \n <|im_start|> assistant \n``), so the match needs
    features at both ends that nothing else in the data rewards, and models plateaued at chance
    selection. Restating ``The code for NAME is `` puts the asked NAME two tokens
    before the first digit: the short causal conv of any GDN layer already mixes it into both the
    query and the key positions, so one attention layer can learn the match directly; the chat
    form then only has to carry the NAME to the answer position."""
    pairs = _context_pairs(rng, context_tokens, count_tokens)
    segs: list[tuple[str, bool]] = [("".join(_line(n, c) + "\n" for n, c in pairs) + "\n", False)]
    for n, code in rng.sample(pairs, rng.randint(1, min(len(pairs), n_echo))):
        segs += [(f"The code for {n} is ", False), (code, True), (".\n", False)]
    return segs


def encode_segments(tok, segments: list[tuple[str, bool]]) -> tuple[np.ndarray, np.ndarray]:
    """Token ids and loss mask of plain-text ``segments`` (each encoded alone: callers split only
    where the byte-level pre-tokeniser splits too, e.g. before the digits after ``is ``)."""
    ids: list[int] = []
    mask: list[int] = []
    for text, supervised in segments:
        t = tok.encode(text)
        ids += t
        mask += [int(supervised)] * len(t)
    return np.asarray(ids, np.int32), np.asarray(mask, np.int32)


def recall(rng: random.Random, min_between: int = 1, max_between: int = 4) -> list[dict]:
    attr = rng.choice(sorted(ATTRIBUTES))
    value = f"{rng.randint(0, 999999):06d}" if attr == "password" else rng.choice(ATTRIBUTES[attr])
    msgs = [{"role": "user", "content": f"Remember: my {attr} is {value}."}, {"role": "assistant", "content": "OK."}]
    for _ in range(rng.randint(min_between, max_between)):
        if rng.random() < 0.5:
            msgs += arithmetic(rng)
        else:
            u, a = rng.choice(SMALL_TALK)
            msgs += [{"role": "user", "content": u}, {"role": "assistant", "content": a}]
    return msgs + [{"role": "user", "content": f"What is my {attr}?"}, {"role": "assistant", "content": value}]


def example(kind: str, rng: random.Random, needle_tokens: tuple[int, int] = (1000, 4000),
            count_tokens: Callable[[str], int] | None = None, needle_follow_ups: int = 0,
            mixed_digits: float = 0.0, needle_shared: float = 0.0) -> list[dict]:
    """One conversation of ``kind``. Training options (probes use none): ``needle_follow_ups``
    adds up to that many more questions about the same needle context, ``needle_shared`` the
    fraction of needle contexts with distractor codes sharing the asked codes' leading digits
    (``needle``); ``mixed_digits`` draws that fraction of arithmetic operands by digit count
    (``arithmetic``)."""
    if kind == "arithmetic":
        return arithmetic(rng, mixed_digits)
    if kind == "needle":
        context = rng.randint(*needle_tokens)
        # no draw for probes (follow-ups 0): the held-out stream does not depend on the training option
        follow = rng.randint(0, needle_follow_ups) if needle_follow_ups else 0
        return needle(rng, context, count_tokens, follow, needle_shared)
    if kind == "recall":
        return recall(rng)
    raise ValueError(f"unknown task kind {kind!r}; have {KINDS}")


def answer_of(messages: list[dict]) -> str:
    """Recompute the right answer of a conversation's last question from its text alone."""
    q = messages[-2]["content"]
    if q.startswith("What is my "):
        attr = q[len("What is my "):-1]
        for m in messages:
            if m["role"] == "user" and m["content"].startswith(f"Remember: my {attr} is "):
                return m["content"][len(f"Remember: my {attr} is "):-1]
        raise ValueError("no Remember turn for " + attr)
    last = q.rsplit("\n", 1)[-1]
    if last.startswith("What is the code for "):
        target = last[len("What is the code for "):-1]
        for line in q.split("\n"):
            if line.startswith(f"The code for {target} is "):
                return line[len(f"The code for {target} is "):-1]
        raise ValueError("needle not in context: " + target)
    a, op, b = q[len("What is "):-1].split(" ")
    return str(int(a) + int(b) if op == "+" else int(a) - int(b))


def score(expected: str, got: str) -> bool:
    """Exact match after stripping surrounding whitespace (the answer is bare)."""
    return got.strip() == expected


# ---------------------------------------------------------------------------------------------
# Encoding with the chat template.
# ---------------------------------------------------------------------------------------------


def encode(tok, messages: list[dict]) -> tuple[np.ndarray, np.ndarray]:
    """Token ids [N] and loss mask [N] (1 on assistant content + its ``<|im_end|>``).

    Each assistant turn is split at the template's ``<|im_start|>assistant\\n`` prompt: the text up
    to it (rendered with ``add_generation_prompt``), the content, then ``<|im_end|>`` + ``\\n``.
    The byte-level pre-tokeniser never merges across those boundaries (a special token, or the
    lone newline after ``assistant``), so the concatenated pieces equal the encoding of the whole
    rendering (tests check this)."""
    end = tok.token_to_id("<|im_end|>")
    ids: list[int] = []
    mask: list[int] = []
    done_text = ""
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        prompt = tok.apply_chat_template(messages[:i], add_generation_prompt=True)
        head = tok.encode(prompt[len(done_text):])
        body = tok.encode(m["content"])
        ids += head + body + [end]
        mask += [0] * len(head) + [1] * (len(body) + 1)
        done_text = prompt + m["content"] + "<|im_end|>"
        rest = tok.apply_chat_template(messages[: i + 1], add_generation_prompt=False)
        assert rest.startswith(done_text), "chat template does not close an assistant turn with <|im_end|>"
        tail = rest[len(done_text):]
        if tail:
            t = tok.encode(tail)
            ids += t
            mask += [0] * len(t)
            done_text = rest
    return np.asarray(ids, np.int32), np.asarray(mask, np.int32)


@dataclasses.dataclass(frozen=True)
class Probe:
    kind: str
    messages: list  # the conversation without its final assistant answer
    answer: str


def probes(n_per_kind: int, seed: int = PROBE_SEED, needle_tokens: tuple[int, int] = (1000, 4000),
           count_tokens: Callable[[str], int] | None = None, kinds=KINDS) -> list[Probe]:
    """Held-out probes: ``n_per_kind`` of each kind from their own seeded stream."""
    out = []
    for k_i, kind in enumerate(kinds):
        rng = random.Random(seed * 1009 + k_i)
        for _ in range(n_per_kind):
            msgs = example(kind, rng, needle_tokens, count_tokens)
            out.append(Probe(kind, msgs[:-1], msgs[-1]["content"]))
    return out


def corpus(seed: int = TRAIN_SEED, n: int = 3000) -> list[str]:
    """Raw text of the tasks (messages' contents), for training the tokenizer."""
    rng = random.Random(seed)
    texts = []
    for i in range(n):
        kind = KINDS[i % 3]
        msgs = example(kind, rng, needle_tokens=(40, 120))
        texts += [m["content"] for m in msgs]
    return texts
