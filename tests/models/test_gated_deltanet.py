"""The delta rule of a mixed step with the scheduler's promise (``cfg.chunked_rows``): the one-token
rows by the recurrent rule, the others on a chunk grid sized for them only
(``gated_deltanet._mixed_rule``), against the unsplit chunked rule on the same ragged batches."""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from jaxserve.config import ModelConfig
from jaxserve.models import gated_deltanet
from jaxserve.models.decoder import make_ragged
from tests.pallas_kernels.test_gdn_reference import assert_close

T, B, S, P = 192, 6, 6, 2  # tokens, rows, snapshot entries, rows of more than one token at most
HK, HV, DK, DV = 2, 4, 16, 8
BASE = ModelConfig.from_file(Path(__file__).resolve().parents[2] / "weights" / "default" / "config.json")


@functools.partial(jax.jit, static_argnames="split_kernels")
def _both(q, k, v, g, beta, init, r, split_kernels="jnp"):
    """(unsplit jnp, split on ``split_kernels``) results of GDN (per-head ``g``) or KDA
    (per-channel ``g``) on one batch."""
    kda = g.ndim == 3
    out = []
    for rows, kernels in ((0, "jnp"), (P, split_kernels)):
        cfg = dataclasses.replace(BASE, kernels=kernels, kda=kda, chunked_rows=rows,
                                  linear_key_head_dim=q.shape[-1], linear_value_head_dim=v.shape[-1])
        out.append(gated_deltanet._delta_rule(cfg, q, k, v, g, beta, init, r, decode=False))
    return out


@st.composite
def mixed_batches(draw):
    """Up to ``P`` rows of 2..90 tokens, the rest one-token rows or empty (padding), at random
    absolute positions; snapshot requests a chunked step can serve (0, the row's length, a ×64
    boundary), padding entries (row 0, length 0) included, ordered as ``make_batch`` orders them
    (rows of several tokens first, at most T // 64 + P of theirs: past that the entries are the
    one-token rows', which the chunked rule does not compute)."""
    multi = draw(st.lists(st.integers(2, 90), min_size=0, max_size=P))
    kinds = multi + draw(st.lists(st.sampled_from([0, 1, 1]), min_size=B - len(multi), max_size=B - len(multi)))
    lens = np.array(draw(st.permutations(kinds)), np.int32)
    lens = np.concatenate([lens[lens > 0], lens[lens == 0]])  # empty rows are the batch's padding, last
    start = np.array(draw(st.lists(st.one_of(st.sampled_from([0, 63, 64, 120]), st.integers(0, 300)),
                                   min_size=B, max_size=B)), np.int32)
    rows = [b for b in range(B) if lens[b] > 0]
    snaps = []
    for pick in draw(st.lists(st.integers(0, 10**6), min_size=0, max_size=S if rows else 0)):
        row = rows[pick % len(rows)]
        n, c = int(lens[row]), int(start[row])
        options = [0, n, *(m for m in range(1, n) if (c + m) % 64 == 0)]
        snaps.append((row, options[(pick // B) % len(options)]))
    snaps.sort(key=lambda s: lens[s[0]] == 1)  # rows of several tokens first, as make_batch orders them
    assume(sum(lens[row] > 1 for row, _ in snaps) <= T // 64 + P)  # make_batch's bound (the ×64 boundaries)
    real = len(snaps)
    snaps += [(0, 0)] * (S - real)  # padding entries (stored nowhere: their destination is the null slot)
    return lens, start, snaps, real, draw(st.booleans()), draw(st.integers(0, 2**31 - 1))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=mixed_batches())
def test_split_mixed_rule_equals_the_chunked_rule(case):
    check_split(case, "jnp")


@pytest.mark.parametrize("kda", [False, True])
def test_split_mixed_rule_on_the_prefill_kernel(kda):
    """The serving path on a GPU (``gdn_prefill`` under ``auto``), in Mosaic GPU's interpreter: two
    rows of several tokens (one resumed mid-chunk, crossing a boundary), one-token rows and
    padding, snapshots on both kinds of rows."""
    lens = np.array([70, 1, 5, 1, 0, 0], np.int32)
    start = np.array([40, 17, 0, 64, 0, 0], np.int32)
    snaps = [(0, 24), (0, 70), (2, 5), (0, 0), (1, 1), (3, 0)]
    check_split((lens, start, snaps, len(snaps), kda, 5), "interpret:gdn_prefill", hk=1, hv=2, dk=64, dv=64)


def check_split(case, split_kernels, hk=HK, hv=HV, dk=DK, dv=DV):
    lens, start, snaps, real_snaps, kda, seed = case
    rng = np.random.default_rng(seed)
    normal = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.float32)  # noqa: E731
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    positions = np.zeros(T, np.int32)
    for b in range(B):
        positions[cu[b]:cu[b + 1]] = start[b] + np.arange(lens[b])
    r = make_ragged(jnp.asarray(positions), jnp.asarray(cu), jnp.asarray(start), jnp.zeros((B, 1), jnp.int32),
                    jnp.zeros(B, jnp.int32), jnp.zeros(B, jnp.int32),
                    jnp.asarray([s for s, _ in snaps], jnp.int32), jnp.asarray([n for _, n in snaps], jnp.int32),
                    jnp.zeros(S, jnp.int32))
    g_shape = (T, hv, dk) if kda else (T, hv)
    g = -jnp.asarray(rng.uniform(0, 1, size=g_shape), jnp.float32)
    beta = jnp.asarray(rng.uniform(0, 1, size=(T, hv)), jnp.float32)
    init = jnp.where(jnp.asarray(start == 0)[:, None, None, None], 0.0, normal(B, hv, dk, dv))
    (o0, f0, s0), (o1, f1, s1) = _both(normal(T, hk, dk), normal(T, hk, dk), normal(T, hv, dv), g, beta, init, r,
                                       split_kernels=split_kernels)
    tokens = int(cu[-1])
    assert_close(np.asarray(o1[:tokens]), np.asarray(o0[:tokens]), 1e-5, "outputs")
    assert_close(np.asarray(f1), np.asarray(f0), 1e-5, "final states")
    assert_close(np.asarray(s1)[:real_snaps], np.asarray(s0)[:real_snaps], 1e-5, "snapshots")  # the rest: padding
    assert np.isfinite(np.asarray(s1)).all()


def test_store_skips_padding_writes_but_not_a_real_row_in_slot_0():
    """``_store``: an empty (padding) row and a padding snapshot entry (destination 0) write nothing;
    a non-empty row keeps whatever slot it names, slot 0 included (``decoder.forward``'s rows)."""
    pool = jnp.full((2, 5, 3), 7.0)
    final, snaps = jnp.arange(9.0).reshape(3, 3), 100 + jnp.arange(6.0).reshape(2, 3)

    def store(cu, write_slot, snap_dst):
        r = make_ragged(jnp.zeros(4, jnp.int32), jnp.asarray(cu, jnp.int32), jnp.zeros(3, jnp.int32),
                        jnp.zeros((3, 1), jnp.int32), jnp.asarray(write_slot, jnp.int32), jnp.asarray(write_slot, jnp.int32),
                        jnp.zeros(2, jnp.int32), jnp.zeros(2, jnp.int32), jnp.asarray(snap_dst, jnp.int32))
        return np.asarray(gated_deltanet._store(pool, 1, r, final, snaps))

    out = store([0, 3, 4, 4], [2, 4, 0], [3, 0])  # rows: 3 tokens, 1 token, empty; snapshots: real, padding
    assert (out[1, 2] == final[0]).all() and (out[1, 4] == final[1]).all() and (out[1, 3] == snaps[0]).all()
    assert (out[1, [0, 1]] == 7.0).all() and (out[0] == 7.0).all()
    out = store([0, 3, 4, 4], [0, 4, 1], [3, 0])  # a real row in slot 0 writes it
    assert (out[1, 0] == final[0]).all() and (out[1, 1] == 7.0).all()
