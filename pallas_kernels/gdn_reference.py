"""Gated DeltaNet (GDN): pure-jnp fp32 references, recurrent and chunked.

GDN is KDA with one log-decay per head instead of one per key channel, so both forms are the
delta-rule core of ``kda_reference`` with ``g [T, Hv]`` passed as ``g[..., None]`` and broadcast
over ``d_k`` (the core then uses the cheaper ``[C, C]`` decay matrix, not ``[C, C, d_k]``). The
math, the q/k normalisation and scale conventions, the ragged/snapshot contract and the
error behaviour are documented there once.

Conventions checked against transformers' Qwen3-Next fallbacks (``torch_recurrent_gated_delta_rule``,
``torch_chunk_gated_delta_rule`` with ``use_qk_l2norm_in_kernel=True``) and fla's
``naive_recurrent_gated_delta_rule`` / ``naive_chunk_gated_delta_rule`` (which take q/k already
normalised and have no grouped heads): value head ``h`` reads q/k head ``h // (Hv // Hk)``.
"""

from __future__ import annotations

from pallas_kernels.kda_reference import delta_rule_chunked, delta_rule_recurrent


def _per_head_gate(v, g):
    """``g [T, Hv]`` -> ``[T, Hv, 1]``, the core's broadcast-over-d_k form."""
    if g.shape != v.shape[:2]:
        raise ValueError(f"GDN gate g {g.shape} must be [T, Hv] = {v.shape[:2]}")
    return g[..., None]


def gdn_recurrent(q, k, v, g, beta, *, cu_seqlens, initial_state=None, scale=None, use_qk_l2norm=True,
                  snapshot_seq=None, snapshot_len=None):
    """GDN token by token (``lax.scan``) on a ragged batch; the ground truth for ``gdn_chunked``.

    q, k ``[T, Hk, dk]``; v ``[T, Hv, dv]``; g ``[T, Hv]`` log-decay (<= 0); beta ``[T, Hv]``
    (sigmoided); cu_seqlens int32 ``[N+1]``; initial_state ``[N, Hv, dk, dv]`` or None (zeros);
    snapshot_seq / snapshot_len int32 ``[S]`` or None, any ``0 <= len <= seq_len``. Returns
    ``(o [T, Hv, dv] in v.dtype, final_state [N, Hv, dk, dv] fp32, snapshots [S, Hv, dk, dv] fp32
    or None)``. ``scale`` (default ``dk ** -0.5``) and ``use_qk_l2norm`` are static.
    """
    return delta_rule_recurrent(q, k, v, _per_head_gate(v, g), beta, cu_seqlens=cu_seqlens,
                                initial_state=initial_state, scale=scale, use_qk_l2norm=use_qk_l2norm,
                                snapshot_seq=snapshot_seq, snapshot_len=snapshot_len)


def gdn_chunked(q, k, v, g, beta, *, cu_seqlens, initial_state=None, scale=None, use_qk_l2norm=True,
                snapshot_seq=None, snapshot_len=None, chunk_size=64, start_pos=None, max_chunks=None):
    """GDN in chunked (UT transform / WY) form on a ragged batch; same outputs as ``gdn_recurrent``.

    ``start_pos [N]`` (default 0) is each sequence's absolute position at its first token here;
    chunks are aligned to absolute multiples of ``chunk_size`` (ARCHITECTURE.md invariant 1: chunk ends
    are the radix cache's ×64 snapshot boundaries). Snapshots are available only at lengths 0, the
    whole sequence, or ``(start_pos + len) % chunk_size == 0``: others raise ``ValueError`` when
    concrete and come back NaN under ``jit``. ``max_chunks`` (static) defaults to a bound that fits
    any raggedness.
    """
    return delta_rule_chunked(q, k, v, _per_head_gate(v, g), beta, cu_seqlens=cu_seqlens,
                              initial_state=initial_state, scale=scale, use_qk_l2norm=use_qk_l2norm,
                              snapshot_seq=snapshot_seq, snapshot_len=snapshot_len,
                              chunk_size=chunk_size, start_pos=start_pos, max_chunks=max_chunks)
