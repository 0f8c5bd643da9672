"""Workload traces: one request (or one turn of a session) per record, read from and written to JSONL.

The shape is that of public serving traces, so they load as they are:

    {"t": 1.25, "input_len": 812, "output_len": 96}                      arrival (s), lengths (tokens)
    ... "group": "sys-3", "group_len": 1000                              a shared prefix (system prompt, document)
    ... "hash_ids": [46, 47, 48], "block_size": 512                      Mooncake: the prompt's blocks by content id
    ... "session": "s-17", "turn": 2, "think_s": 3.0, "edit": 40         a multi-turn (agent) session
    ... "priority": 0, "tenant": "key-a"                                 scheduling classes and fair-share keys

``input_len`` of a first turn (or a request without a session) is its whole prompt, whose first
``group_len`` tokens are its group's, or whose first blocks are its ``hash_ids`` blocks. A later
turn arrives ``think_s`` after the previous turn finished; its prompt is the previous prompt plus
the answer, minus the last ``edit`` tokens (a tool output that gets rewritten), plus ``input_len``
new tokens, so the conversation grows and a hit covers all but the edited tail. Its ``t`` is unused.

Mooncake's JSONL (``timestamp`` in ms, ``input_length``, ``output_length``, ``hash_ids``; 512-token
blocks) and BurstGPT's CSV (``Timestamp``, ``Request tokens``, ``Response tokens``) load too.
"""

from __future__ import annotations

import csv
import dataclasses
import json
from pathlib import Path
from typing import Any, Iterable

MOONCAKE_BLOCK = 512
TRACES_DIR = Path(__file__).resolve().parent / "traces"


class TraceError(ValueError):
    """A trace that cannot be read: names the file, the line and what is wrong."""


@dataclasses.dataclass(frozen=True)
class TraceRecord:
    t: float
    input_len: int
    output_len: int
    group: str | None = None
    group_len: int = 0
    hash_ids: tuple[int, ...] = ()
    block_size: int = MOONCAKE_BLOCK
    session: str | None = None
    turn: int = 0
    think_s: float = 0.0
    edit: int = 0
    priority: int = 0
    tenant: str = ""

    def __post_init__(self):
        if not self.t >= 0:
            raise ValueError(f"t must be >= 0, got {self.t}")
        if self.input_len < (0 if self.turn else 1) or self.output_len < 1:
            raise ValueError(f"input_len ({self.input_len}) and output_len ({self.output_len}) must be >= 1 "
                             f"(a later turn may add 0 tokens)")
        if not 0 <= self.group_len <= self.input_len or (self.group_len and self.group is None):
            raise ValueError(f"group_len ({self.group_len}) needs a group and must be within input_len")
        if self.block_size < 1 or self.edit < 0 or self.think_s < 0 or self.turn < 0:
            raise ValueError("block_size must be >= 1; edit, think_s and turn >= 0")
        if self.turn and self.session is None:
            raise ValueError(f"turn {self.turn} without a session")

    def to_json(self) -> dict[str, Any]:
        """Only the fields that differ from their defaults."""
        out = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.name in ("t", "input_len", "output_len") or v != f.default:
                out[f.name] = list(v) if isinstance(v, tuple) else v
        return out


_FIELDS = {f.name for f in dataclasses.fields(TraceRecord)}


def _record(obj: Any) -> TraceRecord:
    if not isinstance(obj, dict):
        raise ValueError("expected a JSON object")
    if "timestamp" in obj and "input_length" in obj:  # Mooncake
        return TraceRecord(t=float(obj["timestamp"]) / 1000, input_len=int(obj["input_length"]),
                           output_len=max(1, int(obj["output_length"])),
                           hash_ids=tuple(int(h) for h in obj.get("hash_ids", ())))
    unknown = set(obj) - _FIELDS
    if unknown:
        raise ValueError(f"unknown fields {sorted(unknown)}")
    missing = {"t", "input_len", "output_len"} - set(obj)
    if missing:
        raise ValueError(f"missing fields {sorted(missing)}")
    kw = dict(obj)
    if "hash_ids" in kw:
        kw["hash_ids"] = tuple(int(h) for h in kw["hash_ids"])
    return TraceRecord(**kw)


def load_trace(path: str | Path) -> list[TraceRecord]:
    """Read a trace (JSONL, Mooncake JSONL or BurstGPT CSV), in arrival order. A bare name such as
    ``agent-sessions`` is one of the shipped traces (``jaxserve/sim/traces``)."""
    p = Path(path)
    if not p.exists() and (TRACES_DIR / f"{path}.jsonl").exists():
        p = TRACES_DIR / f"{path}.jsonl"
    try:
        text = p.read_text()
    except OSError as e:
        shipped = ", ".join(sorted(x.stem for x in TRACES_DIR.glob("*.jsonl")))
        raise TraceError(f"cannot read trace {path}: {e.strerror} (shipped traces: {shipped})") from None
    records = _load_csv(p, text) if p.suffix == ".csv" else _load_jsonl(p, text)
    if not records:
        raise TraceError(f"{p}: no requests")
    _check_sessions(p, records)
    return sorted(records, key=lambda r: r.t)


def _load_jsonl(p: Path, text: str) -> list[TraceRecord]:
    records = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            records.append(_record(json.loads(line)))
        except (json.JSONDecodeError, ValueError, TypeError) as e:
            raise TraceError(f"{p}:{n}: {e}") from None
    return records


def _load_csv(p: Path, text: str) -> list[TraceRecord]:
    """BurstGPT: Timestamp (s), Request tokens, Response tokens; rows with an empty prompt are skipped."""
    rows = csv.DictReader(text.splitlines())
    need = {"Timestamp", "Request tokens", "Response tokens"}
    if not need <= set(rows.fieldnames or ()):
        raise TraceError(f"{p}: a CSV trace needs the BurstGPT columns {sorted(need)}")
    records = []
    for n, row in enumerate(rows, 2):
        try:
            if int(row["Request tokens"]) > 0:
                records.append(TraceRecord(t=float(row["Timestamp"]), input_len=int(row["Request tokens"]),
                                           output_len=max(1, int(row["Response tokens"])),
                                           tenant=row.get("Model", "") or ""))
        except (ValueError, TypeError) as e:
            raise TraceError(f"{p}:{n}: {e}") from None
    t0 = min((r.t for r in records), default=0.0)
    return [dataclasses.replace(r, t=r.t - t0) for r in records]


def _check_sessions(p: Path, records: list[TraceRecord]) -> None:
    turns: dict[str, list[int]] = {}
    for r in records:
        if r.session is not None:
            turns.setdefault(r.session, []).append(r.turn)
    for s, ts in turns.items():
        if sorted(ts) != list(range(len(ts))):
            raise TraceError(f"{p}: session {s!r} has turns {sorted(ts)}, expected 0..{len(ts) - 1}")


def write_trace(records: Iterable[TraceRecord], path: str | Path) -> None:
    Path(path).write_text("".join(json.dumps(r.to_json()) + "\n" for r in records))
