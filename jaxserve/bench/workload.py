"""The workloads: which requests a run sends (``make_workload``) and when sessions start
(``arrival_times``). Pure and deterministic in the seed: no server needed."""

from __future__ import annotations

import dataclasses
import math
import random

WORKLOADS = ("random", "shared-prefix", "multi-turn")
# Plain words for text prompts; their token count per word is measured on the server (calibration).
WORDS = ("the of and to in is you that it he was for on are as with his they at be this have from or one had by "
         "word but not what all were we when your can said there use an each which she do how their if will up "
         "other about out many then them these so some her would make like him into time has look two more write "
         "go see number no way could people my than first water been call who its now find long down day did get "
         "come made may part").split()


class BenchError(ValueError):
    """A usage or connection error: reported as one line, exit code 2."""


@dataclasses.dataclass(frozen=True)
class Item:
    """One request of a workload. ``user`` is the whole prompt (turn 0), or the new user part a
    later turn appends to its conversation; ``input_len`` is the tokens ``user`` was made for
    (exact for ids, about right for text)."""
    index: int
    session: int
    turn: int
    user: tuple[int, ...] | str
    input_len: int
    output_len: int
    group: int | None = None


def draw_len(rng: random.Random, mean: int, ratio: float) -> int:
    """Uniform in [mean * (1 - ratio), mean * (1 + ratio)], rounded, at least 1."""
    lo, hi = max(1, round(mean * (1 - ratio))), max(1, round(mean * (1 + ratio)))
    return rng.randint(lo, hi)


def random_text(rng: random.Random, n_tokens: int, tokens_per_word: float) -> str:
    """Random words, as many as make about ``n_tokens`` tokens (at least one word)."""
    return " ".join(rng.choices(WORDS, k=max(1, round(n_tokens / tokens_per_word))))


def make_workload(kind: str, *, num_prompts: int, input_len: int, output_len: int, range_ratio: float = 0.0,
                  seed: int = 0, prompt_format: str = "ids", token_ids: tuple[int, int] = (10, 1000),
                  tokens_per_word: float = 1.0, prefix_len: int = 0, num_groups: int = 1,
                  turns: int = 1) -> list[list[Item]]:
    """The sessions of a workload, each a list of turns sent one after the other; ``num_prompts``
    items in all, numbered 0.. in session order. Random and shared-prefix sessions have one turn."""
    rng = random.Random(seed)

    def content(n: int):
        if prompt_format == "text":
            return random_text(rng, n, tokens_per_word)
        return tuple(rng.randrange(*token_ids) for _ in range(n))

    lens = lambda: (draw_len(rng, input_len, range_ratio), draw_len(rng, output_len, range_ratio))  # noqa: E731
    if kind == "random":
        return [[Item(i, i, 0, content(n), n, m)] for i, (n, m) in enumerate(lens() for _ in range(num_prompts))]
    if kind == "shared-prefix":
        prefixes = [content(prefix_len) for _ in range(num_groups)]
        groups = [i % num_groups for i in range(num_prompts)]
        rng.shuffle(groups)
        sessions = []
        for i, g in enumerate(groups):
            n, m = lens()
            tail = content(n)
            user = prefixes[g] + " " + tail if prompt_format == "text" else prefixes[g] + tail
            sessions.append([Item(i, i, 0, user, prefix_len + n, m, g)])
        return sessions
    if kind == "multi-turn":
        sessions, index = [], 0
        for s in range(-(-num_prompts // turns)):
            session = []
            for t in range(min(turns, num_prompts - s * turns)):
                n, m = lens()
                session.append(Item(index, s, t, content(n), n, m))
                index += 1
            sessions.append(session)
        return sessions
    raise BenchError(f"unknown workload {kind!r} (one of {', '.join(WORKLOADS)})")


def arrival_times(n: int, rate: float, seed: int) -> list[float]:
    """Start offsets (s) of ``n`` sessions: 0 for all at ``rate`` inf, else a Poisson process
    (exponential gaps of mean 1/rate) whose first arrival is at 0."""
    if math.isinf(rate):
        return [0.0] * n
    rng, t, out = random.Random(f"arrivals-{seed}"), 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out
