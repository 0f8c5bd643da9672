"""What the chunked-prefill kernel tests share: random ragged inputs, every snapshot boundary the
chunked form can answer, relative error, and the check of a fused kernel against its references."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

# Log-decays small enough that a state survives a chunk (~e^-1 per 64 tokens): with the models'
# typical gates (up to ~-1 per token) every chunk would start from a forgotten state and neither the
# initial states nor the chunk-to-chunk carry would be tested.
GATE = 0.03


def make_inputs(rng, *, lens, T, Hk, Hv, dk, dv, kda=False, dtype=np.float32):
    """Random q, k, v, beta and log-decays in ``[-GATE, 0]`` (per head, or per channel for ``kda``),
    all in ``dtype``; ``cu_seqlens`` of ``lens`` (``T - sum(lens)`` tokens of padding) and random
    initial states. Returns ``(inputs, cu_seqlens, initial_state)``."""
    normal = lambda *s: rng.normal(size=s).astype(np.float32)  # noqa: E731
    g_shape = (T, Hv, dk) if kda else (T, Hv)
    x = dict(q=normal(T, Hk, dk), k=normal(T, Hk, dk), v=normal(T, Hv, dv),
             g=-rng.uniform(0, GATE, size=g_shape).astype(np.float32),
             beta=rng.uniform(0, 1, size=(T, Hv)).astype(np.float32))
    x = {n: jnp.asarray(a, dtype) for n, a in x.items()}
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    assert cu[-1] <= T
    init = normal(len(lens), Hv, dk, dv) * np.float32(0.5)
    return x, jnp.asarray(cu), jnp.asarray(init)


def every_boundary(lens, start_pos, chunk=64, pad_to=None):
    """All (seq, len) snapshot requests the chunked form can answer: 0, each absolute ×``chunk``
    boundary inside a sequence, the whole sequence. ``pad_to``: that many requests, repeating the
    last (fixed shapes share compiles)."""
    pairs = [(n, t) for n, (L, s) in enumerate(zip(lens, start_pos)) for t in range(L + 1)
             if t in (0, L) or (s + t) % chunk == 0]
    if pad_to is not None:
        assert len(pairs) <= pad_to
        pairs += pairs[-1:] * (pad_to - len(pairs))
    seq, length = zip(*pairs)
    return jnp.asarray(seq, jnp.int32), jnp.asarray(length, jnp.int32)


def rel(a, b):
    """``|a - b| / |b|`` in float64 (Frobenius norms)."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30)


def check_fused(kernel, chunked, recurrent_fn, x, cu, init, start_pos, *, tol, recurrent=True, **kw):
    """Every boundary snapshot plus one unavailable request (length 1 of a sequence longer than 1
    that does not start one token before a boundary), under ``jit``: the fused ``kernel`` (in
    interpret mode, ``kw`` passed on) must match the chunked reference ``chunked`` within ``tol``
    (and, with ``recurrent``, the token-by-token ``recurrent_fn`` within ``10 * tol``), output zeros
    on bucket padding and return NaN for the unavailable state."""
    lens, start = np.diff(np.asarray(cu)), np.asarray(start_pos)
    snap_seq, snap_len = every_boundary(lens, start)
    bad = next(n for n, (L, s) in enumerate(zip(lens, start)) if L > 1 and (s + 1) % 64)
    args = dict(cu_seqlens=cu, initial_state=init, snapshot_seq=snap_seq, snapshot_len=snap_len)
    run = jax.jit(lambda x, s, n: kernel(**x, cu_seqlens=cu, initial_state=init, start_pos=start_pos,
                                         snapshot_seq=s, snapshot_len=n, interpret=True, **kw))
    o, final, snaps = run(x, jnp.append(snap_seq, bad), jnp.append(snap_len, 1))
    assert np.isnan(snaps[-1]).all()
    snaps = snaps[:-1]
    o_r, final_r, snaps_r = chunked(**x, **args, start_pos=start_pos)
    assert o.dtype == x["v"].dtype and final.dtype == snaps.dtype == jnp.float32
    assert o.shape == o_r.shape and final.shape == final_r.shape and snaps.shape == snaps_r.shape
    assert np.isfinite(np.asarray(o, np.float32)).all() and np.isfinite(final).all() and np.isfinite(snaps).all()
    assert rel(o, o_r) < tol and rel(final, final_r) < tol and rel(snaps, snaps_r) < tol
    np.testing.assert_array_equal(np.asarray(o, np.float32)[int(cu[-1]):], 0.0)  # bucket padding tokens
    if recurrent:
        o_t, final_t, snaps_t = recurrent_fn(**x, **args)
        assert rel(o, o_t) < 10 * tol and rel(final, final_t) < 10 * tol and rel(snaps, snaps_t) < 10 * tol
