"""Kernels for jaxserve, each beside its pure-jnp fp32 reference.

The references (``*_reference.py``) are the oracle the Pallas kernels are tested against and the
CPU path of the models. All of them take ragged batches the same way, described here once:

* Tokens of all sequences are packed along axis 0 (``T`` tokens), sequence ``n`` owning
  ``[cu_seqlens[n], cu_seqlens[n+1])``. ``cu_seqlens`` is int32 ``[N+1]``, non-decreasing,
  ``cu_seqlens[0] == 0``; empty sequences are allowed.
* Tokens at index ``>= cu_seqlens[-1]`` are bucket padding: they have no effect on any state and
  their outputs are zero. This lets one compiled function serve every raggedness with the same
  static ``T``.
* Snapshots are requested as pairs ``(snapshot_seq[s], snapshot_len[s])``: the state of sequence
  ``snapshot_seq[s]`` after ``snapshot_len[s]`` of its tokens in this call (0 means the initial
  state). The number of snapshots ``S`` is static; callers pad by repeating an entry.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from pallas_kernels import stable_names

stable_names.install()  # every kernel below lowers to the same bytes each time: see stable_names.py


def token_segments(cu_seqlens: jnp.ndarray, num_tokens: int) -> tuple[jnp.ndarray, jnp.ndarray]:
    """Per-token sequence id and index inside its sequence, from ``cu_seqlens``.

    Returns ``(seq, local)``, both int32 ``[num_tokens]``. Padding tokens (index ``>=
    cu_seqlens[-1]``) get ``seq == N`` (one past the last sequence), which every caller treats as
    "no sequence": gathers with it must be clamped, scatters with it dropped. Built with jnp ops
    only, so raggedness is data, not shape.
    """
    num_seqs = cu_seqlens.shape[0] - 1
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    # compare_all: one fused compare-and-count; the default method is a loop of tiny GPU kernels
    seq = (jnp.searchsorted(cu_seqlens, t, side="right", method="compare_all") - 1).astype(jnp.int32)
    seq = jnp.minimum(seq, num_seqs)
    local = t - cu_seqlens[jnp.minimum(seq, num_seqs - 1)]
    return seq, local.astype(jnp.int32)


def first_of_each(ids: jnp.ndarray, keep: jnp.ndarray) -> jnp.ndarray:
    """``keep``, less every entry whose id an earlier kept entry already has: the kept ids are then
    distinct, so a scatter to them may declare ``unique_indices``. One ``[n, n]`` compare (n: rows
    or snapshot entries of a step, not tokens). Repeats come from a decode batch's padding rows, which
    all name the null slot and page; real rows name distinct ones (ARCHITECTURE.md invariant 2)."""
    i = jnp.arange(ids.shape[0])
    earlier = (ids[None, :] == ids[:, None]) & keep[None, :] & (i[None, :] < i[:, None])
    return keep & ~jnp.any(earlier, axis=1)


def concrete_or_none(x) -> np.ndarray | None:
    """``x`` as a NumPy array when its value is known now (not a tracer inside ``jit``), else None.

    References validate data-dependent contracts (snapshot positions) eagerly when they can and
    fall back to poisoning the result with NaN under ``jit``, where raising is impossible.
    """
    if x is None:
        return None
    try:
        return np.asarray(x)
    except Exception:  # jax.errors.TracerArrayConversionError and friends
        return None
