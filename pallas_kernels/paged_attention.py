"""Paged GQA attention (decode and extend) over the KV page pool: a Pallas Mosaic GPU kernel (sm_90).

Drop-in for ``jaxserve.models.layers.paged_attention`` (same arguments, same result): the new keys
and values are written into their pages first, then every query token attends, causally, to its
row's cached context plus the row's new tokens, all read back through the page table.

**The K/V write is not fused**: it is the reference's own jnp scatter (``write_kv``), done before
the kernel in the same jitted step; the kernel only reads the pools. Under donation the scatter is
in place, so it costs the new tokens' bytes, not a pool copy.

Work unit (flash-decoding): one program per (query tile, kv head, split).

* A *query tile* is up to ``tq = 64 // G`` consecutive new tokens of one row (``G`` = q heads per kv
  head) with all ``G`` q heads of the kv head: ``tq * G <= 64`` rows, the M of one WGMMA. Decode
  (one token per row) uses ``tq = 1``: the ``G`` heads of a token fill rows ``0..G-1`` and the other
  rows are padding (their math is wasted, their results never read; decode is memory bound). So
  K/V are read once per GQA group, never once per q head.
* The program walks the row's keys 64 positions at a time (``KEY_BLOCK``: ``64 // page_size``
  pages, one TMA copy per page into a swizzled SMEM tile), in a ring of ``stages`` SMEM buffers
  (the copies of blocks ``j+1 .. j+stages-1`` are in flight while block ``j`` is computed), with
  ``S = Q Kᵀ`` and ``O += P V`` on the tensor cores (WGMMA, fp32 accumulators) and an online fp32
  softmax in registers. Only blocks up to the tile's last position are visited (and, for sliding
  layers, from the first block the window can see).
* *Split-K*: with ``num_splits > 1`` the blocks of a tile are cut into that many contiguous ranges,
  one program each, so a long context at batch 1 still fills the SMs. Every program writes its
  unnormalised fp32 accumulator and its softmax state (running max ``m``, sum ``l``) for the rows
  a tile can use (``tq * G`` rounded up to 8: ``G`` rows in decode); a tiny jnp epilogue merges
  the splits (``o = Σ e^(m_s - m) acc_s / Σ e^(m_s - m) l_s``) and gathers each token's ``G``
  rows. With one split the epilogue is just ``acc / l``. The default split count
  (``default_num_splits``) splits only grids that would leave more than half the SMs idle.

Masking follows the reference: key ``k_pos`` is visible to a query at ``q_pos`` iff
``k_pos <= q_pos`` (and ``k_pos > q_pos - window``); masked scores become a finite ``-1e30``
before the max, so a fully masked block never makes NaN and drops out (weight ``e^(-1e30 - m) = 0``)
as soon as a visible key appears. Unlike the reference the kernel does not zero masked *values*
before ``P V`` (their weights are exactly 0): pages must hold finite numbers, which the engine's
zero-initialised pools, written only with finite K/V, guarantee.

Cost model (decode): the kernel must read every visible K/V byte once,
``sum(len_b) * nkv * hd * 2 * itemsize``; FLOPs are ``4 * sum(len_b) * nh * hd`` (the WGMMAs do
``64 / G`` times that: padding rows), far below the tensor cores' rate, so the floor is the K/V
bytes over HBM bandwidth (about 4.0e12 B/s on the H200). benchmarks/kernels.py times it against
that floor (suite ``paged_attention``); benchmarks/gpu_check.py checks it at model shapes (passed
on the H200; ``jaxserve.models.backends`` says when, and benchmarks/RESULTS.md has the times). The
tests check it in the GPU interpreter and lower it for sm_90 on the CPU (layouts, transforms, TMA
shapes, SMEM budget).

Contract: ``64 % page_size == 0`` and ``page_size % 8 == 0`` (a page lands on whole 8-row SMEM
tiles: page sizes 8, 16, 32, 64); ``head_dim % 64 == 0`` (128 and 256 are the targets; WGMMA N and
the 128-byte swizzle); ``nh % nkv == 0`` with ``G = nh // nkv <= 64``; q and the pools in bf16 or
fp16 on the GPU. fp32 inputs are accepted for interpret-mode tests on the CPU (on the GPU fp32
would be a tf32 WGMMA and is not a supported configuration). The page table's width is a multiple
of ``64 // page_size`` (``Ragged``'s own contract), and every position a tile reads maps to a real
page or the null page.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jaxserve.config import SNAPSHOT_INTERVAL

KEY_BLOCK = SNAPSHOT_INTERVAL  # keys per block, as in jaxserve.models.layers
ROWS = 64  # WGMMA M: query rows (token, head) of one tile
NEG = -1e30  # finite "minus infinity", as in the reference
_SWIZZLE = 128


def _smem_transforms(dtype):
    elems = _SWIZZLE // jnp.dtype(dtype).itemsize
    return (plgpu.TilingTransform((8, elems)), plgpu.SwizzleTransform(_SWIZZLE))


def _kernel(layer_ref, tiles_ref, pt_ref, q_ref, kp_ref, vp_ref, acc_ref, m_ref, l_ref,
            q_smem, ring_union, p_smem, m_smem, l_smem, q_bar, k_bars, v_bars,
            *, group, page_size, stages, num_splits, window, scale, interpret):
    """One (query tile, kv head, split): online softmax over the split's key blocks."""
    (k_smem, v_smem), o_smem = ring_union  # the output tile reuses the K/V ring after the loop
    i = lax.axis_index("tile")
    h = lax.axis_index("kvh")
    s = lax.axis_index("split")
    bp = KEY_BLOCK // page_size
    hd = q_smem.shape[-1]
    layer = layer_ref[0]
    row = tiles_ref[i, 0]
    q_row0 = tiles_ref[i, 1]
    pos0 = tiles_ref[i, 2]
    ntok = tiles_ref[i, 3]

    kb = jnp.int32(KEY_BLOCK)
    n_blocks = jnp.where(ntok > 0, lax.div(pos0 + ntok - 1, kb) + 1, 0)
    first = jnp.int32(0) if window is None else lax.div(jnp.maximum(pos0 - window + 1, 0), kb)
    first = jnp.minimum(first, n_blocks)
    per = lax.div(n_blocks - first + num_splits - 1, jnp.int32(num_splits))
    lo = jnp.minimum(first + s * per, n_blocks)
    nb = jnp.minimum(n_blocks, lo + per) - lo  # blocks of this split

    plgpu.copy_gmem_to_smem(q_ref.at[h, pl.ds(q_row0, ROWS)], q_smem, q_bar)

    max_blk = pt_ref.shape[1] // bp

    def pages_of(jj):
        """Page ids of block lo + jj (clamped into the table: ids of blocks past the split are
        read, never used). Read a block ahead of their copies, so no GMEM load stalls an issue."""
        blk = jnp.minimum(lo + jj, max_blk - 1)
        return tuple(pt_ref[row, blk * bp + p] for p in range(bp))

    def issue(jj, pages):
        """Copies of block lo + jj (one TMA per page, each on its own barrier) into its ring slot."""
        slot = lax.rem(jj, jnp.int32(stages))
        for p, page in enumerate(pages):
            dst = pl.ds(p * page_size, page_size)
            plgpu.copy_gmem_to_smem(kp_ref.at[layer, page, :, h, :], k_smem.at[slot, dst],
                                    k_bars.at[slot * bp + p])
            plgpu.copy_gmem_to_smem(vp_ref.at[layer, page, :, h, :], v_smem.at[slot, dst],
                                    v_bars.at[slot * bp + p])

    for jj in range(stages - 1):
        pages = pages_of(jnp.int32(jj))

        @pl.when(jj < nb)
        def _():
            issue(jnp.int32(jj), pages)

    ahead = pages_of(jnp.int32(stages - 1))

    row_layout = plgpu.Layout.WGMMA.reduce(1)
    m0 = plgpu.layout_cast(jnp.full((ROWS,), NEG, jnp.float32), row_layout)
    l0 = plgpu.layout_cast(jnp.full((ROWS,), 0.0, jnp.float32), row_layout)
    acc0 = plgpu.layout_cast(jnp.full((ROWS, hd), 0.0, jnp.float32), plgpu.Layout.WGMMA)
    plgpu.barrier_wait(q_bar)

    def body(jj, carry):
        acc, m, l, ahead = carry[0], carry[1], carry[2], carry[3:]
        slot = lax.rem(jj, jnp.int32(stages))

        @pl.when(jj + stages - 1 < nb)
        def _():
            issue(jj + stages - 1, ahead)  # into the slot block jj - 1 used (its WGMMAs have completed)

        ahead = pages_of(jj + stages)

        for p in range(bp):
            plgpu.barrier_wait(k_bars.at[slot * bp + p])

        def qk_fn(acc_ref):
            plgpu.wgmma(acc_ref, q_smem, k_smem.at[slot].T)
            return acc_ref[...]

        qk = pl.run_scoped(qk_fn, plgpu.ACC((ROWS, KEY_BLOCK), jnp.float32))
        # row r is query token r // G at position pos0 + r // G; with x = k_pos - pos0 (an integer),
        # k_pos <= q_pos  <=>  x <= r // G  <=>  G * x <= r  (no integer division in the kernel).
        r_ids = plgpu.broadcasted_iota(jnp.int32, (ROWS, KEY_BLOCK), 0, layout=plgpu.Layout.WGMMA)
        c_ids = plgpu.broadcasted_iota(jnp.int32, (ROWS, KEY_BLOCK), 1, layout=plgpu.Layout.WGMMA)
        x = c_ids + ((lo + jj) * KEY_BLOCK - pos0)
        visible = x * group <= r_ids
        if window is not None:  # k_pos > q_pos - window  <=>  r // G < x + window  <=>  r < G (x + window)
            visible = visible & (r_ids < (x + window) * group)
        qk = jnp.where(visible, qk * scale, NEG)
        m_new = jnp.maximum(m, qk.max(axis=1))
        alpha = jnp.exp(m - m_new)
        p = jnp.exp(qk - lax.broadcast_in_dim(m_new, qk.shape, [0]))
        l = l * alpha + p.sum(axis=1)
        acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
        p_smem[...] = p.astype(p_smem.dtype)
        plgpu.commit_smem()  # P is the A operand of the next WGMMA (async proxy)
        for p_ in range(bp):
            plgpu.barrier_wait(v_bars.at[slot * bp + p_])

        if interpret:
            # The GPU interpreter has no rule for the discharged (value) form of WGMMA that
            # run_state produces: accumulate P V in a fresh accumulator and add (same math).
            def pv_fresh(acc_ref):
                plgpu.wgmma(acc_ref, p_smem, v_smem.at[slot])
                return acc_ref[...]

            acc = acc + pl.run_scoped(pv_fresh, plgpu.ACC((ROWS, hd), jnp.float32))
        else:  # FlashAttention-3's form (attention_mgpu.py): WGMMA accumulates into the carried acc
            def pv_fn(acc_ref):
                plgpu.wgmma(acc_ref, p_smem, v_smem.at[slot])

            acc = pl.run_state(pv_fn)(plgpu.ACC.init(acc))
        return (acc, m_new, l, *ahead)

    acc, m, l = lax.fori_loop(0, nb, body, (acc0, m0, l0, *ahead))[:3]
    o_smem[...] = acc
    m_smem[...] = m
    l_smem[...] = l
    plgpu.commit_smem()
    rows = pl.ds(0, acc_ref.shape[-2])  # only the rows a tile can use (G rows in decode)
    plgpu.copy_smem_to_gmem(o_smem.at[rows], acc_ref.at[s, i, h], commit_group=False)
    plgpu.copy_smem_to_gmem(m_smem.at[rows], m_ref.at[s, i, h], commit_group=False)
    plgpu.copy_smem_to_gmem(l_smem.at[rows], l_ref.at[s, i, h])
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def write_kv(k, v, k_pool, v_pool, layer, r):
    """The new keys / values into their pages: the one K/V write of the jnp path
    (``jaxserve.models.layers.paged_attention``) and of this kernel's.

    Where the batch has more tokens than rows (prefill / mixed steps: their padding rows are empty),
    every token past the real ones gets a page of its own past the pool and writes nothing, and the
    real tokens name distinct (page, offset) pairs (a row writes only its own pages, invariant 2),
    so the scatter declares ``unique_indices``: XLA's GPU scatter then stores instead of updating
    every element atomically (a compare-and-swap loop for bf16 pools). A batch of one token per row
    (decode) keeps the plain scatter: its padding rows each carry one token, all into the null page."""
    T, page_size, num_pages = k.shape[0], k_pool.shape[2], k_pool.shape[1]
    n_rows = r.num_rows
    row = jnp.minimum(r.seq, n_rows - 1)
    real = r.seq < n_rows
    unique = T != n_rows  # static: a prefill / mixed step
    # Only the page each token writes: a token's whole page-table row would be [T, W] (512 MiB at
    # 8192 tokens and a 256k-token table), benchmarks/RESULTS.md "Step memory".
    padding_page = num_pages + jnp.arange(T, dtype=jnp.int32) if unique else 0  # past the pool: skipped
    dst_page = jnp.where(real, r.page_table[row, r.positions // page_size], padding_page)
    dst_off = r.positions % page_size
    kw = dict(mode="drop", unique_indices=True) if unique else {}
    k_pool = k_pool.at[layer, dst_page, dst_off].set(k.astype(k_pool.dtype), **kw)
    v_pool = v_pool.at[layer, dst_page, dst_off].set(v.astype(v_pool.dtype), **kw)
    return k_pool, v_pool


def _tiles(r, T, tq, decode):
    """Query tiles ``[n_tiles, 4]`` = (row, first q2 row (t0 * G, filled in by the caller), first
    position, tokens) and, per token, its tile and its index inside the tile. ``decode``: every
    row has at most one new token (tile t = token t). Otherwise tiles of ``tq`` tokens are cut per
    row; ``cdiv(T, tq) + B`` tiles bound their number (tiles past the last are empty: 0 tokens)."""
    B = r.num_rows
    t = jnp.arange(T, dtype=jnp.int32)
    real = r.seq < B
    seq = jnp.minimum(r.seq, B - 1)
    if decode:
        tiles = jnp.stack([seq, t, r.positions, real.astype(jnp.int32)], axis=1)
        return tiles, t, jnp.zeros_like(t)
    cu = r.cu_seqlens.astype(jnp.int32)
    lens = cu[1:] - cu[:-1]
    per_row = (lens + tq - 1) // tq
    ends = jnp.cumsum(per_row)
    starts = ends - per_row
    n_tiles = -(-T // tq) + B
    i = jnp.arange(n_tiles, dtype=jnp.int32)
    trow = jnp.searchsorted(ends, i, side="right", method="compare_all").astype(jnp.int32)  # one fusion, not a loop
    valid = trow < B
    trow_c = jnp.minimum(trow, B - 1)
    t0 = cu[trow_c] + (i - starts[trow_c]) * tq
    ntok = jnp.where(valid, jnp.clip(cu[trow_c + 1] - t0, 0, tq), 0)
    t0 = jnp.where(valid & (ntok > 0), t0, 0)
    pos0 = jnp.where(ntok > 0, r.positions[jnp.minimum(t0, T - 1)], 0)
    tiles = jnp.stack([trow_c, t0, pos0, ntok], axis=1)
    local = t - cu[seq]
    tile_of = starts[seq] + local // tq
    return tiles, jnp.where(real, tile_of, 0), jnp.where(real, local % tq, 0)


def _num_sms(interpret: bool) -> int:
    if interpret:
        return 1
    return int(getattr(jax.devices()[0], "core_count", 0) or 132)


def default_num_splits(programs: int, max_blocks: int, num_sms: int, min_blocks_per_split: int = 8) -> int:
    """Split only when the grid would leave more than half the SMs idle (one program fits an SM:
    the SMEM ring takes 120-168 KiB), then up to one wave of programs, but no split under
    ``min_blocks_per_split`` key blocks of the longest possible context (a split's fp32 partial,
    ``G * hd * 4`` bytes, then stays under 1/16 of the K/V it reads)."""
    if 2 * programs > num_sms:
        return 1
    return int(max(1, min(num_sms // programs, max_blocks // min_blocks_per_split)))


def default_stages(head_dim: int, itemsize: int) -> int:
    """SMEM ring depth: 3 buffers of K+V for head_dim 128 (96 KiB bf16; 120 KiB in all with Q and
    P), 2 for 256 (128 KiB; 168 KiB in all), within the 227 KiB of an H100/H200 SM. (The fp32
    output tile shares the ring's memory.) Untuned: no GPU run yet."""
    return 3 if head_dim * itemsize <= 256 else 2


def _check(q, k, v, k_pool, v_pool, r):
    T, nh, hd = q.shape
    problems = []
    if k_pool.ndim != 5 or v_pool.shape != k_pool.shape:
        problems.append(f"pools {k_pool.shape} / {v_pool.shape} must both be [layers, pages, page_size, kvh, hd]")
    else:
        _, _, ps, nkv, hd_p = k_pool.shape
        if hd_p != hd or k.shape != (T, nkv, hd) or v.shape != (T, nkv, hd):
            problems.append(f"q {q.shape}, k {k.shape}, v {v.shape} disagree with the pools {k_pool.shape}")
        if nh % nkv or nh // nkv > ROWS:
            problems.append(f"{nh} q heads over {nkv} kv heads: need a whole group of at most {ROWS}")
        if KEY_BLOCK % ps or ps % 8:
            problems.append(f"page_size={ps} must divide {KEY_BLOCK} and be a multiple of 8")
        if r.page_table.shape[1] % (KEY_BLOCK // max(ps, 1)):
            problems.append(f"page table width {r.page_table.shape[1]} not a multiple of {KEY_BLOCK // ps}")
    if hd % 64:
        problems.append(f"head_dim={hd} must be a multiple of 64")
    if problems:
        raise ValueError("paged_attention: " + "; ".join(problems))


# Head dims ``--kernels auto`` runs the kernel at: the issue's contract, tested in interpret mode
# (128, 256) and on the H200 (256). Others that ``supports`` (e.g. 64) need an explicit choice.
AUTO_HEAD_DIMS = (128, 256)


def supports(num_heads: int, num_kv_heads: int, head_dim: int, page_size: int, dtype, *, gpu: bool = True) -> bool:
    """Whether the kernel takes this attention shape (``_check``'s rules); on a GPU only bf16/fp16."""
    if gpu and jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return False
    return (num_heads % num_kv_heads == 0 and num_heads // num_kv_heads <= ROWS and head_dim % 64 == 0
            and page_size > 0 and KEY_BLOCK % page_size == 0 and page_size % 8 == 0)


def paged_attention(q, k, v, k_pool, v_pool, layer, r, window=None, *, num_splits=None, stages=None,
                    decode=None, interpret=False):
    """``layers.paged_attention`` on the Mosaic GPU kernel. Returns ``(out [T, nh*hd], k_pool, v_pool)``.

    q ``[T, nh, hd]``; k, v ``[T, nkv, hd]``; pools ``[layers, pages, page_size, nkv, hd]``;
    ``layer`` an int (or int32 scalar) indexing the pools; ``r`` a ``layers.Ragged`` (only
    positions, cu_seqlens, seq and page_table are read); ``window`` for sliding layers.
    Call it inside the jitted step with the pools donated (the K/V write is then in place).

    Static knobs: ``decode`` (one query tile per token: right for any batch, efficient when rows
    have one new token each, e.g. a decode step padded to a bucket; default: ``T == num_rows``;
    otherwise tiles of ``64 // G`` tokens of a row), ``num_splits`` (split-K programs per tile, default from the grid
    size and the page table's width vs the SM count), ``stages`` (SMEM ring depth),
    ``interpret`` (Mosaic GPU's GPU interpreter, for CPU tests).
    """
    _check(q, k, v, k_pool, v_pool, r)
    k_pool, v_pool = write_kv(k, v, k_pool, v_pool, layer, r)
    out = paged_attention_read(q, k_pool, v_pool, layer, r, window, num_splits=num_splits, stages=stages,
                               decode=decode, interpret=interpret)
    return out, k_pool, v_pool


def paged_attention_read(q, k_pool, v_pool, layer, r, window=None, *, num_splits=None, stages=None,
                         decode=None, interpret=False):
    """The read half: attention of ``q`` over pools that already hold the new tokens' K/V."""
    T, nh, hd = q.shape
    _, _, ps, nkv, _ = k_pool.shape
    G = nh // nkv
    B = r.num_rows
    decode = (T == B) if decode is None else decode
    tq = 1 if decode else ROWS // G
    tiles, tile_of, local = _tiles(r, T, tq, decode)
    tiles = tiles.at[:, 1].multiply(G)  # first token -> first row of q2
    n_tiles = tiles.shape[0]
    max_blocks = r.page_table.shape[1] * ps // KEY_BLOCK
    if num_splits is None:
        num_splits = default_num_splits(n_tiles * nkv, max_blocks, _num_sms(interpret))
    num_splits = max(1, min(int(num_splits), max(max_blocks, 1)))
    if stages is None:
        stages = default_stages(hd, jnp.dtype(k_pool.dtype).itemsize)

    # q2[h, t * G + g] = q[t, h * G + g], padded so the last tile's 64-row copy stays in bounds and
    # to whole 8-row tiles (Mosaic GPU's TMA into tiled SMEM asks that of the GMEM array too).
    q2 = q.astype(k_pool.dtype).reshape(T, nkv, G, hd).transpose(1, 0, 2, 3).reshape(nkv, T * G, hd)
    q2 = jnp.pad(q2, ((0, 0), (0, ROWS + (-T * G) % 8), (0, 0)))
    acc, m, l = _read_blocks(jnp.asarray(layer, jnp.int32).reshape(1), tiles.astype(jnp.int32),
                             r.page_table.astype(jnp.int32), q2, k_pool, v_pool, group=G, tq=tq, stages=stages,
                             num_splits=num_splits, window=None if window is None else int(window),
                             interpret=bool(interpret))
    return combine_splits(acc, m, l, tile_of, local, r.seq < B, G).astype(q.dtype).reshape(T, nh * hd)


@functools.partial(jax.jit, static_argnames=("group", "tq", "stages", "num_splits", "window", "interpret"))
def _read_blocks(layer_arr, tiles, page_table, q2, k_pool, v_pool, *, group, tq, stages, num_splits, window,
                 interpret):
    """The kernel's per-split softmax states (acc, m, l) for ``paged_attention_read``. One jitted
    function for every layer (the layer is an operand): JAX lowers it once per step program, not
    once per attention layer (each lowering is a whole Mosaic GPU module in the program)."""
    G, n_tiles = group, tiles.shape[0]
    _, _, ps, nkv, hd = k_pool.shape
    bp = KEY_BLOCK // ps
    out_rows = -(-tq * G // 8) * 8  # rows written back per tile: whole 8-row SMEM tiles
    dt = k_pool.dtype
    scratch = [
        plgpu.SMEM((ROWS, hd), dt, transforms=_smem_transforms(dt)),
        # K/V ring and the fp32 output tile share SMEM: the tile is written after the last block's
        # WGMMAs completed and no copy is in flight (every issued block was waited for). Without the
        # union, head_dim 256 would need 232 KiB (> the 227 KiB an SM offers).
        plgpu.RefUnion(
            (plgpu.SMEM((stages, KEY_BLOCK, hd), dt, transforms=_smem_transforms(dt)),
             plgpu.SMEM((stages, KEY_BLOCK, hd), dt, transforms=_smem_transforms(dt))),
            plgpu.SMEM((ROWS, hd), jnp.float32, transforms=_smem_transforms(jnp.float32)),
        ),
        plgpu.SMEM((ROWS, KEY_BLOCK), dt, transforms=_smem_transforms(dt)),
        plgpu.SMEM((ROWS,), jnp.float32),
        plgpu.SMEM((ROWS,), jnp.float32),
        plgpu.Barrier(),
        plgpu.Barrier(num_barriers=stages * bp),
        plgpu.Barrier(num_barriers=stages * bp),
    ]
    body = functools.partial(_kernel, group=G, page_size=ps, stages=stages, num_splits=num_splits,
                             window=window, scale=hd ** -0.5, interpret=interpret)
    kernel = plgpu.kernel(
        body,
        kernel_name="paged_attention",
        out_type=(jax.ShapeDtypeStruct((num_splits, n_tiles, nkv, out_rows, hd), jnp.float32),
                  jax.ShapeDtypeStruct((num_splits, n_tiles, nkv, out_rows), jnp.float32),
                  jax.ShapeDtypeStruct((num_splits, n_tiles, nkv, out_rows), jnp.float32)),
        grid=(n_tiles, nkv, num_splits),
        grid_names=("tile", "kvh", "split"),
        scratch_types=scratch,
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane),
        interpret=plgpu.InterpretGPUParams() if interpret else False,
    )
    return kernel(layer_arr, tiles, page_table, q2, k_pool, v_pool)


def combine_splits(acc, m, l, tile_of, local, real, G):
    """Merge the splits' softmax states and gather each token's G rows: -> [T, nkv, G, hd] fp32."""
    rows = local[:, None] * G + jnp.arange(G)[None, :]  # [T, G]
    # [S, tiles, nkv, 64, ...] -> [tiles, 64, S, nkv, ...] -> [T, G, S, nkv, ...]
    take = lambda x: jnp.moveaxis(x, (1, 3), (0, 1))[tile_of[:, None], rows]  # noqa: E731
    acc, m, l = take(acc), take(m), take(l)
    m_tot = jnp.max(m, axis=2, keepdims=True)
    w = jnp.exp(m - m_tot)
    l_tot = jnp.sum(w * l, axis=2)
    o = jnp.sum(w[..., None] * acc, axis=2) / jnp.where(l_tot > 0, l_tot, 1.0)[..., None]
    o = jnp.where(real[:, None, None, None], o, 0.0)  # bucket padding tokens
    return o.transpose(0, 2, 1, 3)  # [T, nkv, G, hd]


# ------------------------------------------------------------------------------------------------
# Test and benchmark scaffolding (NumPy only): random paged batches and a float64 oracle.
# ------------------------------------------------------------------------------------------------


def random_paged_batch(rng, ctx, new, *, nh, nkv, hd, page_size, layers=1, pad_tokens=0, spare_pages=4):
    """A ragged batch over a page pool, as float32/int32 NumPy arrays.

    Row ``b`` has ``ctx[b]`` cached tokens and ``new[b]`` new ones; its pages are distinct, random
    pages of the pool (page 0 is the null page), and its page-table entries past them are 0. The
    table has one spare key block of null pages. ``pad_tokens`` bucket padding tokens (row = B)
    end the flat batch. Returns ``(x, ragged)``: ``x`` = q, k, v, k_pool, v_pool; ``ragged`` =
    positions, cu_seqlens, seq, context_len, page_table (the fields of ``layers.Ragged`` that
    attention reads).
    """
    import numpy as np

    B, T = len(ctx), sum(new) + pad_tokens
    bp = KEY_BLOCK // page_size
    total = [c + n for c, n in zip(ctx, new)]
    need = [-(-t // page_size) for t in total]
    width = (-(-max(total) // KEY_BLOCK) + 1) * bp
    num_pages = sum(need) + 1 + spare_pages
    perm = rng.permutation(np.arange(1, num_pages))
    page_table = np.zeros((B, width), np.int32)
    o = 0
    for b in range(B):
        page_table[b, :need[b]] = perm[o:o + need[b]]
        o += need[b]
    ragged = dict(
        positions=np.concatenate([c + np.arange(n) for c, n in zip(ctx, new)] + [np.zeros(pad_tokens)]).astype(np.int32),
        cu_seqlens=np.concatenate([[0], np.cumsum(new)]).astype(np.int32),
        seq=np.concatenate([np.full(n, b) for b, n in enumerate(new)] + [np.full(pad_tokens, B)]).astype(np.int32),
        context_len=np.asarray(ctx, np.int32),
        page_table=page_table,
    )
    normal = lambda *s: rng.standard_normal(size=s, dtype=np.float32)  # noqa: E731
    x = dict(q=normal(T, nh, hd), k=normal(T, nkv, hd), v=normal(T, nkv, hd),
             k_pool=normal(layers, num_pages, page_size, nkv, hd),
             v_pool=normal(layers, num_pages, page_size, nkv, hd))
    return x, ragged


def attention_np(q, k_pool, v_pool, layer, ragged, tokens=None, window=None):
    """Float64 softmax attention of ``tokens`` (default: all) over their rows' visible keys, read
    from pools that already hold the new tokens' K/V. Returns ``[len(tokens), nh * hd]``; bucket
    padding tokens give 0."""
    import numpy as np

    q = np.asarray(q, np.float64)
    kp, vp = (np.asarray(a)[layer] for a in (k_pool, v_pool))  # gathered rows go to float64 below
    T, nh, hd = q.shape
    ps, nkv = kp.shape[1], kp.shape[2]
    seq, pos, pt = (np.asarray(ragged[n]) for n in ("seq", "positions", "page_table"))
    tokens = range(T) if tokens is None else tokens
    out = np.zeros((len(tokens), nkv, nh // nkv, hd))
    for n, t in enumerate(tokens):
        if seq[t] >= pt.shape[0]:
            continue
        kpos = np.arange(pos[t] + 1)
        if window is not None:
            kpos = kpos[kpos > pos[t] - window]
        pages, offs = pt[seq[t], kpos // ps], kpos % ps
        kk, vv = kp[pages, offs].astype(np.float64), vp[pages, offs].astype(np.float64)  # [n, nkv, hd]
        s = np.einsum("nkd,kgd->kgn", kk, q[t].reshape(nkv, -1, hd)) * hd ** -0.5
        p = np.exp(s - s.max(-1, keepdims=True))
        out[n] = np.einsum("kgn,nkd->kgd", p, vv) / p.sum(-1)[..., None]
    return out.reshape(len(tokens), nh * hd)
