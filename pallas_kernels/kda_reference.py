"""Kimi Delta Attention (KDA), and the delta-rule core it shares with GDN: pure-jnp fp32 references.

Per value head (state ``S`` is ``[d_k, d_v]``, fp32), token by token::

    S   = Diag(exp(g_t)) S                      # the gate decays the state FIRST ...
    S   = S + k_t (beta_t (v_t - Sᵀ k_t))ᵀ      # ... and the delta rule reads the decayed state
    o_t = Sᵀ q_t                                # the output reads the updated state

``q``, ``k`` are upcast to fp32, then (``use_qk_l2norm``) L2-normalised as ``x * rsqrt(sum(x²) +
1e-6)`` (eps inside the root, fla's ``l2norm``; not ``F.normalize``'s ``max(norm, eps)``), then ``q``
is multiplied by ``scale`` (default ``d_k ** -0.5``): normalise first, scale second. KDA has a
per-channel log-decay ``g_t ∈ R^{d_k}`` per value head; GDN (``gdn_reference``) is the special case
of one scalar per head, which the core takes as ``g[..., 1]`` and broadcasts over ``d_k``.
Grouped heads: ``Hv % Hk == 0`` and value head ``h`` reads q/k head ``h // (Hv // Hk)``
(``repeat_interleave``, as in fla's ``naive_*_kda`` and transformers' Qwen3-Next GatedDeltaNet;
Kimi-Linear itself has ``Hk == Hv``).

Contract shared by every function here (ragged layout: see ``pallas_kernels/__init__.py``):

* q, k ``[T, Hk, dk]``, v ``[T, Hv, dv]``, beta ``[T, Hv]`` (already sigmoided), any float dtype;
  all math is fp32 at ``Precision.HIGHEST`` (no TF32 on GPU) and ``o`` comes back in ``v.dtype``.
* ``g <= 0`` (log-decay). The chunked form exponentiates only non-positive cumulative-gate
  differences, so it never overflows; with ``g > 0`` neither form is meaningful.
* States are ``[N, Hv, dk, dv]`` fp32, ``initial_state=None`` means zeros.
* Snapshots ``[S, Hv, dk, dv]``: the state of ``snapshot_seq[s]`` after ``snapshot_len[s]`` of its
  tokens in this call. An invalid request (length out of range; in the chunked form a length that
  is not a chunk boundary) raises ``ValueError`` when the indices are concrete, and yields NaN
  under ``jit``, so it can never pass silently (ARCHITECTURE.md invariant 1).

The recurrent form is one ``lax.scan`` over tokens; the chunked form lays the ragged tokens out on
a grid of chunks aligned to ABSOLUTE positions (``start_pos``), does the intra-chunk UT-transform
work batched over all chunks, then one ``lax.scan`` over chunks. Neither loops over sequences in
Python: one compiled function handles every raggedness with the same ``T``.
"""

from __future__ import annotations

from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from pallas_kernels import concrete_or_none, token_segments

L2NORM_EPS = 1e-6


def _mm(spec: str, *operands: jnp.ndarray, precision=lax.Precision.HIGHEST) -> jnp.ndarray:
    """fp32 einsum at full precision: the reference must not silently drop to TF32 on GPU.
    (``precision=None``: the configured default, for the kernel path's opt-in faster prep.)"""
    return jnp.einsum(spec, *operands, precision=precision)


def l2norm(x: jnp.ndarray, eps: float = L2NORM_EPS) -> jnp.ndarray:
    """``x * rsqrt(sum(x²) + eps)`` over the last axis: fla's l2norm (eps inside the root)."""
    return x * lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


def _prepare(q, k, v, g, beta, scale, use_qk_l2norm):
    """Upcast to fp32, normalise q/k then scale q, and expand q/k to the value heads."""
    q, k, v, g, beta = (x.astype(jnp.float32) for x in (q, k, v, g, beta))
    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    q = q * (q.shape[-1] ** -0.5 if scale is None else scale)
    group = v.shape[1] // k.shape[1]
    return jnp.repeat(q, group, axis=1), jnp.repeat(k, group, axis=1), v, g, beta


def _snapshot_valid(cu_seqlens, snapshot_seq, snapshot_len, start_pos, chunk_size, xp=jnp):
    """bool ``[S]``: the request names a real sequence and a length the form can produce.

    Recurrent form (``chunk_size=None``): any ``0 <= len <= seq_len``. Chunked form: additionally
    ``len`` is 0, the whole sequence, or ends on an absolute chunk boundary
    (``(start_pos + len) % chunk_size == 0``), the only states the chunk scan materialises.
    ``xp`` is ``jnp`` under ``jit`` and ``np`` for the eager check.
    """
    num_seqs = cu_seqlens.shape[0] - 1
    lens = xp.diff(cu_seqlens)
    seq = xp.clip(snapshot_seq, 0, num_seqs - 1)
    seq_len = lens[seq]
    ok = (snapshot_seq >= 0) & (snapshot_seq < num_seqs) & (snapshot_len >= 0) & (snapshot_len <= seq_len)
    if chunk_size is not None:
        on_boundary = (start_pos[seq] + snapshot_len) % chunk_size == 0
        ok &= (snapshot_len == 0) | (snapshot_len == seq_len) | on_boundary
    return ok


def _check_args(q, k, v, g, beta, cu_seqlens, initial_state, snapshot_seq, snapshot_len):
    """Static shape contract; raises ValueError with the offending shapes."""
    T, Hk, dk = q.shape
    _, Hv, dv = v.shape
    num_seqs = cu_seqlens.shape[0] - 1
    problems = []
    if k.shape != q.shape:
        problems.append(f"k {k.shape} != q {q.shape}")
    if v.shape[0] != T or Hv % Hk:
        problems.append(f"v {v.shape} must be [T={T}, Hv, dv] with Hv % Hk == 0 (Hk={Hk})")
    if g.shape not in ((T, Hv, dk), (T, Hv, 1)):
        problems.append(f"g {g.shape} must be [T, Hv, dk] or [T, Hv, 1] = {(T, Hv, dk)} / {(T, Hv, 1)}")
    if beta.shape != (T, Hv):
        problems.append(f"beta {beta.shape} != {(T, Hv)}")
    if cu_seqlens.ndim != 1 or num_seqs < 1:
        problems.append(f"cu_seqlens {cu_seqlens.shape} must be [N+1] with N >= 1")
    if initial_state is not None and initial_state.shape != (num_seqs, Hv, dk, dv):
        problems.append(f"initial_state {initial_state.shape} != {(num_seqs, Hv, dk, dv)}")
    if (snapshot_seq is None) != (snapshot_len is None):
        problems.append("snapshot_seq and snapshot_len go together")
    elif snapshot_seq is not None and (snapshot_seq.ndim != 1 or snapshot_seq.shape != snapshot_len.shape):
        problems.append(f"snapshot_seq {snapshot_seq.shape} / snapshot_len {snapshot_len.shape} must be [S]")
    if problems:
        raise ValueError("delta rule: " + "; ".join(problems))


def _check_snapshots_eagerly(cu_seqlens, snapshot_seq, snapshot_len, start_pos, chunk_size):
    """Raise on invalid snapshot requests when their values are known (outside ``jit``)."""
    if snapshot_seq is None:
        return
    values = [concrete_or_none(x) for x in (cu_seqlens, snapshot_seq, snapshot_len)]
    pos = None if start_pos is None else concrete_or_none(start_pos)
    if any(x is None for x in values) or (start_pos is not None and pos is None):
        return
    cu, seq, length = (x.astype(np.int64) for x in values)
    bad = ~_snapshot_valid(cu, seq, length, None if pos is None else pos.astype(np.int64), chunk_size, xp=np)
    if bad.any():
        where = "" if chunk_size is None else f" on a {chunk_size}-token boundary (start_pos + len)"
        pairs = [(int(s), int(n)) for s, n in zip(seq[bad], length[bad])]
        raise ValueError(
            f"snapshot (seq, len) {pairs} not available: len must be 0, the sequence length, or{where} "
            f"within the sequence; seq lens {np.diff(cu).tolist()}"
        )


def _with_defaults(q, v, cu_seqlens, initial_state, snapshot_seq, snapshot_len, start_pos):
    """int32 indices, zero initial state, zero start positions, an empty snapshot list if none."""
    num_seqs = cu_seqlens.shape[0] - 1
    state_shape = (num_seqs, v.shape[1], q.shape[-1], v.shape[-1])
    initial_state = jnp.zeros(state_shape, jnp.float32) if initial_state is None else initial_state
    start_pos = jnp.zeros((num_seqs,), jnp.int32) if start_pos is None else start_pos
    if snapshot_seq is None:
        snapshot_seq = snapshot_len = jnp.zeros((0,), jnp.int32)
    ints = (jnp.asarray(x, jnp.int32) for x in (cu_seqlens, snapshot_seq, snapshot_len, start_pos))
    return (*ints, initial_state.astype(jnp.float32))


# --------------------------------------------------------------------------------------------
# Recurrent form: one lax.scan over tokens.
# --------------------------------------------------------------------------------------------


def _delta_step(S, q, k, v, g, beta):
    """One token, all heads: S ``[H, dk, dv]``, q/k ``[H, dk]``, v ``[H, dv]``, g ``[H, dk|1]``."""
    S = jnp.exp(g)[..., None] * S
    delta = beta[:, None] * (v - _mm("hk,hkv->hv", k, S))
    S = S + k[..., None] * delta[:, None, :]
    return S, _mm("hk,hkv->hv", q, S)


@partial(jax.jit, static_argnames=("scale", "use_qk_l2norm"))
def _recurrent(q, k, v, g, beta, cu_seqlens, initial_state, snapshot_seq, snapshot_len,
               *, scale, use_qk_l2norm):
    """Scan carrying (current state, final states, snapshots). The state is reset to the
    sequence's initial state at its first token; padding tokens change nothing and output 0."""
    q, k, v, g, beta = _prepare(q, k, v, g, beta, scale, use_qk_l2norm)
    num_seqs = cu_seqlens.shape[0] - 1
    seq, local = token_segments(cu_seqlens, v.shape[0])
    real = seq < num_seqs
    # hits[t, s]: token t is the snapshot_len[s]-th token of snapshot_seq[s].
    hits = (snapshot_seq[None, :] == seq[:, None]) & (snapshot_len[None, :] == local[:, None] + 1)

    def step(carry, xs):
        S, final, snaps = carry
        q_t, k_t, v_t, g_t, b_t, seq_t, local_t, real_t, hit_t = xs
        S = jnp.where(real_t & (local_t == 0), initial_state[jnp.minimum(seq_t, num_seqs - 1)], S)
        S_new, o_t = _delta_step(S, q_t, k_t, v_t, g_t, b_t)
        S = jnp.where(real_t, S_new, S)
        final = final.at[seq_t].set(S, mode="drop")
        snaps = jnp.where(hit_t[:, None, None, None], S, snaps)
        return (S, final, snaps), jnp.where(real_t, o_t, 0.0)

    snaps = initial_state[jnp.clip(snapshot_seq, 0, num_seqs - 1)]  # snapshot_len == 0 keeps this
    carry = (initial_state[0], initial_state, snaps)
    (_, final, snaps), o = lax.scan(step, carry, (q, k, v, g, beta, seq, local, real, hits))
    valid = _snapshot_valid(cu_seqlens, snapshot_seq, snapshot_len, None, None)
    return o, final, jnp.where(valid[:, None, None, None], snaps, jnp.nan)


# --------------------------------------------------------------------------------------------
# Chunked form: ragged tokens on an absolute-aligned chunk grid, UT transform, scan over chunks.
# --------------------------------------------------------------------------------------------


class ChunkLayout(NamedTuple):
    """Where the ragged tokens sit on a ``[max_chunks, chunk_size]`` grid.

    Sequence ``n`` covers absolute positions ``start_pos[n] + [0, len_n)``; its chunks are the
    absolute ``chunk_size``-aligned windows those positions touch, so its first chunk starts
    ``offset[n] = start_pos[n] % chunk_size`` slots in and its chunk ends are exactly the ×64
    boundaries the radix cache snapshots at. Slots no token maps to are zero padding (g=0, beta=0,
    k=q=v=0), which leaves the state untouched. Unused trailing chunks have ``chunk_seq == N``.
    """

    token_slot: jnp.ndarray   # [T] flat grid index of each token; unique, out of range (dropped) for padding
    chunk_seq: jnp.ndarray    # [M] sequence owning each chunk, N if unused
    chunk_first: jnp.ndarray  # [M] chunk is its sequence's first: the scan resets the state there
    first_chunk: jnp.ndarray  # [N] index of each sequence's first chunk
    num_chunks: jnp.ndarray   # [N] chunks per sequence (0 for an empty sequence)
    offset: jnp.ndarray       # [N] start_pos % chunk_size


def default_max_chunks(num_tokens: int, num_seqs: int, chunk_size: int) -> int:
    """Static bound on the chunks any raggedness can need: each sequence adds at most 2 partial ones."""
    return num_tokens // chunk_size + 2 * num_seqs


def chunk_layout(cu_seqlens, start_pos, num_tokens: int, chunk_size: int, max_chunks: int) -> ChunkLayout:
    """Build the chunk grid layout from ``cu_seqlens`` and ``start_pos`` with jnp ops only."""
    num_seqs = cu_seqlens.shape[0] - 1
    lens = jnp.diff(cu_seqlens)
    offset = start_pos % chunk_size
    num_chunks = jnp.where(lens > 0, (offset + lens + chunk_size - 1) // chunk_size, 0)
    chunk_end = jnp.cumsum(num_chunks)
    first_chunk = chunk_end - num_chunks
    seq, local = token_segments(cu_seqlens, num_tokens)
    s = jnp.minimum(seq, num_seqs - 1)
    # padding tokens: distinct slots past the grid (dropped by _to_grid, zeros from _from_grid), so the
    # slots are unique and _to_grid's scatter can say so
    padding_slot = max_chunks * chunk_size + jnp.arange(num_tokens, dtype=jnp.int32)
    token_slot = jnp.where(seq < num_seqs, first_chunk[s] * chunk_size + offset[s] + local, padding_slot)
    chunks = jnp.arange(max_chunks, dtype=jnp.int32)
    chunk_seq = jnp.searchsorted(chunk_end, chunks, side="right").astype(jnp.int32)
    chunk_first = (chunk_seq < num_seqs) & (chunks == first_chunk[jnp.minimum(chunk_seq, num_seqs - 1)])
    return ChunkLayout(token_slot, chunk_seq, chunk_first, first_chunk, num_chunks, offset)


def _to_grid(x, layout: ChunkLayout, max_chunks: int, chunk_size: int):
    """``[T, H, d]`` tokens -> ``[M, H, C, d]`` chunks, zeros where no token sits.

    The slots are unique (``chunk_layout``) and the scatter says so: without ``unique_indices``
    XLA's GPU scatter writes every element with an atomic (a compare-and-swap loop for 16-bit
    types), where unique slots are plain stores."""
    grid = jnp.zeros((max_chunks * chunk_size, *x.shape[1:]), x.dtype)
    grid = grid.at[layout.token_slot].set(x, mode="drop", unique_indices=True)
    return jnp.moveaxis(grid.reshape(max_chunks, chunk_size, *x.shape[1:]), 1, 2)


def _from_grid(grid, layout: ChunkLayout):
    """``[M, H, C, d]`` chunks -> ``[T, H, d]`` tokens, zeros for padding tokens."""
    flat = jnp.moveaxis(grid, 2, 1).reshape(-1, *grid.shape[1:2], grid.shape[-1])
    return jnp.take(flat, layout.token_slot, axis=0, mode="fill", fill_value=0)


def _decayed_scores(a, b, G, *, inclusive: bool, precision=lax.Precision.HIGHEST):
    """``out[i, j] = Σ_d a_i[d] b_j[d] exp(G_i[d] - G_j[d])`` for ``j < i`` (``j <= i`` if inclusive).

    ``G`` is the within-chunk cumulative log-decay, ``[..., C, dk]`` (KDA) or ``[..., C, 1]``
    (GDN). Masked entries get exponent ``-inf`` before ``exp``, so only non-positive differences
    are ever exponentiated (no overflow, no ``inf * 0``).
    """
    C = a.shape[-2]
    mask = jnp.tril(jnp.ones((C, C), bool), 0 if inclusive else -1)
    diff = G[..., :, None, :] - G[..., None, :, :]
    decay = jnp.exp(jnp.where(mask[..., None], diff, -jnp.inf))
    if G.shape[-1] == 1:
        return _mm("...id,...jd->...ij", a, b, precision=precision) * decay[..., 0]
    return jnp.sum(a[..., :, None, :] * b[..., None, :, :] * decay, axis=-1)  # exact fp32, no matmul unit


def _unit_lower_solve(A, rhs, precision=lax.Precision.HIGHEST):
    """``(I + A)^-1 rhs`` for strictly lower ``A [..., C, C]`` by forward substitution over the C rows.

    The same recurrence as fla's / transformers' naive chunk forms. Not ``lax.linalg.triangular_solve``:
    XLA:CPU's batched triangular solve is erratically slow for some right-hand-side widths
    (~0.5 s instead of ~1 ms for 68 systems of 64 rows with 16 columns).
    """
    def row(i, x):
        a_i = lax.dynamic_index_in_dim(A, i, axis=-2, keepdims=False)
        r_i = lax.dynamic_index_in_dim(rhs, i, axis=-2, keepdims=False)
        x_i = r_i - _mm("...j,...jw->...w", a_i, x, precision=precision)  # rows >= i of x are still zero
        return lax.dynamic_update_index_in_dim(x, x_i, i, axis=-2)

    return lax.fori_loop(0, A.shape[-1], row, jnp.zeros_like(rhs))


class ChunkTerms(NamedTuple):
    """Per-chunk quantities that do not depend on the incoming state (all ``[M, H, C, ...]``)."""

    u: jnp.ndarray          # [.., C, dv] UT-transformed values  T (beta v)
    w: jnp.ndarray          # [.., C, dk] UT-transformed decayed keys  T (beta k exp(G))
    qk: jnp.ndarray         # [.., C, C] causal decayed q·k scores (diagonal included)
    q_decayed: jnp.ndarray  # [.., C, dk] q exp(G): reads the incoming state
    k_decayed: jnp.ndarray  # [.., C, dk] k exp(G_last - G): writes the outgoing state
    decay_last: jnp.ndarray  # [.., dk|1] exp(G_last): total decay over the chunk


def _chunk_terms(q, k, v, g, beta) -> ChunkTerms:
    """Intra-chunk UT transform, batched over every chunk and head.

    With ``A[i, j] = beta_i Σ_d k_i k_j exp(G_i - G_j)`` (strictly lower) and ``T = (I + A)^-1``,
    the chunk's delta-rule updates are ``v_new = u - w S_in`` (fla / transformers' naming:
    ``u`` = value, ``w`` = k_cumdecay).
    """
    G = jnp.cumsum(g, axis=-2)
    A = beta[..., :, None] * _decayed_scores(k, k, G, inclusive=False)
    dv = v.shape[-1]
    uw = _unit_lower_solve(A, jnp.concatenate([beta[..., None] * v, beta[..., None] * k * jnp.exp(G)], axis=-1))
    G_last = G[..., -1:, :]
    return ChunkTerms(
        u=uw[..., :dv],
        w=uw[..., dv:],
        qk=_decayed_scores(q, k, G, inclusive=True),
        q_decayed=q * jnp.exp(G),
        k_decayed=k * jnp.exp(G_last - G),
        decay_last=jnp.exp(G_last[..., 0, :]),
    )


def _chunk_step(S, terms: ChunkTerms):
    """Advance one chunk, all heads: ``S`` ``[H, dk, dv]`` in, (output, state at chunk end) out."""
    v_new = terms.u - _mm("hck,hkv->hcv", terms.w, S)
    o = _mm("hck,hkv->hcv", terms.q_decayed, S) + _mm("hij,hjv->hiv", terms.qk, v_new)
    S = terms.decay_last[..., None] * S + _mm("hck,hcv->hkv", terms.k_decayed, v_new)
    return S, o


@partial(jax.jit, static_argnames=("scale", "use_qk_l2norm", "chunk_size", "max_chunks"))
def _chunked(q, k, v, g, beta, cu_seqlens, initial_state, snapshot_seq, snapshot_len, start_pos,
             *, scale, use_qk_l2norm, chunk_size, max_chunks):
    """Grid the tokens, compute chunk terms for all chunks at once, scan chunks with a reset at
    each sequence's first chunk; read finals and snapshots off the per-chunk end states."""
    q, k, v, g, beta = _prepare(q, k, v, g, beta, scale, use_qk_l2norm)
    num_seqs = cu_seqlens.shape[0] - 1
    layout = chunk_layout(cu_seqlens, start_pos, v.shape[0], chunk_size, max_chunks)
    grid = partial(_to_grid, layout=layout, max_chunks=max_chunks, chunk_size=chunk_size)
    terms = _chunk_terms(grid(q), grid(k), grid(v), grid(g), grid(beta[..., None])[..., 0])

    def step(S, xs):
        first, seq, chunk = xs
        S = jnp.where(first, initial_state[jnp.minimum(seq, num_seqs - 1)], S)
        S, o = _chunk_step(S, chunk)
        return S, (o, S)

    _, (o, chunk_states) = lax.scan(step, initial_state[0], (layout.chunk_first, layout.chunk_seq, terms))

    def state_after(seq, length):
        """State of ``seq`` after ``length`` tokens, read at the end of the chunk holding its last one."""
        chunk = layout.first_chunk[seq] + (layout.offset[seq] + length - 1) // chunk_size
        at_end = chunk_states[jnp.clip(chunk, 0, max_chunks - 1)]
        return jnp.where((length > 0)[:, None, None, None], at_end, initial_state[seq])

    final = state_after(jnp.arange(num_seqs), jnp.diff(cu_seqlens))
    snap_seq = jnp.clip(snapshot_seq, 0, num_seqs - 1)
    snaps = state_after(snap_seq, snapshot_len)
    valid = _snapshot_valid(cu_seqlens, snapshot_seq, snapshot_len, start_pos, chunk_size)
    return _from_grid(o, layout), final, jnp.where(valid[:, None, None, None], snaps, jnp.nan)


# --------------------------------------------------------------------------------------------
# Public API.
# --------------------------------------------------------------------------------------------


def delta_rule_recurrent(q, k, v, g, beta, *, cu_seqlens, initial_state=None, scale=None,
                         use_qk_l2norm=True, snapshot_seq=None, snapshot_len=None):
    """Gated delta rule, token by token (``lax.scan``), on a ragged batch.

    ``g`` is ``[T, Hv, dk]`` (per-channel, KDA) or ``[T, Hv, 1]`` (per-head, GDN). Returns
    ``(o [T, Hv, dv] in v.dtype, final_state [N, Hv, dk, dv] fp32, snapshots [S, Hv, dk, dv] fp32
    or None)``. Any ``0 <= snapshot_len <= seq_len`` is available. ``scale`` and
    ``use_qk_l2norm`` are static. This is the ground truth the chunked form is tested against.
    """
    _check_args(q, k, v, g, beta, cu_seqlens, initial_state, snapshot_seq, snapshot_len)
    _check_snapshots_eagerly(cu_seqlens, snapshot_seq, snapshot_len, None, None)
    args = _with_defaults(q, v, cu_seqlens, initial_state, snapshot_seq, snapshot_len, None)
    cu, snap_seq, snap_len, _, init = args
    o, final, snaps = _recurrent(q, k, v, g, beta, cu, init, snap_seq, snap_len,
                                 scale=scale, use_qk_l2norm=use_qk_l2norm)
    return o.astype(v.dtype), final, (None if snapshot_seq is None else snaps)


def prepare_chunked_args(q, k, v, g, beta, cu_seqlens, initial_state, snapshot_seq, snapshot_len, start_pos,
                         chunk_size, max_chunks):
    """The chunked forms' shared argument handling (the reference's and the Pallas kernel's): shape
    checks, defaults, snapshot lengths checked when concrete, the grid bound. Returns
    ``(cu, snap_seq, snap_len, start, init, max_chunks)``."""
    _check_args(q, k, v, g, beta, cu_seqlens, initial_state, snapshot_seq, snapshot_len)
    num_seqs = cu_seqlens.shape[0] - 1
    if start_pos is not None and start_pos.shape != (num_seqs,):
        raise ValueError(f"start_pos {start_pos.shape} != {(num_seqs,)}")
    cu, snap_seq, snap_len, start, init = _with_defaults(
        q, v, cu_seqlens, initial_state, snapshot_seq, snapshot_len, start_pos)
    _check_snapshots_eagerly(cu_seqlens, snapshot_seq, snapshot_len, start, chunk_size)
    if max_chunks is None:
        max_chunks = default_max_chunks(v.shape[0], num_seqs, chunk_size)
    return cu, snap_seq, snap_len, start, init, max_chunks


def delta_rule_chunked(q, k, v, g, beta, *, cu_seqlens, initial_state=None, scale=None,
                       use_qk_l2norm=True, snapshot_seq=None, snapshot_len=None, chunk_size=64,
                       start_pos=None, max_chunks=None):
    """Gated delta rule in chunked (UT transform / WY) form, on a ragged batch.

    Same inputs and outputs as ``delta_rule_recurrent`` plus: ``start_pos [N]`` int32 (default 0),
    the absolute position of each sequence's first token in this call (``initial_state`` is the
    state there). Chunks are aligned to absolute multiples of ``chunk_size``, so a sequence
    resumed at a non-aligned position has a short first chunk and every later chunk boundary is
    a ×``chunk_size`` boundary. Snapshots exist only at lengths 0, the whole sequence, or
    ``(start_pos + len) % chunk_size == 0``. ``max_chunks`` (static) bounds the grid; the default
    ``T // chunk_size + 2 N`` fits any raggedness (a smaller value must still fit, or tokens are
    dropped). ``scale``, ``use_qk_l2norm``, ``chunk_size``, ``max_chunks`` are static.
    """
    cu, snap_seq, snap_len, start, init, max_chunks = prepare_chunked_args(
        q, k, v, g, beta, cu_seqlens, initial_state, snapshot_seq, snapshot_len, start_pos, chunk_size, max_chunks)
    o, final, snaps = _chunked(q, k, v, g, beta, cu, init, snap_seq, snap_len, start,
                               scale=scale, use_qk_l2norm=use_qk_l2norm, chunk_size=chunk_size,
                               max_chunks=max_chunks)
    return o.astype(v.dtype), final, (None if snapshot_seq is None else snaps)


def _check_kda_gate(q, v, g):
    """KDA's gate is per channel; a ``[T, Hv]`` (GDN) gate here is a caller bug, not a broadcast."""
    if g.shape != (*v.shape[:2], q.shape[-1]):
        raise ValueError(f"KDA gate g {g.shape} must be [T, Hv, dk] = {(*v.shape[:2], q.shape[-1])}")


def kda_recurrent(q, k, v, g, beta, *, cu_seqlens, initial_state=None, scale=None, use_qk_l2norm=True,
                  snapshot_seq=None, snapshot_len=None):
    """KDA, token by token: ``delta_rule_recurrent`` with a per-channel gate ``g [T, Hv, dk]``.

    Matches fla's ``naive_recurrent_kda`` (which takes q/k already normalised) and
    transformers' Kimi-Linear ``recurrent_kimi_delta_attention`` (``use_qk_l2norm_in_kernel=True``).
    """
    _check_kda_gate(q, v, g)
    return delta_rule_recurrent(q, k, v, g, beta, cu_seqlens=cu_seqlens, initial_state=initial_state,
                                scale=scale, use_qk_l2norm=use_qk_l2norm, snapshot_seq=snapshot_seq,
                                snapshot_len=snapshot_len)


def kda_chunked(q, k, v, g, beta, *, cu_seqlens, initial_state=None, scale=None, use_qk_l2norm=True,
                snapshot_seq=None, snapshot_len=None, chunk_size=64, start_pos=None, max_chunks=None):
    """KDA in chunked form: ``delta_rule_chunked`` with a per-channel gate ``g [T, Hv, dk]``.

    Matches fla's ``naive_chunk_kda`` and transformers' ``chunk_kimi_delta_attention``, but its
    chunks are aligned to absolute positions (``start_pos``) so chunk ends are cache boundaries.
    """
    _check_kda_gate(q, v, g)
    return delta_rule_chunked(q, k, v, g, beta, cu_seqlens=cu_seqlens, initial_state=initial_state,
                              scale=scale, use_qk_l2norm=use_qk_l2norm, snapshot_seq=snapshot_seq,
                              snapshot_len=snapshot_len, chunk_size=chunk_size, start_pos=start_pos,
                              max_chunks=max_chunks)
