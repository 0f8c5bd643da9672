"""Refit the simulator's cost model offline from a calibration's measured steps and compare it with
a validation's real run, without the device: the GPU run writes its steps (``jaxserve sim calibrate
--samples``) and its requests (``jaxserve sim validate``'s ``requests.real``), and this script fits
the model on a subset of the features, simulates the same trace and compares request by request.

    python benchmarks/sim_refit.py --samples sim-samples.json --validation sim-validation.json \
        --trace sim-trace.jsonl [--features const,tokens,new_tokens,...] [--out cost.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def upgrade(steps: list, features: list[str], engine: dict) -> list:
    """Rows of ``features`` (then seconds, ...) in this simulator's ``FEATURES``: samples of version
    3 lack ``width``, which for their engines (no one-row programs) is a mixed step's full width
    min(padded tokens, max seqs), 0 in a decode step."""
    from jaxserve.sim.cost import FEATURES

    if features != [f for f in FEATURES if f != "width"]:
        return steps  # current (or unknown: refit says so)
    i, t, m, top = FEATURES.index("width"), features.index("tokens"), features.index("mixed"), engine["seq_buckets"][-1]
    return [[*row[:i], min(row[t], top) if row[m] > 0 else 0.0, *row[i:]] for row in steps]


def refit(samples: dict, features: list[str]):
    """The cost model fitted on ``features`` only (the others' coefficients 0)."""
    from jaxserve.sim.cost import FEATURES, CostModel, fit

    samples = {**samples, "steps": upgrade(samples["steps"], samples["features"], samples["engine"]),
               "features": list(FEATURES) if "width" not in samples["features"] else samples["features"]}
    if samples["features"] != list(FEATURES):
        raise SystemExit(f"samples of features {samples['features']}, this simulator's are {list(FEATURES)}")
    unknown = set(features) - set(FEATURES)
    if unknown:
        raise SystemExit(f"unknown features {sorted(unknown)}; choose from {list(FEATURES)}")
    steps = np.asarray(samples["steps"], float)
    X, y = steps[:, :-1], steps[:, -1]
    keep = np.asarray([f in features for f in FEATURES])
    m = fit(np.where(keep, X, 0.0), y, engine=samples["engine"], device=samples["device"])
    return CostModel(tuple(c if k else 0.0 for c, k in zip(m.coef, keep)), m.engine, m.device, m.fit_stats)


def step_errors(cost, real_steps) -> dict | None:
    """The real trace run's steps (``validate``'s ``real_steps``) against ``cost``'s prediction, by
    kind: how many, measured and predicted seconds in all, and the median relative error."""
    from jaxserve.sim.cost import FEATURES

    if not real_steps:
        return None
    steps = np.asarray(real_steps, float)
    X, y = steps[:, :len(FEATURES)], steps[:, len(FEATURES)]
    pred = X @ np.asarray(cost.coef)
    mixed = X[:, FEATURES.index("mixed")] > 0
    out = {}
    for kind, sel in (("decode", ~mixed), ("mixed", mixed)):
        if sel.any():
            out[kind] = {"steps": int(sel.sum()), "measured_s": float(y[sel].sum()), "predicted_s": float(pred[sel].sum()),
                         "median_rel_err": float(np.median((pred[sel] - y[sel]) / y[sel]))}
    return out


def main() -> None:
    from jaxserve.sim.calibrate import compare
    from jaxserve.sim.cost import FEATURES
    from jaxserve.sim.replay import RequestRecord
    from jaxserve.sim.simulator import SimConfig, simulate
    from jaxserve.sim.trace import load_trace

    ap = argparse.ArgumentParser()
    ap.add_argument("--samples", type=Path, required=True)
    ap.add_argument("--validation", type=Path, required=True)
    ap.add_argument("--trace", required=True)
    ap.add_argument("--features", default=",".join(FEATURES))
    ap.add_argument("--out", type=Path, default=None, help="write the refitted cost model here")
    args = ap.parse_args()
    samples, val = json.loads(args.samples.read_text()), json.loads(args.validation.read_text())
    cost = refit(samples, args.features.split(","))
    real = [RequestRecord(**r) for r in val["requests"]["real"]]
    result = simulate(load_trace(args.trace), val["policy"], cost, SimConfig.from_engine(samples["engine"]))
    cmp = compare(real, result.requests)
    real_duration = max(r.finish for r in real if r.finish is not None) - min(r.arrival for r in real)
    cmp["duration"] = {"real_s": real_duration, "sim_s": result.duration_s,
                       "rel_err": (result.duration_s - real_duration) / real_duration}
    steps = step_errors(cost, upgrade(val["requests"].get("real_steps") or [], samples["features"], samples["engine"]))
    print(json.dumps({"coef_s": dict(zip(FEATURES, cost.coef)), "fit": cost.fit_stats, "comparison": cmp,
                      "real_steps": steps}, indent=1))
    if args.out:
        cost.save(args.out)


if __name__ == "__main__":
    main()
