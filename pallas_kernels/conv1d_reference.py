"""Depthwise causal conv1d (the short conv in front of GDN / KDA): pure-jnp fp32 references.

For token ``t`` of a sequence, ``y_t = act(Σ_j weight[:, j] · x_{t-(K-1)+j} + bias)``: weight
column ``K-1`` multiplies the current token, column 0 the oldest (PyTorch ``F.conv1d`` with
``padding=K-1``, groups=C, as transformers' ``causal_conv1d_fn``).

State layout: ``[..., C, K-1]``, the last ``K-1`` inputs of the sequence, oldest first (zeros
before the sequence's first token). transformers (``causal_conv1d_update``, the linear-attention
cache layers) and fla keep ``[..., C, K]``, the last K inputs; their oldest column never reaches
an output (``F.conv1d`` over ``K+1`` columns keeps only the last result), so
``ours = theirs[..., 1:]`` and ``theirs = pad(ours, one zero column on the left)``.

Ragged layout and snapshot requests as in ``pallas_kernels/__init__.py``; here every
``0 <= snapshot_len <= seq_len`` is available (the conv state is a window, not a recurrence).
Compute is fp32; outputs come back in ``x.dtype``, states in fp32.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp

from pallas_kernels import token_segments

ACTIVATIONS = {None: lambda y: y, "silu": jax.nn.silu, "swish": jax.nn.silu}


def _activation(name):
    """The activation function for ``name``; unknown names are an error, not a silent identity."""
    if name not in ACTIVATIONS:
        raise ValueError(f"activation {name!r} not in {sorted(map(str, ACTIVATIONS))}")
    return ACTIVATIONS[name]


def history(x, initial_state, cu_seqlens, seq, length):
    """The ``K-1`` inputs preceding local position ``length`` of ``seq``: ``[Q, C, K-1]``.

    Reads the virtual sequence ``initial_state[seq] ++ x[seq's tokens]``: entry ``m`` is its element
    ``length + m``, taken from ``x`` when that index is past the ``K-1`` state columns. ``seq`` is
    clamped; callers mask results for padding tokens.
    """
    km1 = initial_state.shape[-1]
    seq = jnp.minimum(seq, initial_state.shape[0] - 1)
    e = length[:, None] + jnp.arange(km1)                              # [Q, K-1]
    from_x = x[jnp.clip(cu_seqlens[seq][:, None] + e - km1, 0, x.shape[0] - 1)]  # [Q, K-1, C]
    from_state = initial_state[seq[:, None], :, jnp.clip(e, 0, km1 - 1)]        # [Q, K-1, C]
    return jnp.swapaxes(jnp.where((e >= km1)[..., None], from_x, from_state), 1, 2)


def check_args(x, weight, cu_seqlens, initial_state):
    """The shape contract of ``causal_conv1d_prefill`` (and of its kernel): ValueError if broken."""
    C = x.shape[-1]
    K = weight.shape[-1]
    num_seqs = cu_seqlens.shape[0] - 1
    if x.ndim != 2 or weight.shape != (C, K) or K < 2:
        raise ValueError(f"x {x.shape} / weight {weight.shape} must be [T, C] / [C={C}, K>=2]")
    if initial_state is not None and initial_state.shape != (num_seqs, C, K - 1):
        raise ValueError(f"initial_state {initial_state.shape} != {(num_seqs, C, K - 1)}")


def _conv(window, weight, bias, activation):
    """``window [B, C, K]`` (oldest first) · ``weight [C, K]`` + bias, activated; fp32."""
    y = jnp.sum(window * weight, axis=-1)
    return _activation(activation)(y if bias is None else y + bias)


@partial(jax.jit, static_argnames=("activation",))
def _prefill(x, weight, bias, cu_seqlens, initial_state, snapshot_seq, snapshot_len, *, activation):
    """Every output, final state and snapshot is a window of ``initial_state ++ x`` per sequence:
    one gather each, no scan (the conv has no recurrence beyond its K-1 inputs)."""
    num_seqs = cu_seqlens.shape[0] - 1
    seq, local = token_segments(cu_seqlens, x.shape[0])
    window = jnp.concatenate([history(x, initial_state, cu_seqlens, seq, local), x[:, :, None]], axis=-1)
    y = jnp.where((seq < num_seqs)[:, None], _conv(window, weight, bias, activation), 0.0)
    final = history(x, initial_state, cu_seqlens, jnp.arange(num_seqs), jnp.diff(cu_seqlens))
    snaps = history(x, initial_state, cu_seqlens, snapshot_seq, snapshot_len)
    return y, final, snaps


def causal_conv1d_prefill(x, weight, bias=None, *, cu_seqlens, initial_state=None, activation="silu",
                          snapshot_seq=None, snapshot_len=None):
    """Causal depthwise conv over a ragged batch of sequences, continuing from ``initial_state``.

    x ``[T, C]``; weight ``[C, K]`` (K >= 2); bias ``[C]`` or None; cu_seqlens int32 ``[N+1]``;
    initial_state ``[N, C, K-1]`` (the K-1 inputs before this call, oldest first; None = zeros).
    Returns ``(y [T, C] in x.dtype, final_state [N, C, K-1] fp32, snapshots [S, C, K-1] fp32 or
    None)``; snapshot ``s`` is the state after ``snapshot_len[s]`` tokens of ``snapshot_seq[s]``
    (``0 <= len <= seq_len``; out-of-range requests are clamped, not checked). Padding tokens
    (index ``>= cu_seqlens[-1]``) give ``y = 0``. ``activation`` ("silu" or None) is static.
    """
    check_args(x, weight, cu_seqlens, initial_state)
    C, K = weight.shape
    num_seqs = cu_seqlens.shape[0] - 1
    f32 = partial(jnp.asarray, dtype=jnp.float32)
    init = jnp.zeros((num_seqs, C, K - 1), jnp.float32) if initial_state is None else f32(initial_state)
    snap_seq, snap_len = (jnp.zeros((0,), jnp.int32),) * 2 if snapshot_seq is None else (snapshot_seq, snapshot_len)
    y, final, snaps = _prefill(f32(x), f32(weight), None if bias is None else f32(bias),
                               jnp.asarray(cu_seqlens, jnp.int32), init, jnp.asarray(snap_seq, jnp.int32),
                               jnp.asarray(snap_len, jnp.int32), activation=activation)
    return y.astype(x.dtype), final, (None if snapshot_seq is None else snaps)


@partial(jax.jit, static_argnames=("activation",))
def causal_conv1d_update(x, state, weight, bias=None, activation="silu"):
    """One decode token per sequence: x ``[B, C]``, state ``[B, C, K-1]`` -> (y ``[B, C]``, new state).

    ``new_state`` is the state shifted by one with ``x`` appended (fp32); ``y`` (in ``x.dtype``)
    equals what ``causal_conv1d_prefill`` gives for a one-token sequence with that initial state.
    ``activation`` is static.
    """
    window = jnp.concatenate([state.astype(jnp.float32), x.astype(jnp.float32)[:, :, None]], axis=-1)
    bias = None if bias is None else bias.astype(jnp.float32)
    y = _conv(window, weight.astype(jnp.float32), bias, activation)
    return y.astype(x.dtype), window[:, :, 1:]
