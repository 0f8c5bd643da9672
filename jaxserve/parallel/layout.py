"""Shard-major layouts of fused projections, and the ambient shard count.

Some params hold several pieces side by side on one axis: KDA's ``in_proj_qkv`` (and the GDN / KDA
depthwise ``conv_w`` and conv state) is ``[q | k | v]`` along channels, the GDN's ``in_proj``
``[q | k | v | z | b | a]``, the experts' ``gate_up`` and a SwiGLU MLP's ``gate_up_proj``
``[gate | up]``. A contiguous block of such an axis is not a set of whole heads of each piece,
so under tensor parallelism with ``n`` shards they are stored *shard-major* instead:
``[q_0 | k_0 | v_0 | q_1 | k_1 | v_1 | ...]``, where ``q_d`` is shard ``d``'s heads of q
(``shard_major``, at load time). Device ``d`` then holds exactly ``q_d | k_d | v_d``, and the
model cuts the pieces back out with ``split_shards``, which under GSPMD is a local reshape and
slice (no communication).

``shards()`` is the size of the ``"tp"`` axis of the mesh the step is traced under (``jax.set_mesh``;
1 without one), so the model code needs no extra argument and the single-device program is the
one it always was (``n == 1``: plain slices, the layout is the checkpoint's). Inside a
``shard_map`` over ``"tp"`` it is 1 too: the body sees each device's own arrays, which nothing splits
further (the expert-parallel experts, ``layers.expert_parallel``, hold whole intermediates).
"""

from __future__ import annotations

from typing import Sequence

import jax
import numpy as np

AXIS = "tp"


def shards() -> int:
    """Size of the ambient mesh's ``"tp"`` axis while tracing (1 outside any mesh, and where the
    axis is manual: in a ``shard_map`` body, whose arrays are one device's)."""
    mesh = jax.sharding.get_abstract_mesh()
    if AXIS in mesh.manual_axes:
        return 1
    return dict(mesh.shape).get(AXIS, 1)


def split_shards(x: jax.Array, sizes: Sequence[int]) -> tuple[jax.Array, ...]:
    """Cut the last axis of ``x``, laid out shard-major for ``shards()`` shards, into pieces of
    ``sizes`` (their sizes in the unsharded layout), each with its shards back in order."""
    n = shards()
    bounds = np.cumsum([0, *sizes])
    if n == 1:
        return tuple(x[..., a:b] for a, b in zip(bounds[:-1], bounds[1:]))
    lead = x.shape[:-1]
    per = x.reshape(*lead, n, x.shape[-1] // n)
    cut = bounds // n
    return tuple(per[..., a:b].reshape(*lead, (b - a) * n) for a, b in zip(cut[:-1], cut[1:]))


def shard_major(x: np.ndarray, sizes: Sequence[int], n: int, axis: int = -1) -> np.ndarray:
    """Host side of ``split_shards``: reorder ``axis`` of ``x`` (pieces of ``sizes`` in order) into
    the shard-major layout for ``n`` shards. Every size must divide by ``n``."""
    if n == 1:
        return x
    pieces = np.split(x, np.cumsum(sizes)[:-1], axis=axis)
    blocks = [np.split(p, n, axis=axis) for p in pieces]
    return np.concatenate([blocks[i][d] for d in range(n) for i in range(len(sizes))], axis=axis)
