"""GDN reference: chunked == recurrent, ragged == one by one, snapshots, split calls, and vs torch.

The property checks (``check_*``) are written once for the delta-rule family and reused by
``test_kda_reference.py``. Shapes are fixed (T, N, S, head sizes from two configs) so every
hypothesis example reuses the same compiled functions; raggedness, start positions, snapshot
positions and bucket padding are all data.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pallas_kernels.gdn_reference import gdn_chunked, gdn_recurrent
from tests.reference.bridge import run_torch

CHUNK = 64
T, N, S = 600, 4, 6  # packed tokens, sequences, snapshots per call (fixed: one compile per head config)
HK, DK, DV = 2, 16, 8
MAX_LEN = T // N
TOL = 3e-5  # chunked vs recurrent, both fp32: the chunked form takes decays as differences of
# cumulative log-gates (down to ~-500 over a chunk at gate_scale 8), ~eps * |sum| apart; 201 seeds of
# that case (one 64-token row): worst 1.06e-5 of the scale; a CI run drew one just over the old 1e-5
TORCH_TOL = 1e-5  # observed errors are ~1e-6 of the output scale

PROPERTY_SETTINGS = settings(max_examples=12, deadline=None, database=None,
                             suppress_health_check=[HealthCheck.too_slow])


class Family(NamedTuple):
    """A delta-rule variant under test: its two forms and the shape of its gate."""

    recurrent: Callable
    chunked: Callable
    per_channel_gate: bool


GDN = Family(gdn_recurrent, gdn_chunked, per_channel_gate=False)


# ------------------------------------------------------------------------------------------------
# Inputs
# ------------------------------------------------------------------------------------------------


def random_inputs(rng, lens, *, hv, per_channel_gate, gate_scale=1.0, with_init=True, num_tokens=T,
                  hk=HK, dk=DK, dv=DV):
    """Random packed inputs. Tokens past the sequences (bucket padding) hold garbage, on purpose."""
    normal = lambda *shape: rng.normal(size=shape).astype(np.float32)  # noqa: E731
    g_shape = (num_tokens, hv, dk) if per_channel_gate else (num_tokens, hv)
    return dict(
        q=normal(num_tokens, hk, dk), k=normal(num_tokens, hk, dk), v=normal(num_tokens, hv, dv),
        g=-rng.uniform(0, gate_scale, size=g_shape).astype(np.float32),
        beta=rng.uniform(0, 1, size=(num_tokens, hv)).astype(np.float32),
        cu_seqlens=np.concatenate([[0], np.cumsum(lens)]).astype(np.int32),
        initial_state=normal(len(lens), hv, dk, dv) if with_init else None,
    )


class Case(NamedTuple):
    lens: np.ndarray
    start_pos: np.ndarray
    hv: int
    seed: int
    gate_scale: float
    with_init: bool
    picks: tuple  # raw draws turned into snapshot requests / split points by the checks


_lengths = st.one_of(st.sampled_from([0, 1, 5, 63, 64, 65, 127, 128, 129]), st.integers(0, MAX_LEN))
_positions = st.one_of(st.sampled_from([0, 1, 63, 64, 100, 128]), st.integers(0, 300))


@st.composite
def ragged_cases(draw):
    return Case(
        lens=np.array(draw(st.lists(_lengths, min_size=N, max_size=N)), np.int32),
        start_pos=np.array(draw(st.lists(_positions, min_size=N, max_size=N)), np.int32),
        hv=draw(st.sampled_from([HK, 2 * HK])),
        seed=draw(st.integers(0, 2**31 - 1)),
        gate_scale=draw(st.sampled_from([0.05, 1.0, 8.0])),
        with_init=draw(st.booleans()),
        picks=tuple(draw(st.lists(st.integers(0, 10**6), min_size=S, max_size=S))),
    )


def inputs_for(case: Case, family: Family):
    rng = np.random.default_rng(case.seed)
    return random_inputs(rng, case.lens, hv=case.hv, per_channel_gate=family.per_channel_gate,
                         gate_scale=case.gate_scale, with_init=case.with_init)


def chunk_snapshots(case: Case):
    """S snapshot requests the chunked form can serve: lengths 0, full, or on an absolute ×64 boundary."""
    seqs, lens = [], []
    for pick in case.picks:
        n = pick % N
        length, pos = int(case.lens[n]), int(case.start_pos[n])
        options = [0, length, *(l for l in range(1, length) if (pos + l) % CHUNK == 0)]
        seqs.append(n)
        lens.append(options[(pick // N) % len(options)])
    return np.array(seqs, np.int32), np.array(lens, np.int32)


def assert_close(actual, expected, tol, what=""):
    """Elementwise ``|a - e| <= tol * (|e| + max(1, max|e|))``: relative, floored at the array's scale."""
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    assert actual.shape == expected.shape, (what, actual.shape, expected.shape)
    scale = max(1.0, float(np.abs(expected).max(initial=0.0)))
    err = np.abs(actual - expected) - tol * (np.abs(expected) + scale)
    assert np.all(err <= 0), f"{what}: max abs diff {np.abs(actual - expected).max():.3g} (scale {scale:.3g})"


# Every call asks for S snapshots (dummies when the check needs none): S is a static shape, and one
# compiled function per head config keeps the module fast.
NO_SNAPSHOTS = dict(snapshot_seq=np.zeros(S, np.int32), snapshot_len=np.zeros(S, np.int32))


def run(fn, inputs, **kwargs):
    return fn(**inputs, **{**NO_SNAPSHOTS, **kwargs})


def take_tokens(inputs, token_index, num_tokens=T):
    """Re-pack the tokens ``token_index`` to the front of a fixed-size call; the rest is garbage."""
    pad = num_tokens - len(token_index)
    index = np.concatenate([token_index, np.arange(pad) % num_tokens]).astype(np.int64)
    return {name: inputs[name][index] for name in ("q", "k", "v", "g", "beta")}


def cu_from(lens):
    return np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)


# ------------------------------------------------------------------------------------------------
# Properties, shared with test_kda_reference.py
# ------------------------------------------------------------------------------------------------


def check_chunked_matches_recurrent(family: Family, case: Case):
    """Same outputs, final states and (boundary) snapshots; padding-token outputs are zero."""
    inputs = inputs_for(case, family)
    snap_seq, snap_len = chunk_snapshots(case)
    kw = dict(snapshot_seq=snap_seq, snapshot_len=snap_len)
    o_r, f_r, s_r = run(family.recurrent, inputs, **kw)
    o_c, f_c, s_c = run(family.chunked, inputs, start_pos=case.start_pos, **kw)
    assert_close(o_c, o_r, TOL, "o")
    assert_close(f_c, f_r, TOL, "final_state")
    assert_close(s_c, s_r, TOL, "snapshots")
    used = int(case.lens.sum())
    assert not np.any(np.asarray(o_c)[used:]) and not np.any(np.asarray(o_r)[used:])
    if case.with_init:  # an empty sequence's final state is its initial state
        for n in np.flatnonzero(case.lens == 0):
            np.testing.assert_array_equal(f_c[n], inputs["initial_state"][n])


def check_ragged_matches_one_by_one(family: Family, case: Case):
    """Each sequence run alone (first in an otherwise empty batch) gives its slice of the batch run."""
    inputs = inputs_for(case, family)
    o_all, f_all, _ = run(family.chunked, inputs, start_pos=case.start_pos)
    cu = cu_from(case.lens)
    rng = np.random.default_rng(case.seed + 1)
    for n in range(N):
        alone = take_tokens(inputs, np.arange(cu[n], cu[n + 1]))
        lens = np.array([case.lens[n], 0, 0, 0], np.int32)
        init = rng.normal(size=(N, case.hv, DK, DV)).astype(np.float32)
        if inputs["initial_state"] is not None:
            init[0] = inputs["initial_state"][n]
        else:
            init[0] = 0
        start = np.array([case.start_pos[n], 7, 0, 64], np.int32)
        for fn, kw in ((family.chunked, dict(start_pos=start)), (family.recurrent, {})):
            o, f, _ = run(fn, alone, cu_seqlens=cu_from(lens), initial_state=init, **kw)
            assert_close(np.asarray(o)[: case.lens[n]], np.asarray(o_all)[cu[n] : cu[n + 1]], TOL, f"o of seq {n}")
            assert_close(f[0], f_all[n], TOL, f"final state of seq {n}")
            np.testing.assert_array_equal(f[1:], init[1:])  # empty sequences keep their state


def check_split_matches_one_call(family: Family, case: Case):
    """Prefill in two calls (state carried, start_pos advanced) == one call; the recurrent
    snapshot at the split point == the first call's final state."""
    inputs = inputs_for(case, family)
    split = np.array([p % (length + 1) for p, length in zip(case.picks, case.lens)], np.int32)
    cu = cu_from(case.lens)
    rest = case.lens - split
    snap_seq = np.arange(S, dtype=np.int32) % N
    snap_len = split[snap_seq]
    o_one, f_one, _ = run(family.chunked, inputs, start_pos=case.start_pos)
    _, _, s_rec = run(family.recurrent, inputs, snapshot_seq=snap_seq, snapshot_len=snap_len)

    head = np.concatenate([np.arange(cu[n], cu[n] + split[n]) for n in range(N)])
    tail = np.concatenate([np.arange(cu[n] + split[n], cu[n + 1]) for n in range(N)])
    o1, f1, _ = run(family.chunked, take_tokens(inputs, head), cu_seqlens=cu_from(split),
                    initial_state=inputs["initial_state"], start_pos=case.start_pos)
    o2, f2, _ = run(family.chunked, take_tokens(inputs, tail), cu_seqlens=cu_from(rest),
                    initial_state=f1, start_pos=case.start_pos + split)
    o_split = np.zeros_like(np.asarray(o_one))
    o_split[head] = np.asarray(o1)[: len(head)]
    o_split[tail] = np.asarray(o2)[: len(tail)]
    assert_close(o_split, o_one, TOL, "o")
    assert_close(f2, f_one, TOL, "final state")
    assert_close(s_rec, np.asarray(f1)[snap_seq], TOL, "recurrent snapshot at split vs first call's state")


# ------------------------------------------------------------------------------------------------
# GDN properties
# ------------------------------------------------------------------------------------------------


@PROPERTY_SETTINGS
@given(ragged_cases())
def test_gdn_chunked_matches_recurrent(case):
    check_chunked_matches_recurrent(GDN, case)


@PROPERTY_SETTINGS
@given(ragged_cases())
def test_gdn_ragged_matches_one_by_one(case):
    check_ragged_matches_one_by_one(GDN, case)


@PROPERTY_SETTINGS
@given(ragged_cases())
def test_gdn_split_matches_one_call(case):
    check_split_matches_one_call(GDN, case)


def test_gdn_one_compile_for_any_raggedness():
    """cu_seqlens / start_pos / snapshots are data: a jitted caller compiles once."""
    rng = np.random.default_rng(0)
    inputs = random_inputs(rng, [T // 2, T // 4, 0, T // 4], hv=HK, per_channel_gate=False)
    x = {k: inputs[k] for k in ("q", "k", "v", "g", "beta", "initial_state")}
    f = jax.jit(lambda x, cu, sp: run(gdn_chunked, x, cu_seqlens=cu, start_pos=sp))
    for lens, sp in (([300, 150, 0, 150], [0, 3, 0, 70]), ([1, 64, 65, 0], [63, 0, 1, 9])):
        o, final, _ = f(x, cu_from(lens), np.array(sp, np.int32))
        o_ref, final_ref, _ = run(gdn_recurrent, x, cu_seqlens=cu_from(lens))
        assert_close(o, o_ref, TOL, "o")
        assert_close(final, final_ref, TOL, "final")
    assert f._cache_size() == 1


def test_gdn_snapshot_off_boundary_is_an_error():
    """Chunked snapshots exist only at ×64 boundaries: eager misuse raises, jitted misuse is NaN."""
    rng = np.random.default_rng(1)
    inputs = random_inputs(rng, [100, 0, 0, 0], hv=HK, per_channel_gate=False)
    bad = dict(snapshot_seq=np.zeros(S, np.int32), snapshot_len=np.full(S, 30, np.int32))
    with pytest.raises(ValueError, match="boundary"):
        run(gdn_chunked, inputs, start_pos=np.array([10, 0, 0, 0], np.int32), **bad)
    run(gdn_chunked, inputs, start_pos=np.array([34, 0, 0, 0], np.int32), **bad)  # 34 + 30 = 64: fine
    run(gdn_recurrent, inputs, **bad)  # the recurrent form has every position
    with pytest.raises(ValueError, match="not available"):
        run(gdn_recurrent, inputs, snapshot_len=np.full(S, 101, np.int32))
    jitted = jax.jit(lambda sl: run(gdn_chunked, inputs, snapshot_len=sl)[2])
    snaps = np.asarray(jitted(np.array([30, 64, 0, 100, 30, 64], np.int32)))
    assert np.isnan(snaps[[0, 4]]).all() and not np.isnan(snaps[[1, 2, 3, 5]]).any()


def test_gdn_bf16_inputs_compute_in_fp32():
    """bf16 in, bf16 out, and the result is the fp32 computation on the bf16 values, rounded once."""
    rng = np.random.default_rng(2)
    inputs = random_inputs(rng, [130, 70, 0, 5], hv=2 * HK, per_channel_gate=False)
    as_bf16 = {k: (jnp.asarray(v, jnp.bfloat16) if k in ("q", "k", "v", "g", "beta") else v) for k, v in inputs.items()}
    as_f32 = {k: (jnp.asarray(v, jnp.float32) if k in ("q", "k", "v", "g", "beta") else v) for k, v in as_bf16.items()}
    for fn in (gdn_recurrent, gdn_chunked):
        o16, f16, _ = run(fn, as_bf16)
        o32, f32, _ = run(fn, as_f32)
        assert o16.dtype == jnp.bfloat16 and f16.dtype == jnp.float32
        assert_close(np.asarray(o16.astype(jnp.float32)), np.asarray(o32), 2**-8, "o: one bf16 rounding")
        assert_close(f16, f32, TOL, "state stays fp32")


# ------------------------------------------------------------------------------------------------
# Against torch (fla naive ops and transformers' fallbacks), one torch run for the module
# ------------------------------------------------------------------------------------------------


class TorchCase(NamedTuple):
    lens: list
    hv: int
    use_qk_l2norm: bool
    start_pos: list  # for our chunked form; torch chunks every sequence from its own start


def torch_case_inputs(spec: TorchCase, per_channel_gate: bool, seed: int):
    """Inputs for one torch case, bucket-padded to T like the property tests (same compiled
    functions); the torch side only reads the tokens inside cu_seqlens."""
    rng = np.random.default_rng(seed)
    inputs = random_inputs(rng, spec.lens, hv=spec.hv, per_channel_gate=per_channel_gate)
    if not spec.use_qk_l2norm:  # keep the raw delta rule stable: |k| < 1 so beta |k|² < 2
        for key in ("q", "k"):
            x = inputs[key]
            inputs[key] = (0.9 * x / np.linalg.norm(x, axis=-1, keepdims=True)).astype(np.float32)
    return inputs


def run_torch_oracle(family_name: str, cases: dict, tmp_path) -> dict:
    """Write all cases to one npz, run tests.reference.linear_attn_oracle once, read the outputs."""
    arrays = {}
    for name, inputs in cases.items():
        for key, value in inputs.items():
            if value is not None:
                arrays[f"{family_name}/{name}/{key}"] = np.asarray(value)
    in_path, out_path = tmp_path / "in.npz", tmp_path / "out.npz"
    np.savez(in_path, **arrays)
    run_torch("tests.reference.linear_attn_oracle", str(in_path), str(out_path))
    with np.load(out_path) as data:
        return {key: data[key] for key in data.files}


def check_against_torch(family: Family, family_name: str, specs: dict, inputs: dict, torch_out: dict,
                        expected_impls: dict):
    """Our recurrent and chunked forms vs every torch impl, per case: o and final state."""
    for name, spec in specs.items():
        x = dict(inputs[name])
        l2 = bool(x.pop("use_qk_l2norm"))
        ours = {
            "recurrent": run(family.recurrent, x, use_qk_l2norm=l2),
            "chunked": run(family.chunked, x, use_qk_l2norm=l2, start_pos=np.array(spec.start_pos, np.int32)),
        }
        for impl in expected_impls[name]:
            o_t = torch_out[f"{family_name}/{name}/{impl}/o"]
            state_t = torch_out[f"{family_name}/{name}/{impl}/state"]
            for form, (o, final, _) in ours.items():
                assert_close(np.asarray(o)[: len(o_t)], o_t, TORCH_TOL, f"{name}: ours {form} vs {impl}: o")
                assert_close(final, state_t, TORCH_TOL, f"{name}: ours {form} vs {impl}: state")


GDN_TORCH_CASES = {
    "gqa_l2": TorchCase(lens=[70, 64, 5, 130], hv=2 * HK, use_qk_l2norm=True, start_pos=[0, 37, 64, 5]),
    "mha_raw": TorchCase(lens=[65, 1, 128], hv=HK, use_qk_l2norm=False, start_pos=[63, 0, 1]),
}


@pytest.fixture(scope="module")
def gdn_torch(tmp_path_factory):
    inputs = {}
    for seed, (name, spec) in enumerate(GDN_TORCH_CASES.items()):
        x = torch_case_inputs(spec, per_channel_gate=False, seed=100 + seed)
        inputs[name] = {**x, "use_qk_l2norm": np.int32(spec.use_qk_l2norm)}
    return inputs, run_torch_oracle("gdn", inputs, tmp_path_factory.mktemp("gdn_torch"))


def test_gdn_matches_torch(gdn_torch):
    inputs, torch_out = gdn_torch
    impls = {name: ["hf_chunk", "hf_recurrent", "fla_chunk", "fla_recurrent"] for name in GDN_TORCH_CASES}
    check_against_torch(GDN, "gdn", GDN_TORCH_CASES, inputs, torch_out, impls)
