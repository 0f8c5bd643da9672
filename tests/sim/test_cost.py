"""The cost model: features of a step as documented, the fit recovers known coefficients, the
JSON file round-trips, and a bad file is a clear error."""

from __future__ import annotations

import random
import types

import pytest

from jaxserve.sim.cost import FEATURES, CostModel, CostModelError, fit, step_features


def row(start, n, restore=0, snaps=0):
    return types.SimpleNamespace(start=start, tokens=[0] * n, restore_src=restore, snapshots=[(64, 9)] * snaps)


def test_features_of_mixed_and_decode_steps():
    mixed = [row(0, 100, snaps=1), row(500, 1), row(64, 30, restore=3)]
    f = dict(zip(FEATURES, step_features(mixed, token_buckets=(32, 64, 128, 256), seq_buckets=(1, 2, 4))))
    assert f == {"const": 1.0, "tokens": 256.0, "new_tokens": 131.0, "rows": 3.0, "width": 4.0, "mixed": 1.0,
                 "chunked": 2.0, "attention": (100 * 100 + 501 + 30 * 94) / 1e6, "context": (100 + 501 + 94) / 1e3,
                 "snapshots": 2.0}
    # a step of one row runs the one-row program where the engine has them: width 1, else the full width
    lone = [row(0, 100)]
    for one_row, width in ((True, 1.0), (False, 4.0)):
        f = dict(zip(FEATURES, step_features(lone, (32, 64, 128, 256), (1, 2, 4), one_row_programs=one_row)))
        assert (f["tokens"], f["rows"], f["width"]) == (128.0, 1.0, width)
    decode = [row(10, 1), row(20, 1), row(30, 1)]
    f = dict(zip(FEATURES, step_features(decode, token_buckets=(32,), seq_buckets=(1, 2, 4))))
    assert (f["tokens"], f["new_tokens"], f["width"], f["mixed"], f["chunked"], f["context"]) == (
        4.0, 0.0, 0.0, 0.0, 0.0, (11 + 21 + 31) / 1e3)


def test_fit_recovers_the_coefficients_it_was_generated_with():
    rng = random.Random(0)
    truth = (2e-3, 3e-6, 7e-6, 5e-5, 3e-4, 1e-3, 6e-4, 4e-3, 2e-4, 1e-4)
    X = []
    for _ in range(300):
        decode = rng.random() < 0.5
        X.append((1.0, rng.randrange(1, 4096), 0 if decode else rng.randrange(1, 4096), rng.randrange(1, 64),
                  0 if decode else rng.choice((1, 32, 64)), float(not decode), rng.randrange(0, 9), rng.random() * 20,
                  rng.random() * 100, rng.randrange(0, 10)))
    y = [sum(c * x for c, x in zip(truth, xs)) for xs in X]
    m = fit(X, y)
    assert m.coef == pytest.approx(truth, rel=1e-6, abs=1e-12)
    assert m.fit_stats["median_rel_err"] < 1e-9


def test_json_roundtrip_and_errors(tmp_path):
    m = CostModel((1e-3,) * len(FEATURES), engine={"num_pages": 100, "token_buckets": [32]}, device="cpu")
    p = tmp_path / "c.json"
    m.save(p)
    assert CostModel.load(p) == m
    p.write_text('{"version": 1, "features": ["const"], "coef_s": {}}')
    with pytest.raises(CostModelError, match="not a version-4 cost model"):
        CostModel.load(p)
    with pytest.raises(CostModelError, match="cannot read"):
        CostModel.load(tmp_path / "missing.json")
    with pytest.raises(CostModelError, match="non-negative"):
        CostModel((-1.0,) + (0.0,) * (len(FEATURES) - 1))
    with pytest.raises(CostModelError, match="at least"):
        fit([(1.0,) * len(FEATURES)], [1.0])


def test_the_shipped_cpu_model_loads():
    m = CostModel.load("cpu-default")
    assert m.device and m.fit_stats["steps"] > 100 and m.engine["num_pages"] > 0
