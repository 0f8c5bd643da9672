"""A small model of the device for scheduler and cache tests: same protocol as the real executor,
no arrays, so storms of thousands of steps run in seconds.

KV pages hold token ids; a linear-state slot holds a rolling hash of every token its sequence has
consumed (the stand-in for GDN conv + recurrent state). The next token is a hash of the slot state
and of the context read back through the page table. So a request computes exactly
``reference_continuation`` iff every page it reads holds the right tokens and its slot holds the
right state: a stale or wrong snapshot restore, a page shared by mistake, a missed restore or an
off-by-one boundary all change the tokens — like corrupted state changes a real model's output.
"""

from __future__ import annotations

MASK = (1 << 61) - 1


def _mix(state: int, token: int) -> int:
    return hash((state, token)) & MASK


def _next_token(state: int, context: tuple[int, ...], vocab: int) -> int:
    return hash((state, context)) % vocab


def reference_continuation(prompt: list[int], n: int, vocab: int, hybrid: bool = True) -> list[int]:
    """What a cold, unbatched run produces: greedy tokens from the pure definition."""
    seq, state, out = list(prompt), 0, []
    for tok in prompt:
        state = _mix(state, tok) if hybrid else 0
    for _ in range(n):
        tok = _next_token(state, tuple(seq), vocab)
        out.append(tok)
        seq.append(tok)
        state = _mix(state, tok) if hybrid else 0
    return out


class StepFailure(RuntimeError):
    """What an injected device failure raises (``FakeExecutor.fail_steps``)."""


class FakeExecutor:
    """The ``Executor`` protocol. ``dispatch`` computes the step at once (the fake device is
    synchronous) and ``fetch`` returns it, so overlapped scheduling is exercised exactly: a row with
    ``feed >= 0`` must take its last token from the previous dispatch's row ``feed``, as the real
    device does, and a wrong feed index changes the tokens.

    Fault injection: ``fail_steps`` (1-based dispatch numbers) fail at ``fetch``, like a device
    error surfacing at read-back; with ``lose_state_on_failure`` the failure also wipes the pools
    (every page and slot garbage), as an out-of-memory that consumed donated pools would."""

    def __init__(self, num_pages: int, num_slots: int, page_size: int, vocab: int, hybrid: bool = True):
        self.page_size, self.vocab, self.hybrid = page_size, vocab, hybrid
        self.kv: dict[tuple[int, int], int] = {}
        self.slots = [0] * num_slots
        self.steps = 0
        self.corrupt_restores = False  # fault injection: restore a wrong state
        self.fail_steps: set[int] = set()
        self.lose_state_on_failure = False
        self._last: list[int] | None = []  # the previous dispatch's sampled tokens (the device-side feed)
        self._lost = False

    def execute(self, plan):
        return self.fetch(self.dispatch(plan))

    def dispatch(self, plan):
        self.steps += 1
        if self.steps in self.fail_steps:
            if self.lose_state_on_failure:
                self.kv = {key: -1 for key in self.kv}
                self.slots = [-1] * len(self.slots)
                self._lost = True
            self._last = None  # what the failed step "sampled": nothing a later row may use
            return StepFailure(f"injected failure of step {self.steps}")
        tokens = self._run(plan)
        self._last = tokens
        return tokens, [0.0] * len(tokens)

    def fetch(self, handle):
        if isinstance(handle, StepFailure):
            raise handle
        return handle

    def recover(self) -> bool:
        lost, self._lost = self._lost, False
        return lost

    def _run(self, plan) -> list[int]:
        tokens = []
        ps = self.page_size
        for row in plan.rows:
            req = row.req
            fed = list(row.tokens)
            if row.feed >= 0:  # after a failed step: poison, which only rows that get dropped may carry
                fed[-1] = -1 if self._last is None else self._last[row.feed]
            if self.hybrid and row.restore_src:
                self.slots[req.slot] = self.slots[row.restore_src] ^ (1 if self.corrupt_restores else 0)
            state = self.slots[req.slot] if self.hybrid else 0
            if self.hybrid and row.start == 0 and not row.restore_src:
                state = 0  # a fresh sequence starts from the zero state, whatever the slot held
            snaps = dict(row.snapshots)
            for i, tok in enumerate(fed):
                pos = row.start + i
                self.kv[(req.pages[pos // ps], pos % ps)] = tok
                if self.hybrid:
                    state = _mix(state, tok)
                if i + 1 in snaps:
                    self.slots[snaps[i + 1]] = state
            if self.hybrid:
                self.slots[req.slot] = state
            end = row.start + len(row.tokens)
            context = tuple(self.kv.get((req.pages[p // ps], p % ps), -1) for p in range(end))  # -1: never written
            tokens.append(_next_token(state, context, self.vocab))
        return tokens

    def barrier(self) -> None:
        pass

    def slot_checksum(self, slot: int) -> int:
        return self.slots[slot]
