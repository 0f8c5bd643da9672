"""Causal conv1d reference: ragged == one by one, split calls, snapshots, decode == prefill, vs torch."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from pallas_kernels.conv1d_reference import causal_conv1d_prefill, causal_conv1d_update
from tests.pallas_kernels.test_gdn_reference import PROPERTY_SETTINGS, assert_close, cu_from, run_torch_oracle

T, N, S, C, K = 200, 4, 6, 12, 4
TOL = 1e-6
TORCH_TOL = 1e-5


def random_conv_inputs(rng, lens, *, bias=True, init=True, num_tokens=T):
    """Packed inputs; tokens past the sequences hold garbage on purpose (bucket padding)."""
    return dict(
        x=rng.normal(size=(num_tokens, C)).astype(np.float32),
        weight=rng.normal(size=(C, K)).astype(np.float32),
        bias=rng.normal(size=(C,)).astype(np.float32) if bias else None,
        cu_seqlens=cu_from(lens),
        initial_state=rng.normal(size=(len(lens), C, K - 1)).astype(np.float32) if init else None,
    )


def prefill(inputs, snapshot_seq=None, snapshot_len=None, **overrides):
    """Always S snapshots (static shape): dummies unless asked."""
    if snapshot_seq is None:
        snapshot_seq = snapshot_len = np.zeros(S, np.int32)
    return causal_conv1d_prefill(**{**inputs, **overrides}, snapshot_seq=snapshot_seq, snapshot_len=snapshot_len)


@st.composite
def conv_cases(draw):
    lens = draw(st.lists(st.one_of(st.sampled_from([0, 1, 2, 3, 4]), st.integers(0, T // N)), min_size=N, max_size=N))
    return (np.array(lens, np.int32), draw(st.integers(0, 2**31 - 1)), draw(st.booleans()),
            draw(st.lists(st.integers(0, 10**6), min_size=N, max_size=N)))


def take(x, index):
    """Re-pack tokens ``index`` to the front of a T-token call, garbage after."""
    return x[np.concatenate([index, np.arange(T - len(index))]).astype(np.int64)]


@PROPERTY_SETTINGS
@given(conv_cases())
def test_conv_split_and_snapshots_match_one_call(case):
    """Two calls (state carried) == one call; a snapshot at the split == the first call's state;
    each sequence alone == its slice of the batch; padding tokens give zeros."""
    lens, seed, with_bias, picks = case
    rng = np.random.default_rng(seed)
    inputs = random_conv_inputs(rng, lens, bias=with_bias)
    cu = cu_from(lens)
    split = np.array([p % (n + 1) for p, n in zip(picks, lens)], np.int32)
    snap_seq = np.arange(S, dtype=np.int32) % N
    y, final, snaps = prefill(inputs, snapshot_seq=snap_seq, snapshot_len=split[snap_seq])
    assert not np.asarray(y)[cu[-1]:].any()

    head = np.concatenate([np.arange(cu[n], cu[n] + split[n]) for n in range(N)])
    tail = np.concatenate([np.arange(cu[n] + split[n], cu[n + 1]) for n in range(N)])
    y1, f1, _ = prefill(inputs, x=take(inputs["x"], head), cu_seqlens=cu_from(split))
    y2, f2, _ = prefill(inputs, x=take(inputs["x"], tail), cu_seqlens=cu_from(lens - split), initial_state=f1)
    y_split = np.zeros_like(np.asarray(y))
    y_split[head], y_split[tail] = np.asarray(y1)[: len(head)], np.asarray(y2)[: len(tail)]
    assert_close(y_split, y, TOL, "y")
    assert_close(f2, final, TOL, "final state")
    assert_close(snaps, np.asarray(f1)[snap_seq], TOL, "snapshot at split")

    for n in range(N):
        init = rng.normal(size=(N, C, K - 1)).astype(np.float32)
        init[0] = 0 if inputs["initial_state"] is None else inputs["initial_state"][n]
        y_n, f_n, _ = prefill(inputs, x=take(inputs["x"], np.arange(cu[n], cu[n + 1])),
                              cu_seqlens=cu_from([lens[n], 0, 0, 0]), initial_state=init)
        assert_close(np.asarray(y_n)[: lens[n]], np.asarray(y)[cu[n] : cu[n + 1]], TOL, f"y of seq {n}")
        assert_close(f_n[0], final[n], TOL, f"state of seq {n}")
        np.testing.assert_array_equal(f_n[1:], init[1:])


def test_conv_update_matches_prefill():
    """Decoding token by token (all sequences as one batch) == prefilling them."""
    rng = np.random.default_rng(0)
    steps = 6
    inputs = random_conv_inputs(rng, [steps] * N)
    y_pre, final_pre, _ = prefill(inputs)
    state = inputs["initial_state"]
    x = inputs["x"][: steps * N].reshape(N, steps, C)
    for i in range(steps):
        y, state = causal_conv1d_update(x[:, i], state, inputs["weight"], inputs["bias"])
        assert_close(y, np.asarray(y_pre)[: steps * N].reshape(N, steps, C)[:, i], TOL, f"y at step {i}")
    assert_close(state, final_pre, TOL, "state")


def test_conv_rejects_bad_shapes():
    rng = np.random.default_rng(0)
    inputs = random_conv_inputs(rng, [3, 0, 0, 0])
    with pytest.raises(ValueError, match="initial_state"):
        prefill(inputs, initial_state=np.zeros((N, C, K), np.float32))  # transformers' [.., K] layout


CONV_TORCH_CASES = {"bias_init": dict(lens=[1, 3, 70, 5], bias=True, init=True),
                    "plain": dict(lens=[2, 40], bias=False, init=False)}


@pytest.fixture(scope="module")
def conv_torch(tmp_path_factory):
    inputs = {}
    for seed, (name, spec) in enumerate(CONV_TORCH_CASES.items()):
        x = random_conv_inputs(np.random.default_rng(300 + seed), spec["lens"], bias=spec["bias"], init=True)
        if not spec["init"]:
            x["initial_state"] = np.zeros_like(x["initial_state"])
        inputs[name] = x
    return inputs, run_torch_oracle("conv", inputs, tmp_path_factory.mktemp("conv_torch"))


def test_conv_matches_torch(conv_torch):
    """Prefill and decode vs transformers' causal_conv1d_fn (cached prefill) and causal_conv1d_update."""
    inputs, torch_out = conv_torch
    for name, spec in CONV_TORCH_CASES.items():
        x = dict(inputs[name])
        if not spec["init"]:
            x["initial_state"] = None
        y, final, _ = prefill(x)
        cu = x["cu_seqlens"]
        for impl in ("hf_prefill", "hf_update"):
            y_t, state_t = torch_out[f"conv/{name}/{impl}/y"], torch_out[f"conv/{name}/{impl}/state"]
            assert_close(np.asarray(y)[: cu[-1]], y_t, TORCH_TOL, f"{name}: prefill vs {impl}: y")
            assert_close(final, state_t, TORCH_TOL, f"{name}: prefill vs {impl}: state")
        for n in range(len(spec["lens"])):  # our decode path, one sequence at a time
            state = np.asarray(inputs[name]["initial_state"][n : n + 1])
            for t in range(cu[n], cu[n + 1]):
                y_t, state = causal_conv1d_update(x["x"][t : t + 1], state, x["weight"], x["bias"])
                assert_close(y_t[0], torch_out[f"conv/{name}/hf_update/y"][t], TORCH_TOL, f"{name}: update y")
            assert_close(state[0], torch_out[f"conv/{name}/hf_update/state"][n], TORCH_TOL, f"{name}: update state")
