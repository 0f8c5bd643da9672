"""The device pools: paged KV for attention layers and a linear-state slot pool for GDN layers.

``Pools`` (``k``, ``v``, ``conv``, ``rec``; defined beside the model in ``jaxserve.models.decoder``)
is one pytree threaded through every jitted step and donated, so the step updates it in place:

- ``k``, ``v``: [n_attn_layers, num_pages, page_size, kv_heads, head_dim], model dtype.
- ``conv``: [n_linear_layers, num_slots, conv_dim, K-1], model dtype; ``rec``: [n_linear_layers,
  num_slots, Hv, dk, dv], fp32 (the recurrence accumulates; bf16 would drift over long prompts).

Index 0 of each is NULL (``NULL_PAGE``, ``NULL_SLOT``): padding tokens, padding rows and padding
snapshot entries write there, the host allocators never hand it out, and nothing reads it
unmasked. So a step never needs a branch for padding and no padding write can land in a page or
slot that some request or the radix tree owns (ARCHITECTURE.md invariant 7 stays a host-side count).

``64 % page_size == 0`` (ARCHITECTURE.md invariant 1): KV page boundaries then fall on every ×64 snapshot
boundary, so a radix-tree node's pages and its state snapshot describe the same prefix.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from jaxserve.config import ModelConfig
from jaxserve.models.decoder import Pools, num_layers_of_kind, pool_shapes, zeros
from jaxserve.models.layers import KEY_BLOCK

__all__ = ["NULL_PAGE", "NULL_SLOT", "PoolPlan", "Pools", "allocate", "init_pools", "plan_pools", "device_budget",
           "minimal_pool_bytes"]

NULL_PAGE = 0
NULL_SLOT = 0
MiB = 1 << 20


def _nbytes(s: jax.ShapeDtypeStruct) -> int:
    return int(np.prod(s.shape)) * np.dtype(s.dtype).itemsize


def page_bytes(cfg: ModelConfig, dtype, page_size: int) -> int:
    """Bytes of one KV page across every attention layer (k and v)."""
    shapes = pool_shapes(cfg, dtype, (1, page_size), 1)
    return _nbytes(shapes.k) + _nbytes(shapes.v)


def slot_bytes(cfg: ModelConfig, dtype) -> int:
    """Bytes of one linear-state slot across every GDN layer (conv and rec); 0 for plain attention."""
    shapes = pool_shapes(cfg, dtype, (1, 1), 1)
    return _nbytes(shapes.conv) + _nbytes(shapes.rec)


@dataclasses.dataclass(frozen=True)
class PoolPlan:
    """Pool sizes. Counts include the null entry: ``num_pages - 1`` pages and ``num_slots - 1``
    slots are allocatable. ``num_slots`` is 0 for a plain-attention model (no slot pool)."""

    page_size: int
    num_pages: int
    num_slots: int
    page_bytes: int  # one page, all attention layers
    slot_bytes: int  # one slot, all GDN layers

    @property
    def kv_bytes(self) -> int:
        return self.num_pages * self.page_bytes

    @property
    def state_bytes(self) -> int:
        return self.num_slots * self.slot_bytes

    @property
    def total_bytes(self) -> int:
        return self.kv_bytes + self.state_bytes

    def describe(self) -> str:
        kv = f"KV {self.num_pages - 1} pages x {self.page_size} tokens ({self.kv_bytes / MiB:.1f} MiB)"
        if not self.num_slots:
            return kv
        return f"{kv}, linear state {self.num_slots - 1} slots ({self.state_bytes / MiB:.1f} MiB)"


def _minimum(cfg: ModelConfig, max_seqs: int, page_size: int, min_kv_tokens: int) -> tuple[int, int]:
    """(pages, slots) the engine cannot run with less of, null entries included: a slot per running
    request (hybrid models), a page per running request plus ``min_kv_tokens`` tokens of KV."""
    hybrid = num_layers_of_kind(cfg)[1] > 0
    return 1 + max_seqs + -(-min_kv_tokens // page_size), (1 + max_seqs if hybrid else 0)


def minimal_pool_bytes(cfg: ModelConfig, dtype, *, page_size: int, max_seqs: int, min_kv_tokens: int = 0) -> int:
    """Bytes of the smallest pools ``plan_pools`` accepts for these limits (see ``_minimum``)."""
    pages, slots = _minimum(cfg, max_seqs, page_size, min_kv_tokens)
    return pages * page_bytes(cfg, dtype, page_size) + slots * slot_bytes(cfg, dtype)


def plan_pools(cfg: ModelConfig, dtype, *, page_size: int, max_seqs: int, mem_bytes: int | None = None,
               param_bytes: int = 0, reserve_bytes: int = 0, num_pages: int | None = None,
               num_slots: int | None = None, snapshot_fraction: float = 0.25, min_kv_tokens: int = 0) -> PoolPlan:
    """Size the pools from explicit counts or from a memory budget.

    Budget split (when neither ``num_pages`` nor ``num_slots`` is given; when one is, the other takes
    the rest of the budget): ``avail = mem_bytes - param_bytes - reserve_bytes``. ``reserve_bytes``
    is what a step needs beside params and pools: the XLA temporaries (activations, workspace) of
    the largest compiled step plus a margin, measured at start-up (jaxserve/engine/startup.py).
    Slots come first because every running request needs one: the null slot + ``max_seqs`` live
    slots, plus ``snapshot_fraction`` of what is left after those and a minimal KV (the null page +
    one page per running request + ``min_kv_tokens`` tokens, e.g. one full prefill step) as the
    radix tree's snapshot slots. Everything else is KV pages. Plain-attention models have no slot
    pool; the whole budget is KV.

    Why this split: a running request cannot make progress without its slot, so those are never
    traded away; snapshots are what make a hybrid model's prefix hits possible at all (ARCHITECTURE.md
    invariant 4) and they are large (one slot ≈ many KV pages), so they get an explicit, tunable
    share instead of whatever KV leaves over.

    Raises ``ValueError`` naming what does not fit: ``64 % page_size != 0``, a budget smaller than
    the params plus the minimal pools, or explicit counts below the minimum.
    """
    if page_size < 1 or KEY_BLOCK % page_size:
        raise ValueError(f"page_size {page_size} must divide {KEY_BLOCK} "
                         "(×64 snapshot boundaries must be page boundaries)")
    if max_seqs < 1:
        raise ValueError(f"max_seqs must be >= 1, got {max_seqs}")
    if not 0 <= snapshot_fraction < 1:
        raise ValueError(f"snapshot_fraction must be in [0, 1), got {snapshot_fraction}")
    pb, sb = page_bytes(cfg, dtype, page_size), slot_bytes(cfg, dtype)
    hybrid = num_layers_of_kind(cfg)[1] > 0
    min_pages, min_slots = _minimum(cfg, max_seqs, page_size, min_kv_tokens)

    if num_slots is not None and not hybrid:
        num_slots = 0
    if num_pages is None or num_slots is None:
        if mem_bytes is None:
            raise ValueError("give mem_bytes (a memory budget) or both num_pages and num_slots")
        avail = mem_bytes - param_bytes - reserve_bytes
        need = min_pages * pb + min_slots * sb
        if avail < need:
            raise ValueError(
                f"need {(param_bytes + reserve_bytes + need) / MiB:.1f} MiB for params ({param_bytes / MiB:.1f}), "
                f"reserve ({reserve_bytes / MiB:.1f}) and minimal pools ({min_pages} pages + {min_slots} slots for "
                f"max_seqs={max_seqs}{f', {min_kv_tokens} KV tokens' if min_kv_tokens else ''}: {need / MiB:.1f}), "
                f"have {mem_bytes / MiB:.1f} MiB")
        if num_slots is None and not hybrid:
            num_slots = 0
        elif num_slots is None and num_pages is None:
            num_slots = min_slots + int(snapshot_fraction * (avail - need)) // sb
        elif num_slots is None:  # explicit pages: the slots take the rest
            num_slots = max(avail - num_pages * pb, 0) // sb
        if num_pages is None:
            num_pages = (avail - num_slots * sb) // pb
    if num_pages < min_pages or num_slots < min_slots:
        raise ValueError(f"pools too small for max_seqs={max_seqs}: need >= {min_pages} pages and "
                         f">= {min_slots} slots (null entry included), have {num_pages} and {num_slots}")
    plan = PoolPlan(page_size, int(num_pages), int(num_slots), pb, sb)
    if mem_bytes is not None and plan.total_bytes + param_bytes + reserve_bytes > mem_bytes:
        raise ValueError(f"need {(plan.total_bytes + param_bytes + reserve_bytes) / MiB:.1f} MiB for params "
                         f"({param_bytes / MiB:.1f}), reserve ({reserve_bytes / MiB:.1f}) and {plan.describe()}, "
                         f"have {mem_bytes / MiB:.1f} MiB")
    return plan


def init_pools(plan: PoolPlan, cfg: ModelConfig, dtype, shardings: Pools | None = None) -> Pools:
    """Zero-filled pools for ``plan`` on the default device, or split over a mesh (``allocate``)."""
    return allocate(pool_shapes(cfg, dtype, (plan.num_pages, plan.page_size), plan.num_slots), shardings)


def allocate(shapes: Pools, shardings: Pools | None = None) -> Pools:
    """Zero pools of ``shapes``. With ``shardings`` (``jaxserve.parallel.tensor``) each device
    allocates only its own share: no device ever holds a whole pool."""
    if shardings is None:
        return zeros(shapes)
    return jax.jit(lambda: zeros(shapes), out_shardings=shardings)()


def device_budget(mem_fraction: float, device: jax.Device | None = None) -> int:
    """``mem_fraction`` of the device's memory, for ``plan_pools(mem_bytes=...)``; by default this
    process's first device (over several processes ``jax.devices()[0]`` is process 0's, which no
    other process can ask). Raises on a device that does not report its memory (the CPU): give an
    explicit budget there."""
    device = device or jax.local_devices()[0]
    stats = device.memory_stats() or {}
    if "bytes_limit" not in stats:
        raise ValueError(f"{device} does not report its memory; pass an explicit budget in bytes")
    return int(stats["bytes_limit"] * mem_fraction)
