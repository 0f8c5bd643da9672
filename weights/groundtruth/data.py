"""Training batches: length buckets, the bucket of each step, and a prefetching batch stream.

No packing: each step takes one length bucket (kind, T, B) with about the same number of tokens
(B*T ~ ``batch_tokens``), rows right-padded with ``<|endoftext|>``. The batch of a step is a pure
function of (settings, seed, step): a resumed run sees the batches it would have seen, and worker
processes build the very batches the background thread would. Curriculum: during the first
``curriculum`` fraction of steps only phase-0 buckets (short needles) are used; then the long
needle buckets join. Needle conversations carry up to ``NEEDLE_FOLLOW_UPS`` extra questions about
the same context.
"""

from __future__ import annotations

import queue
import random
import threading

import numpy as np

from weights.groundtruth import tasks

def buckets(smoke: bool, batch_tokens: int) -> list[dict]:
    """(kind, T, B, needle context range, phase) per bucket; phase 1 buckets join after the
    curriculum. T is a multiple of 64 (the GDN chunk)."""
    if smoke:
        spec = [("arithmetic", 64, None, 0), ("recall", 256, None, 0), ("needle", 128, (30, 90), 0),
                ("echo", 128, (30, 90), 0)]
    else:
        spec = [("arithmetic", 64, None, 0), ("recall", 320, None, 0), ("needle", 1024, (100, 800), 0),
                ("needle", 2048, (900, 1800), 1), ("needle", 4224, (1950, 3900), 1), ("needle", 320, (20, 120), 0),
                ("echo", 320, (20, 120), 0), ("echo", 1024, (100, 800), 0),
                ("needle", 5248, (2900, 4900), 1)]
    return [dict(kind=k, T=T, B=max(1, batch_tokens // T), needle=nr, phase=ph) for k, T, nr, ph in spec]


# Bucket order within a cycle (indices into buckets()); arithmetic gets the most steps.
# Short needles (5) come often: retrieval is learnt there first, then carried to long contexts.
# The training-only echo buckets (6, 7; smoke 3) are in the cycle only when ``kinds`` names "echo".
# Bucket 8 (contexts of 2.9k-4.9k tokens, past the probes' 4k) is in no default cycle: ``--cycle``
# adds it, so that the probes' longest needles are not the longest the model has seen.
CYCLE = {False: [0, 5, 1, 0, 2, 5, 0, 3, 1, 0, 5, 4, 0, 2, 6, 7, 6], True: [0, 1, 0, 2, 3]}

# Extra questions per needle context in training (the probes ask one); each answer is supervised.
NEEDLE_FOLLOW_UPS = 8


def check_cycle(cycle: tuple[int, ...], bks: list[dict], kinds: tuple[str, ...] | None) -> None:
    """ValueError unless every index of ``cycle`` names a bucket and one of them is of ``kinds``."""
    bad = [i for i in cycle if not 0 <= i < len(bks)]
    if bad:
        raise ValueError(f"--cycle: no bucket {bad}; buckets are 0..{len(bks) - 1}: "
                         + ", ".join(f"{i}={b['kind']}[T={b['T']}]" for i, b in enumerate(bks)))
    if not any(bks[i]["kind"] in (kinds or tasks.KINDS) for i in cycle):
        raise ValueError(f"--cycle {list(cycle)}: none of its buckets is of kinds {list(kinds or tasks.KINDS)}")


def bucket_for_step(step: int, steps: int, bks: list[dict], smoke: bool, curriculum: float,
                    kinds: tuple[str, ...] | None = None, cycle: tuple[int, ...] | None = None) -> dict:
    """The bucket of ``step``: ``cycle`` (default ``CYCLE``; indices into ``bks``, a bucket as
    often as it appears) filtered to ``kinds``, and to phase 0 before the curriculum ends."""
    kinds = kinds or tasks.KINDS
    cycle = [i for i in (cycle or CYCLE[smoke]) if bks[i]["kind"] in kinds]
    if step < curriculum * steps:
        cycle = [i for i in cycle if bks[i]["phase"] == 0] or cycle
    return bks[cycle[step % len(cycle)]]


def make_batch(tok, bucket: dict, seed: int, step: int, arith_mixed: float = 1.0,
               needle_shared: float = 0.0) -> tuple[np.ndarray, np.ndarray]:
    """[B, T] tokens (padded with <|endoftext|>) and loss mask; a function of (seed, step).
    ``arith_mixed``: the fraction of arithmetic problems with operands drawn by digit count, the
    rest as the probes draw them (``tasks.arithmetic``); ``needle_shared`` the fraction of needle
    contexts with distractor codes sharing the asked codes' leading digits (``tasks.needle``)."""
    rng = random.Random(seed * 1_000_003 + step)
    pad = tok.token_to_id("<|endoftext|>")
    B, T = bucket["B"], bucket["T"]
    count = lambda s: len(tok.encode(s))  # noqa: E731
    toks = np.full((B, T), pad, np.int32)
    mask = np.zeros((B, T), np.int32)
    for b in range(B):
        while True:
            if bucket["kind"] == "echo":
                ids, m = tasks.encode_segments(tok, tasks.needle_echo(rng, rng.randint(*bucket["needle"]), count))
            else:
                msgs = tasks.example(bucket["kind"], rng, bucket["needle"] or (0, 0), count, NEEDLE_FOLLOW_UPS,
                                     mixed_digits=arith_mixed, needle_shared=needle_shared)
                ids, m = tasks.encode(tok, msgs)
            if len(ids) <= T:
                break
        toks[b, : len(ids)] = ids
        mask[b, : len(ids)] = m
    return toks, mask


class Prefetcher:
    """Builds batches ahead of the device (``depth`` in flight) so it does not wait on Python data
    generation: on a background thread, or with ``workers`` > 0 in that many spawned processes
    (a batch of 64k tokens takes ~0.1-0.2 s of Python, as long as a device step). ``fn`` must be
    picklable for workers; batches come back in step order either way."""

    def __init__(self, fn, steps: range, depth: int = 8, workers: int = 0):
        self._q: queue.Queue = queue.Queue(depth)
        if workers > 0:
            import concurrent.futures as cf
            import multiprocessing as mp

            pool = cf.ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn"))

            def feed():
                pending: list = []
                for s in steps:
                    pending.append((s, pool.submit(fn, s)))
                    if len(pending) >= depth:
                        s0, f = pending.pop(0)
                        self._q.put((s0, f.result()))
                for s0, f in pending:
                    self._q.put((s0, f.result()))
                pool.shutdown()

            target = feed
        else:
            target = lambda: [self._q.put((s, fn(s))) for s in steps]  # noqa: E731
        self._t = threading.Thread(target=target, daemon=True)
        self._t.start()

    def get(self):
        return self._q.get()


_WORKER_TOKENIZERS: dict = {}


def batch_for_step(step: int, *, tokenizer_dir: str, steps: int, bks: list[dict], smoke: bool, curriculum: float,
                   kinds: tuple[str, ...] | None, seed: int, cycle: tuple[int, ...] | None = None,
                   arith_mixed: float = 1.0, needle_shared: float = 0.0):
    """(bucket, (tokens, mask)) of ``step``: a pure function of its arguments (picklable with
    ``functools.partial`` for Prefetcher's worker processes, which load the tokenizer once)."""
    from jaxserve.tokenizer import Tokenizer

    tok = _WORKER_TOKENIZERS.get(tokenizer_dir)
    if tok is None:
        tok = _WORKER_TOKENIZERS[tokenizer_dir] = Tokenizer.from_dir(tokenizer_dir)
    bucket = bucket_for_step(step, steps, bks, smoke, curriculum, kinds, cycle)
    return bucket, make_batch(tok, bucket, seed, step, arith_mixed, needle_shared)
