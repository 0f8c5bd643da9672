"""KDA reference: the delta-rule properties of test_gdn_reference with a per-channel gate, and vs torch.

Kimi-Linear has as many q/k heads as value heads (transformers' Kimi fallbacks support only that),
fla's naive KDA also does grouped heads (``repeat_interleave``): both layouts are covered. The
``use_qk_l2norm=False`` path is shared core code, checked against fla in test_gdn_reference.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given

from pallas_kernels.kda_reference import kda_chunked, kda_recurrent
from tests.pallas_kernels.test_gdn_reference import (
    HK,
    PROPERTY_SETTINGS,
    Family,
    TorchCase,
    check_against_torch,
    check_chunked_matches_recurrent,
    check_ragged_matches_one_by_one,
    check_split_matches_one_call,
    ragged_cases,
    random_inputs,
    run,
    run_torch_oracle,
    torch_case_inputs,
)

KDA = Family(kda_recurrent, kda_chunked, per_channel_gate=True)


@PROPERTY_SETTINGS
@given(ragged_cases())
def test_kda_chunked_matches_recurrent(case):
    check_chunked_matches_recurrent(KDA, case)


@PROPERTY_SETTINGS
@given(ragged_cases())
def test_kda_ragged_matches_one_by_one(case):
    check_ragged_matches_one_by_one(KDA, case)


@PROPERTY_SETTINGS
@given(ragged_cases())
def test_kda_split_matches_one_call(case):
    check_split_matches_one_call(KDA, case)


def test_kda_rejects_a_per_head_gate():
    """A GDN-shaped gate passed to KDA is a shape error, not a silent broadcast."""
    rng = np.random.default_rng(0)
    inputs = random_inputs(rng, [10, 0, 0, 0], hv=HK, per_channel_gate=False)
    with pytest.raises(ValueError, match="KDA gate"):
        run(kda_recurrent, inputs)


KDA_TORCH_CASES = {
    "kimi_l2": TorchCase(lens=[70, 64, 5, 130], hv=HK, use_qk_l2norm=True, start_pos=[0, 37, 64, 5]),
    "gqa_l2": TorchCase(lens=[65, 1, 128], hv=2 * HK, use_qk_l2norm=True, start_pos=[63, 0, 1]),
}


@pytest.fixture(scope="module")
def kda_torch(tmp_path_factory):
    inputs = {}
    for seed, (name, spec) in enumerate(KDA_TORCH_CASES.items()):
        x = torch_case_inputs(spec, per_channel_gate=True, seed=200 + seed)
        inputs[name] = {**x, "use_qk_l2norm": np.int32(spec.use_qk_l2norm)}
    return inputs, run_torch_oracle("kda", inputs, tmp_path_factory.mktemp("kda_torch"))


def test_kda_matches_torch(kda_torch):
    inputs, torch_out = kda_torch
    fla = ["fla_chunk", "fla_recurrent"]
    impls = {name: fla + (["hf_chunk", "hf_recurrent"] if spec.hv == HK else [])
             for name, spec in KDA_TORCH_CASES.items()}
    check_against_torch(KDA, "kda", KDA_TORCH_CASES, inputs, torch_out, impls)
