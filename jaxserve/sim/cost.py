"""The step cost model: how long one engine step takes, as a function of what the step computes.

Features of a planned step (``step_features``), all host-visible:

  const        1
  tokens       tokens fed, padded the way the runner pads them (its ``Buckets``: a mixed step to
               its token bucket, a decode step to its batch bucket), so compiled shapes cost what
               they cost
  new_tokens   the tokens a mixed step really feeds (0 in a decode step): the work that follows
               the prompt, not the compiled shape (a GPU's routed experts and attention skip the
               padding; without it a fit charged prefill work to the snapshot count, which grows
               with the tokens too, and the GPU validation missed TTFT by 20 %)
  rows         sequences in the step (per-row work: sampling, state reads and writes)
  width        the rows a mixed step's program computes, padding included: 1 for a step of one row
               where the engine has one-row programs (``runner.Buckets.row_sizes``), else its
               token bucket's full width min(T, max seqs); 0 in a decode step (``tokens`` is its B).
               (each padding row reads and writes a linear state per layer and widens the chunk grid)
  mixed        1 for a step with a prefill chunk: mixed and decode steps run different programs
               (chunked linear attention, snapshot entries)
  chunked      rows of more than one token (prefill chunks: each its share of the linear-attention
               chunk grid and of the scheduler's ``CHUNKED_ROWS``)
  attention    sum over rows of new tokens x context they attend to, in millions (prefill attention)
  context      sum over rows of context length, in thousands (KV read by decodes)
  snapshots    state copies: hit restores plus snapshot writes (the hybrid cache's traffic)

``CostModel.predict`` is a non-negative linear combination, fitted (``fit``, non-negative least
squares, so no feature can make a step cheaper) to steps measured on the real engine by
``jaxserve sim calibrate``. The JSON file also records the engine configuration it was measured
with, which the simulator then uses by default.
"""

from __future__ import annotations

import bisect
import dataclasses
import json
from pathlib import Path
from typing import Any, Sequence

import numpy as np

FEATURES = ("const", "tokens", "new_tokens", "rows", "width", "mixed", "chunked", "attention", "context", "snapshots")
VERSION = 4
COSTS_DIR = Path(__file__).resolve().parent / "costs"


class CostModelError(ValueError):
    pass


def _bucket(n: int, sizes: Sequence[int]) -> int:
    if not sizes:
        return n
    i = bisect.bisect_left(sizes, n)
    return sizes[i] if i < len(sizes) else n


def step_features(rows, token_buckets: Sequence[int] = (), seq_buckets: Sequence[int] = (),
                  one_row_programs: bool = False) -> tuple[float, ...]:
    """The ``FEATURES`` of a step given its rows (``scheduler.Row``: ``tokens``, ``start``,
    ``restore_src``, ``snapshots``), in ``FEATURES`` order; the buckets and ``one_row_programs``
    are the engine's (``runner.Buckets``)."""
    n_tok, chunked, attention, context, snaps = 0, 0, 0, 0, 0
    decode = True
    for row in rows:
        n = len(row.tokens)
        end = row.start + n
        n_tok += n
        chunked += n > 1
        decode = decode and n == 1
        attention += n * end
        context += end
        snaps += len(row.snapshots) + (1 if row.restore_src else 0)
    padded = _bucket(len(rows), seq_buckets) if decode else _bucket(n_tok, token_buckets)
    if decode:
        width = 0
    elif one_row_programs and len(rows) == 1:
        width = 1
    else:
        width = min(padded, seq_buckets[-1]) if seq_buckets else len(rows)
    return (1.0, float(padded), 0.0 if decode else float(n_tok), float(len(rows)), float(width), float(not decode),
            float(chunked), attention / 1e6, context / 1e3, float(snaps))


@dataclasses.dataclass(frozen=True)
class CostModel:
    coef: tuple[float, ...]                     # seconds per unit of each of FEATURES
    engine: dict[str, Any] = dataclasses.field(default_factory=dict)  # the measured engine's configuration
    device: str = ""
    fit_stats: dict[str, float] = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        if len(self.coef) != len(FEATURES) or any(not c >= 0 for c in self.coef):
            raise CostModelError(f"need {len(FEATURES)} non-negative coefficients for {FEATURES}, got {self.coef}")

    @property
    def token_buckets(self) -> tuple[int, ...]:
        return tuple(self.engine.get("token_buckets", ()))

    @property
    def seq_buckets(self) -> tuple[int, ...]:
        return tuple(self.engine.get("seq_buckets", ()))

    def predict(self, features: Sequence[float]) -> float:
        return float(sum(c * x for c, x in zip(self.coef, features)))

    @property
    def one_row_programs(self) -> bool:
        return bool(self.engine.get("one_row_programs", False))

    def step_time(self, rows) -> float:
        return self.predict(step_features(rows, self.token_buckets, self.seq_buckets, self.one_row_programs))

    def to_json(self) -> dict[str, Any]:
        return {"version": VERSION, "device": self.device, "features": list(FEATURES),
                "coef_s": dict(zip(FEATURES, self.coef)), "fit": self.fit_stats, "engine": self.engine}

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=1) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> CostModel:
        """A cost-model JSON; a bare name (``cpu-default``) is one shipped in ``jaxserve/sim/costs``."""
        p = Path(path)
        if not p.exists() and (COSTS_DIR / f"{path}.json").exists():
            p = COSTS_DIR / f"{path}.json"
        try:
            obj = json.loads(p.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise CostModelError(f"cannot read cost model {path}: {e}") from None
        if obj.get("version") != VERSION or obj.get("features") != list(FEATURES):
            raise CostModelError(f"{p}: not a version-{VERSION} cost model with features {FEATURES}")
        try:
            coef = tuple(float(obj["coef_s"][f]) for f in FEATURES)
        except (KeyError, TypeError, ValueError) as e:
            raise CostModelError(f"{p}: bad coefficients ({e})") from None
        return cls(coef, obj.get("engine", {}), obj.get("device", ""), obj.get("fit", {}))


def fit(features: Sequence[Sequence[float]], seconds: Sequence[float], **kw) -> CostModel:
    """Non-negative least squares of step times on their features, in absolute seconds: latencies
    are sums of steps, and an unweighted fit keeps the sum of predicted times equal to the measured
    sum (a 1/time weighting fits single steps in relative terms but under-predicts sums by tens of
    per cent on a noisy host). ``fit_stats``: the per-step relative error and the total's error on
    the steps fitted."""
    from scipy.optimize import nnls

    X, y = np.asarray(features, float), np.asarray(seconds, float)
    if X.ndim != 2 or X.shape[1] != len(FEATURES) or len(y) != len(X) or len(y) < len(FEATURES):
        raise CostModelError(f"need at least {len(FEATURES)} measured steps with {len(FEATURES)} features each")
    coef, _ = nnls(X, y)
    pred = X @ coef
    rel = np.abs(pred - y) / np.maximum(y, 1e-9)
    stats = {"steps": int(len(y)), "median_rel_err": float(np.median(rel)), "p90_rel_err": float(np.quantile(rel, 0.9)),
             "total_time_rel_err": float(abs(pred.sum() - y.sum()) / y.sum())}
    return CostModel(tuple(float(c) for c in coef), fit_stats=stats, **kw)
