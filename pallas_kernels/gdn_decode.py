"""Fused GDN / KDA decode step into a state pool: Pallas Mosaic GPU kernels (sm_90).

One token per sequence. Row ``b`` of the batch reads its recurrent state from
``state_pool[slots[b]]``, applies one delta-rule step (the math of ``kda_reference``)::

    S   = Diag(exp(g)) S                        # g [dk] (KDA) or one scalar per head (GDN)
    S   = S + k (beta (v - Sᵀ k))ᵀ              # q, k L2-normalised inside, q scaled
    o   = Sᵀ q

and writes the state back into the same slot, in place: the pool enters the kernel as a mutable
Ref, which becomes an input/output alias of the custom call, and ``gdn_decode`` donates it, so XLA
neither copies the pool nor gathers/scatters rows. Each state is read once and written once: that
is the whole cost (``Hv * dk * dv * 4 * 2`` bytes per row), so the kernel is judged against the
HBM roofline.

Work unit: a tile = the ``[dk, block_dv]`` columns of one head of one row. Columns of S are
independent given k (``Sᵀk`` reduces over dk), so tiles never talk to each other. A tile is done by
one warpgroup (128 threads):

1. TMA copies GMEM -> SMEM of the state tile (tiled (8, 32) + 128-byte swizzle: bank-conflict-free
   register loads), of ``q[b, h // G]``, ``k[b, h // G]``, ``v[b, h, tile]`` and (KDA) ``g[b, h]``,
   each on its own mbarrier; ``slots[b]``, ``beta[b, h]`` and the GDN gate are scalar GMEM loads;
2. the tile goes to registers in the WGMMA layout (dk over the 4 warps), dk-vectors in its row
   layout, the dv-vector in its column layout; the step runs in fp32; the two reductions over dk
   (``Sᵀk``, ``Sᵀq``) are column reductions (shuffles, then one cross-warp pass through SMEM); the L2
   norms of q and k are folded in as per-column factors (``kn·S = |k|⁻¹ (k·S)``);
3. the new tile and o go back to SMEM and out by TMA stores (the state to the slot it came from).

Two schedules of those tiles (``persistent``):

* simple: a grid of ``(B, Hv, dv // block_dv)`` blocks, one tile each (load, step, store, exit);
  latency is hidden only by other resident blocks.
* persistent (default): ``blocks_per_sm * num_SMs`` blocks, each walking tiles ``blk, blk + G, ...``
  through a ring of ``stages`` SMEM buffers: while tile i is computed, the copies of tiles
  i+1 .. i+stages-1 are in flight and the store of tile i-1 drains; the scalars a tile needs are
  read ``stages`` tiles ahead and carried, so no dependent global load sits on the critical path.
  On the H200 it was 1.15x faster than the simple schedule at batch 64 and 256.

Serving form (``gdn_decode_pool`` with ``layer``, ``write_slots``, ``fresh``): the pool is the
engine's ``[layers, slots, Hv, dk, dv]`` stack and ``layer`` picks one; row ``b`` reads
``slots[b]`` and writes ``write_slots[b]`` (a hit restoring a tree snapshot reads the tree's slot and
writes its own), and a ``fresh`` row starts from the zero state whatever its read slot holds (its
decay factor is 0: the slot's finite leftovers are multiplied away).

Contract: write slots of real rows are distinct and no row writes a slot another row reads. Rows with slot 0 (the null slot, batch padding) may
all read and write slot 0, whose contents are then garbage; every other slot not named in
``slots`` is left bit-identical. ``dk % 64 == 0`` (WGMMA row tiling), ``block_dv % 32 == 0``, and
every TMA load moves a multiple of 128 bytes (so ``dk`` and ``block_dv`` elements of the
activation dtypes span 128 bytes: bf16 needs ``block_dv >= 64``).
"""

from __future__ import annotations

import functools
import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.kda_reference import L2NORM_EPS, l2norm

_SWIZZLE = 128  # bytes; fp32 swizzle atom is 32 elements wide
DEFAULT_PERSISTENT = True  # measured faster at every batch timed: benchmarks/RESULTS.md


def _tile_ok(block_dv: int, dv: int, v_itemsize: int) -> bool:
    """A dv tile must divide dv, fill whole fp32 swizzle atoms (32 columns) and, for the TMA copy
    of its v slice, move a multiple of 128 bytes (Mosaic GPU arrives once per thread)."""
    return dv % block_dv == 0 and block_dv % 32 == 0 and (block_dv * v_itemsize) % 128 == 0


def default_block_dv(batch: int, num_v_heads: int, dv: int, v_itemsize: int = 4) -> int:
    """64-column tiles (32 KiB of state per SMEM buffer) unless that leaves SMs idle, then the
    narrowest legal tile. The persistent kernel with 64-column tiles, 3 stages and 2 blocks per SM
    is the configuration measured fastest (benchmarks/RESULTS.md)."""
    legal = [b for b in (64, 128, 32) if _tile_ok(b, dv, v_itemsize)]
    if not legal:
        raise ValueError(f"no legal dv tile for dv={dv}, v itemsize {v_itemsize}")
    if batch * num_v_heads * (dv // legal[0]) < 132:
        return min(legal)
    return legal[0]


def _tile_step(s_smem, q_smem, k_smem, v_smem, g_smem, o_smem, bars, beta, g_scalar, keep,
               *, scale, use_qk_l2norm, per_channel_gate):
    """One tile, once its copies have landed: registers <- SMEM, the delta step in fp32, SMEM <- registers.

    ``bars`` = (state, k, q, v, g) barriers of this tile's copies; ``g_scalar`` is the GDN
    log-decay (unused for KDA, whose gate vector is in ``g_smem``); ``keep`` is 1.0, or 0.0 for a
    fresh row (zero initial state).
    """
    dk, block_dv = s_smem.shape
    tile = plgpu.Layout.WGMMA
    row = plgpu.Layout.WGMMA.reduce(1)  # a [dk] vector, broadcast along dv
    col = plgpu.Layout.WGMMA.reduce(0)  # a [block_dv] vector, broadcast along dk
    shape = (dk, block_dv)
    bcast_row = lambda x: lax.broadcast_in_dim(x, shape, [0])  # noqa: E731
    bcast_col = lambda x: lax.broadcast_in_dim(x, shape, [1])  # noqa: E731
    s_bar, k_bar, q_bar, v_bar, g_bar = bars

    plgpu.barrier_wait(k_bar)
    kb = bcast_row(plgpu.load(k_smem, layout=row).astype(jnp.float32))
    if per_channel_gate:
        plgpu.barrier_wait(g_bar)
        decay = bcast_row(jnp.exp(plgpu.load(g_smem, layout=row).astype(jnp.float32)) * keep)
    else:
        decay = jnp.exp(g_scalar) * keep
    plgpu.barrier_wait(s_bar)
    s = plgpu.load(s_smem, layout=tile) * decay

    # kn·S with kn = k |k|⁻¹: reduce first, then scale the [block_dv] result.
    ks = jnp.sum(kb * s, axis=0)
    if use_qk_l2norm:
        rk = lax.rsqrt(jnp.sum(kb * kb, axis=0) + L2NORM_EPS)
        ks = ks * rk
    plgpu.barrier_wait(v_bar)
    v = plgpu.load(v_smem, layout=col).astype(jnp.float32)
    delta = (v - ks) * beta
    if use_qk_l2norm:
        delta = delta * rk
    s = s + kb * bcast_col(delta)

    plgpu.barrier_wait(q_bar)
    qb = bcast_row(plgpu.load(q_smem, layout=row).astype(jnp.float32))
    o = jnp.sum(qb * s, axis=0)
    if use_qk_l2norm:
        o = o * (lax.rsqrt(jnp.sum(qb * qb, axis=0) + L2NORM_EPS) * scale)
    else:
        o = o * scale

    s_smem[...] = s
    o_smem[...] = o.astype(o_smem.dtype)
    plgpu.commit_smem()


def _state(pool_ref, slot, h, cols):
    """The GMEM state tile ``[dk, cols]`` of head ``h`` in ``slot``."""
    return pool_ref.at[slot, h, :, cols]


def _issue_loads(pool_ref, q_ref, k_ref, v_ref, g_ref, b, h, hk, slot, cols, smems, bars, per_channel_gate):
    s_smem, q_smem, k_smem, v_smem, g_smem = smems
    s_bar, k_bar, q_bar, v_bar, g_bar = bars
    plgpu.copy_gmem_to_smem(_state(pool_ref, slot, h, cols), s_smem, s_bar)
    plgpu.copy_gmem_to_smem(k_ref.at[b, hk], k_smem, k_bar)
    plgpu.copy_gmem_to_smem(q_ref.at[b, hk], q_smem, q_bar)
    plgpu.copy_gmem_to_smem(v_ref.at[b, h, cols], v_smem, v_bar)
    if per_channel_gate:
        plgpu.copy_gmem_to_smem(g_ref.at[b, h], g_smem, g_bar)


def _decode_kernel(slots_ref, write_ref, keep_ref, q_ref, k_ref, v_ref, g_ref, beta_ref, pool_ref, o_ref,
                   s_smem, q_smem, k_smem, v_smem, g_smem, o_smem, bars,
                   *, group, block_dv, scale, use_qk_l2norm, per_channel_gate):
    """One block per (row, head, dv tile): load, step, store, exit."""
    b = lax.axis_index("b")
    h = lax.axis_index("h")
    j = lax.axis_index("j")
    hk = lax.div(h, jnp.int32(group))
    slot = slots_ref[b]
    cols = pl.ds(j * block_dv, block_dv)
    tile_bars = tuple(bars.at[i] for i in range(5))
    _issue_loads(pool_ref, q_ref, k_ref, v_ref, g_ref, b, h, hk, slot, cols,
                 (s_smem, q_smem, k_smem, v_smem, g_smem), tile_bars, per_channel_gate)
    beta = beta_ref[b, h].astype(jnp.float32)
    g_scalar = None if per_channel_gate else g_ref[b, h].astype(jnp.float32)
    keep = keep_ref[b].astype(jnp.float32)
    _tile_step(s_smem, q_smem, k_smem, v_smem, g_smem, o_smem, tile_bars, beta, g_scalar, keep,
               scale=scale, use_qk_l2norm=use_qk_l2norm, per_channel_gate=per_channel_gate)
    plgpu.copy_smem_to_gmem(s_smem, _state(pool_ref, write_ref[b], h, cols), commit_group=False)
    plgpu.copy_smem_to_gmem(o_smem, o_ref.at[b, h, cols])
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def _persistent_kernel(slots_ref, write_ref, keep_ref, q_ref, k_ref, v_ref, g_ref, beta_ref, pool_ref, o_ref,
                       s_smem, q_smem, k_smem, v_smem, g_smem, o_smem, bars,
                       *, group, block_dv, scale, use_qk_l2norm, per_channel_gate, stages, num_blocks):
    """A fixed grid of blocks, each walking the tiles ``blk, blk + G, ...`` with ``stages`` SMEM
    buffers: while tile i is computed, the copies of tiles i+1 .. i+stages-1 are in flight and the
    store of tile i-1 drains. The scalars a tile needs (its slot, beta, GDN gate) are read from
    GMEM ``stages`` tiles ahead and carried, so no dependent global load sits on the critical path.
    """
    B, Hv = beta_ref.shape
    n_cols = pool_ref.shape[-1] // block_dv
    total = B * Hv * n_cols
    blk = lax.axis_index("blk")
    n_tiles = lax.div(total - blk + num_blocks - 1, jnp.int32(num_blocks))

    def coords(i):
        t = jnp.minimum(blk + i * num_blocks, total - 1)  # clamped: scalars of tiles past the end are unused
        b = lax.div(t, jnp.int32(Hv * n_cols))
        r = lax.rem(t, jnp.int32(Hv * n_cols))
        return b, lax.div(r, jnp.int32(n_cols)), lax.rem(r, jnp.int32(n_cols))

    def scalars(i):  # (read slot, beta, GDN gate, write slot, keep): NS per tile
        b, h, _ = coords(i)
        g = jnp.float32(0) if per_channel_gate else g_ref[b, h].astype(jnp.float32)
        return slots_ref[b], beta_ref[b, h].astype(jnp.float32), g, write_ref[b], keep_ref[b].astype(jnp.float32)

    NS = 5

    def stage_refs(p):
        smems = tuple(r.at[p] for r in (s_smem, q_smem, k_smem, v_smem, g_smem))
        return smems, o_smem.at[p], tuple(bars.at[c * stages + p] for c in range(5))

    def issue(i, slot):
        p = lax.rem(i, jnp.int32(stages))
        b, h, j = coords(i)
        smems, _, tile_bars = stage_refs(p)
        _issue_loads(pool_ref, q_ref, k_ref, v_ref, g_ref, b, h, lax.div(h, jnp.int32(group)), slot,
                     pl.ds(j * block_dv, block_dv), smems, tile_bars, per_channel_gate)

    ahead = [scalars(jnp.int32(i)) for i in range(stages)]
    for i in range(stages - 1):
        @pl.when(i < n_tiles)
        def _():
            issue(jnp.int32(i), ahead[i][0])

    def body(i, carry):
        carry = list(carry)
        (_, beta, g, write_slot, keep), nxt = carry[:NS], carry[NS:]
        p = lax.rem(i, jnp.int32(stages))
        b, h, j = coords(i)
        cols = pl.ds(j * block_dv, block_dv)
        smems, o_stage, tile_bars = stage_refs(p)
        _tile_step(*smems, o_stage, tile_bars, beta, g, keep, scale=scale, use_qk_l2norm=use_qk_l2norm,
                   per_channel_gate=per_channel_gate)
        plgpu.copy_smem_to_gmem(smems[0], _state(pool_ref, write_slot, h, cols), commit_group=False)
        plgpu.copy_smem_to_gmem(o_stage, o_ref.at[b, h, cols])
        plgpu.wait_smem_to_gmem(1, wait_read_only=True)  # tile i-1's buffers are free again

        @pl.when(i + stages - 1 < n_tiles)
        def _():
            issue(i + stages - 1, nxt[NS * (stages - 2)])

        return (*nxt, *scalars(i + stages))

    lax.fori_loop(0, n_tiles, body, tuple(x for sc in ahead for x in sc))
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def _check(q, k, v, g, beta, state_pool, slots, layer=None):
    B, Hk, dk = q.shape
    _, Hv, dv = v.shape
    problems = []
    if k.shape != q.shape:
        problems.append(f"k {k.shape} != q {q.shape}")
    if v.shape[0] != B or Hv % Hk:
        problems.append(f"v {v.shape} must be [B={B}, Hv, dv] with Hv % Hk == 0")
    if g.shape not in ((B, Hv), (B, Hv, dk)):
        problems.append(f"g {g.shape} must be [B, Hv] (GDN) or [B, Hv, dk] (KDA)")
    if beta.shape != (B, Hv):
        problems.append(f"beta {beta.shape} != {(B, Hv)}")
    lead = 1 if layer is None else 2
    if state_pool.ndim != 3 + lead or state_pool.shape[lead:] != (Hv, dk, dv) or state_pool.dtype != jnp.float32:
        want = "[slots, " if layer is None else "[layers, slots, "
        problems.append(f"state_pool {state_pool.shape} {state_pool.dtype} must be {want}{Hv}, {dk}, {dv}] fp32")
    elif isinstance(layer, int) and not 0 <= layer < state_pool.shape[0]:
        problems.append(f"layer {layer} not in [0, {state_pool.shape[0]})")
    if slots.shape != (B,) or not jnp.issubdtype(slots.dtype, jnp.integer):
        problems.append(f"slots {slots.shape} {slots.dtype} must be int [{B}]")
    gate_bytes = dk * g.dtype.itemsize if g.ndim == 3 else 128
    if dk % 64 or dv % 32 or (dk * q.dtype.itemsize) % 128 or gate_bytes % 128:
        problems.append(f"dk={dk} must be a multiple of 64 (and span 128 bytes of q, g), dv={dv} of 32")
    if problems:
        raise ValueError("gdn_decode: " + "; ".join(problems))


def supports(dk: int, dv: int, act_dtype) -> bool:
    """Whether the kernel's tiling takes these head dims and activation dtype (else use jnp)."""
    item = jnp.dtype(act_dtype).itemsize
    if dk % 64 or dv % 32 or (dk * item) % 128:
        return False
    return any(_tile_ok(bdv, dv, item) for bdv in (32, 64, 128, 256) if bdv <= dv)


def _num_sms(interpret: bool) -> int:
    """Multiprocessors of the device the persistent grid is sized for (1 under interpretation)."""
    if interpret:
        return 1
    return int(getattr(jax.devices()[0], "core_count", 0) or 132)


def gdn_decode_pool(q, k, v, g, beta, state_pool, slots, *, scale=None, use_qk_l2norm=True,
                    block_dv=None, persistent=None, stages=3, blocks_per_sm=2, interpret=False,
                    layer=None, write_slots=None, fresh=None):
    """``gdn_decode`` without the ``jit``/donation wrapper: call it inside your own jitted step.

    Serving form: ``layer`` (an int, or an int32 scalar under ``jit``) selects one layer of a
    stacked ``[layers, slots, Hv, dk, dv]`` pool; ``write_slots`` [B] (default ``slots``) is where
    each row's new state goes; ``fresh`` [B] bool (default all False) rows start from the zero state.

    Returns ``(o [B, Hv, dv] in v.dtype, new_state_pool)``; the pool output is aliased to the
    input, so donate the pool at your jit boundary to keep the update in place. ``persistent``
    selects the pipelined persistent-grid kernel (default: ``DEFAULT_PERSISTENT``), ``stages`` its
    SMEM buffers per block and ``blocks_per_sm`` its grid; otherwise one block per tile.

    A stacked pool runs as its flat ``[layers * slots, ...]`` view (a bitcast) with the layer folded
    into the slot ids, through one jitted kernel call (``_pool_step``): every layer of a model is
    then the same kernel on the same shapes, which JAX lowers once per step program instead of once
    per layer (a Mosaic GPU kernel's module is ~220 KB of the program: 18 GDN layers lowered 18 times
    were most of a real-size decode program's lowering time).
    """
    _check(q, k, v, g, beta, state_pool, slots, layer)
    B = q.shape[0]
    slots = slots.astype(jnp.int32)
    write_slots = slots if write_slots is None else write_slots.astype(jnp.int32)
    keep = jnp.ones((B,), jnp.int32) if fresh is None else 1 - fresh.astype(jnp.int32)
    _, Hv, dv = v.shape
    block_dv = block_dv or default_block_dv(B, Hv, dv, v.dtype.itemsize)
    if not _tile_ok(block_dv, dv, v.dtype.itemsize):
        raise ValueError(f"block_dv={block_dv} must divide dv={dv}, be a multiple of 32 and span "
                         f"a multiple of 128 bytes of v ({v.dtype})")
    statics = dict(scale=q.shape[-1] ** -0.5 if scale is None else float(scale), use_qk_l2norm=use_qk_l2norm,
                   block_dv=block_dv, persistent=DEFAULT_PERSISTENT if persistent is None else persistent,
                   stages=stages, blocks_per_sm=blocks_per_sm, interpret=interpret)
    if layer is None:
        return _pool_step(slots, write_slots, keep, q, k, v, g, beta, state_pool, **statics)
    per_layer = state_pool.shape[1]
    base = jnp.asarray(layer, jnp.int32) * per_layer
    o, flat = _pool_step(slots + base, write_slots + base, keep, q, k, v, g, beta,
                         state_pool.reshape(-1, *state_pool.shape[2:]), **statics)
    return o, flat.reshape(state_pool.shape)


@functools.partial(jax.jit, static_argnames=("scale", "use_qk_l2norm", "block_dv", "persistent", "stages",
                                             "blocks_per_sm", "interpret"))
def _pool_step(slots, write_slots, keep, q, k, v, g, beta, state_pool, *, scale, use_qk_l2norm, block_dv,
               persistent, stages, blocks_per_sm, interpret):
    """The kernel on a flat ``[slots, Hv, dk, dv]`` pool (arguments checked by the caller)."""
    B, Hk, dk = q.shape
    _, Hv, dv = v.shape
    params = dict(group=Hv // Hk, block_dv=block_dv, scale=scale, use_qk_l2norm=use_qk_l2norm,
                  per_channel_gate=g.ndim == 3)
    state_transforms = (plgpu.TilingTransform((8, _SWIZZLE // 4)), plgpu.SwizzleTransform(_SWIZZLE))
    n = (stages,) if persistent else ()
    scratch = [
        plgpu.SMEM((*n, dk, block_dv), jnp.float32, transforms=state_transforms),
        plgpu.SMEM((*n, dk), q.dtype),
        plgpu.SMEM((*n, dk), k.dtype),
        plgpu.SMEM((*n, block_dv), v.dtype),
        plgpu.SMEM((*n, dk), g.dtype),
        plgpu.SMEM((*n, block_dv), v.dtype),
        plgpu.Barrier(num_barriers=5 * (stages if persistent else 1)),
    ]
    if persistent:
        if stages < 2:
            raise ValueError(f"stages={stages}: the persistent kernel needs at least 2 buffers")
        num_tiles = B * Hv * (dv // block_dv)
        num_blocks = max(1, min(num_tiles, blocks_per_sm * _num_sms(interpret)))
        body = functools.partial(_persistent_kernel, stages=stages, num_blocks=num_blocks, **params)
        grid, grid_names = (num_blocks,), ("blk",)
    else:
        body = functools.partial(_decode_kernel, **params)
        grid, grid_names = (B, Hv, dv // block_dv), ("b", "h", "j")
    kernel = plgpu.kernel(
        body,
        kernel_name="gdn_decode",
        out_type=jax.ShapeDtypeStruct((B, Hv, dv), v.dtype),
        grid=grid,
        grid_names=grid_names,
        scratch_types=scratch,
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane),
        interpret=plgpu.InterpretGPUParams() if interpret else False,
    )
    # The pool goes in as a mutable Ref: the kernel writes it in place and the discharge turns that
    # into an input/output alias of the custom call (no copy when the caller donates the pool).
    pool_ref = jax.new_ref(state_pool)
    o = kernel(slots, write_slots, keep, q, k, v, g, beta, pool_ref)
    return o, jax.ref.freeze(pool_ref)


@functools.partial(jax.jit, static_argnames=("scale", "use_qk_l2norm", "block_dv", "persistent", "stages",
                                             "blocks_per_sm", "interpret"),
                   donate_argnames=("state_pool",))
def gdn_decode(q, k, v, g, beta, state_pool, slots, *, scale=None, use_qk_l2norm=True,
               block_dv=None, persistent=None, stages=3, blocks_per_sm=2, interpret=False):
    """One GDN (``g [B, Hv]``) or KDA (``g [B, Hv, dk]``) decode step, in place in a state pool.

    q, k ``[B, Hk, dk]``; v ``[B, Hv, dv]``; beta ``[B, Hv]`` (sigmoided); state_pool
    ``[num_slots, Hv, dk, dv]`` fp32 (donated); slots int32 ``[B]``. Returns ``(o [B, Hv, dv] in
    v.dtype, new_state_pool)``. Value head ``h`` reads key head ``h // (Hv // Hk)``; q, k are
    L2-normalised (``use_qk_l2norm``) then q is scaled by ``scale`` (default ``dk ** -0.5``),
    exactly as ``gdn_recurrent`` / ``kda_recurrent`` on one token per sequence.
    ``interpret=True`` runs Mosaic GPU's GPU interpret mode (CPU).
    """
    return gdn_decode_pool(q, k, v, g, beta, state_pool, slots, scale=scale, use_qk_l2norm=use_qk_l2norm,
                           block_dv=block_dv, persistent=persistent, stages=stages,
                           blocks_per_sm=blocks_per_sm, interpret=interpret)


def gdn_decode_jnp(q, k, v, g, beta, state_pool, slots, *, scale=None, use_qk_l2norm=True):
    """The same step in plain jnp (gather the rows' states, one vectorised step, scatter back):
    what XLA makes of it is the baseline the kernel is measured against. Same math and
    conventions as ``kda_reference._delta_step``; fp32 at HIGHEST precision."""
    mm = functools.partial(jnp.einsum, precision=lax.Precision.HIGHEST)
    q, k, v, g, beta = (x.astype(jnp.float32) for x in (q, k, v, g, beta))
    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    q = q * (q.shape[-1] ** -0.5 if scale is None else scale)
    group = v.shape[1] // k.shape[1]
    q, k = jnp.repeat(q, group, axis=1), jnp.repeat(k, group, axis=1)
    gate = jnp.exp(g)[..., None] if g.ndim == 3 else jnp.exp(g)[..., None, None]
    s = state_pool[slots] * gate
    delta = beta[..., None] * (v - mm("bhk,bhkv->bhv", k, s))
    s = s + k[..., None] * delta[..., None, :]
    o = mm("bhk,bhkv->bhv", q, s)
    return o.astype(v.dtype), state_pool.at[slots].set(s)


def main():
    """Small self-check: ``python -m pallas_kernels.gdn_decode [--interpret]``."""
    import sys

    import numpy as np

    interpret = "--interpret" in sys.argv
    B, Hk, Hv, dk, dv, num_slots = (2, 1, 2, 64, 64, 5) if interpret else (64, 16, 32, 128, 128, 80)
    keys = jax.random.split(jax.random.key(0), 7)
    q = jax.random.normal(keys[0], (B, Hk, dk), jnp.float32)
    k = jax.random.normal(keys[1], (B, Hk, dk), jnp.float32)
    v = jax.random.normal(keys[2], (B, Hv, dv), jnp.float32)
    g = -jax.nn.softplus(jax.random.normal(keys[3], (B, Hv), jnp.float32))
    beta = jax.nn.sigmoid(jax.random.normal(keys[4], (B, Hv), jnp.float32))
    pool = jax.random.normal(keys[5], (num_slots, Hv, dk, dv), jnp.float32)
    slots = jax.random.permutation(keys[6], num_slots - 1)[:B].astype(jnp.int32) + 1
    o_ref, pool_ref = gdn_decode_jnp(q, k, v, g, beta, pool, slots)
    o, new_pool = gdn_decode(q, k, v, g, beta, jnp.copy(pool), slots, interpret=interpret)
    err_o = float(jnp.linalg.norm(o - o_ref) / jnp.linalg.norm(o_ref))
    err_s = float(jnp.linalg.norm(new_pool - pool_ref) / jnp.linalg.norm(pool_ref))
    print(f"gdn_decode B={B} Hk={Hk} Hv={Hv} dk={dk} dv={dv}: rel err o {err_o:.2e}, state {err_s:.2e}")
    np.testing.assert_array_less([err_o, err_s], [1e-5, 1e-5])


if __name__ == "__main__":
    main()
