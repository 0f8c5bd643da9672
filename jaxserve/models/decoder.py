"""The decoder stack every supported family shares: embed -> layers -> norm -> lm_head.

Families differ only in config flags (see jaxserve/config.py): which layers are Gated DeltaNet and
which full attention, gated attention output and zero-centered norms for the hybrids, routed experts
for the MoE variants.

One stack, two ways to reach state:

- ``forward_ragged`` is the stack itself: a flat ragged batch of tokens whose state lives in pools
  (KV pages, linear-state slots) named by a ``layers.Ragged``. The serving runner calls it inside
  its jitted step.
- ``forward`` is the dense per-sequence API (tests, ``jaxserve generate``): ``tokens [B, T]`` with a
  state made by ``init_state`` where row ``b`` owns KV ``[b, 0:max_len]`` and slot ``b``. It views
  that state as pools (a reshape, no copy) and calls ``forward_ragged``, so the tested dense path
  and the serving path are the same code.

State (``Pools``) holds one array per kind, stacked over the layers of that kind (``layer_index``):
attention ``k``/``v`` [n_attn, pages, page_size, kv_heads, head_dim] (dense: [n_attn, B, max_len,
...]), GDN ``conv`` [n_linear, slots, conv_dim, K-1] and ``rec`` [n_linear, slots, Hv, dk, dv] fp32.
Stacking lets one scatter/gather address every layer (restore, snapshot checks) and lets the step
update pools in place when they are donated.

Params come in two layouts, and ``forward_ragged`` runs either with the same numbers:

- the list layout (``params["layers"]`` a list, one tree per layer: ``params.build_params``), which
  the tests, the ground-truth tools and the dense ``forward`` use; every layer is its own code in
  the program;
- the stacked layout (``stack_layers``, done once when the engine loads a model): ``layer_groups``
  splits the layers into a ``head`` run one by one, ``n`` repetitions of a ``period`` of P
  structurally identical consecutive layers (the hybrids' [GDN, GDN, GDN, attention]; P = 1 for
  an all-attention model), and a ``tail``. ``params["layers"]`` is then ``{"head": [...],
  "period": [P trees whose leaves have a leading axis of n], "tail": [...]}``, and the period runs
  as one ``lax.scan`` of n iterations (a known trip count): the program holds each distinct layer
  body once, so lowering and compiling do not grow with depth. Inside the body a decode step runs
  the P layers inline (no loop with a host-read predicate left in it); a step with prefill tokens
  still gives each of them its own ``_scoped`` loop (``_run_scan`` says why). Iteration g reads row
  g of each stacked weight (``_stacked_layer``): a dynamic slice, which XLA on the CPU lays out
  apart before a dot reads it (one layer's weights at a time, not the model's).
"""

from __future__ import annotations

import math
from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from jaxserve.config import LINEAR_ATTENTION, ModelConfig
from jaxserve.models import gated_deltanet
from jaxserve.models.layers import (KEY_BLOCK, Ragged, attention, linear, mlp, moe, rms_norm, small_linears,
                                    use_moe_kernel)
from pallas_kernels import token_segments


class Pools(NamedTuple):
    """Model state: KV for attention layers, conv + recurrent state for GDN layers (see module doc).
    A plain-attention model has zero GDN layers, so ``conv``/``rec`` are empty arrays."""

    k: jax.Array
    v: jax.Array
    conv: jax.Array
    rec: jax.Array


class Images(NamedTuple):
    """The image rows one forward scatters into its tokens (issue 25's windowed scatter).

    ``row[t]``: token t's row in ``embeds`` (-1: a text token, which keeps its embedding); the host
    picks the rows of the placeholders inside this forward's window, so a prompt's image embeddings
    reach the model chunk by chunk. ``embeds`` [N >= 1, H] (padding rows are never named);
    ``deepstack`` [k, N, H] is added at the image tokens after text layers 0..k-1 (Qwen3-VL; k may be
    0). ``rope_pos`` [T, 3]: every token's multimodal rotary position (t, h, w)."""

    row: jax.Array
    embeds: jax.Array
    deepstack: jax.Array
    rope_pos: jax.Array


def layer_index(cfg: ModelConfig) -> list[int]:
    """For each layer, its index among the layers of its kind (attention or GDN) in ``Pools``."""
    counts = {True: 0, False: 0}
    out = []
    for layer_type in cfg.layer_types:
        linear = layer_type == LINEAR_ATTENTION
        out.append(counts[linear])
        counts[linear] += 1
    return out


def num_layers_of_kind(cfg: ModelConfig) -> tuple[int, int]:
    """(attention layers, GDN layers)."""
    n_linear = sum(t == LINEAR_ATTENTION for t in cfg.layer_types)
    return cfg.num_layers - n_linear, n_linear


def pool_shapes(cfg: ModelConfig, dtype, kv_lead: tuple[int, int], num_slots: int) -> Pools:
    """``jax.ShapeDtypeStruct`` of every pool. ``kv_lead`` is (pages, page_size) for paged KV or
    (batch, max_len) for the dense state. The conv state keeps the model dtype (its inputs are
    model-dtype activations, so nothing is lost); the recurrent state is fp32 (it accumulates)."""
    n_attn, n_linear = num_layers_of_kind(cfg)
    k = jax.ShapeDtypeStruct((n_attn, *kv_lead, cfg.num_kv_heads, cfg.head_dim), dtype)
    v = jax.ShapeDtypeStruct((n_attn, *kv_lead, cfg.num_kv_heads, cfg.value_head_dim), dtype)  # MLA: != k's
    conv, rec = gated_deltanet.state_shapes(cfg, n_linear, num_slots if n_linear else 0)
    return Pools(k, v, jax.ShapeDtypeStruct(conv, dtype), jax.ShapeDtypeStruct(rec, jnp.float32))


def zeros(shapes: Pools) -> Pools:
    return Pools(*(jnp.zeros(s.shape, s.dtype) for s in shapes))


def init_state(cfg: ModelConfig, batch: int, max_len: int, dtype) -> Pools:
    """Empty dense state for ``batch`` sequences of at most ``max_len`` tokens each."""
    return zeros(pool_shapes(cfg, dtype, (batch, max_len), batch))


class LayerGroups(NamedTuple):
    """How the stacked layout splits the layers: ``prefix`` layers run one by one, then ``repeats``
    repetitions of ``period`` consecutive layers run as one scan, then the rest one by one.
    ``repeats == 0`` (``period == 0``): nothing is scanned."""

    prefix: int
    period: int
    repeats: int

    @property
    def scanned(self) -> int:
        return self.period * self.repeats

    @property
    def tail_start(self) -> int:
        return self.prefix + self.scanned


def layer_signatures(cfg: ModelConfig, layers: list | None = None) -> list:
    """Per layer, what must be equal for two layers to share one scan body: the layer type, MoE
    or dense MLP and, given the list-layout ``layers``, the param tree's structure and every
    leaf's shape and dtype (which the config already fixes for every loader in the repo)."""
    sigs = []
    for i, layer_type in enumerate(cfg.layer_types):
        tree = None
        if layers is not None:
            leaves, treedef = jax.tree.flatten(layers[i])
            tree = (treedef, tuple((tuple(a.shape), jnp.dtype(a.dtype)) for a in leaves))
        sigs.append((layer_type, bool(cfg.moe_layers[i]), tree))
    return sigs


def find_groups(signatures: list) -> LayerGroups:
    """The ``LayerGroups`` that scans the most layers (``period * repeats``, with ``repeats >= 2``)
    such that each of the ``repeats`` runs of ``period`` layers has the same signatures; ties go
    to the shorter period (a smaller body), then the earlier start. None: ``LayerGroups(L, 0, 0)``."""
    L = len(signatures)
    best = LayerGroups(L, 0, 0)
    for period in range(1, L // 2 + 1):
        for start in range(0, L - 2 * period + 1):
            body = signatures[start:start + period]
            n = 1
            while start + (n + 1) * period <= L and signatures[start + n * period:start + (n + 1) * period] == body:
                n += 1
            if n >= 2 and n * period > best.scanned:
                best = LayerGroups(start, period, n)
    return best


def layer_groups(cfg: ModelConfig, layers: list | None = None) -> LayerGroups:
    """``find_groups`` over ``layer_signatures`` (pure: a function of the config and the shapes)."""
    return find_groups(layer_signatures(cfg, layers))


def is_stacked(params: dict) -> bool:
    """Whether ``params`` has the stacked layout (``stack_layers``) rather than the list one."""
    return isinstance(params["layers"], dict)


def stack_layers(cfg: ModelConfig, params: dict, stack=None) -> dict:
    """``params`` (list layout) in the stacked layout (module doc); unchanged when ``layer_groups``
    finds no repetition. ``stack(leaves) -> array`` joins one leaf of the ``repeats`` layers at one
    position of the period along a new leading axis (default ``jnp.stack``; numpy's on the host).
    It is called leaf by leaf and each source list is dropped right after, so a caller that frees
    its sources in ``stack`` (``stack_deleting``) holds at most one stacked leaf twice. Done once at
    load time: stacking inside a step would copy every weight every step."""
    stack = stack or jnp.stack
    layers = params["layers"]
    groups = layer_groups(cfg, layers)
    if groups.repeats < 2:
        return params
    period = []
    for k in range(groups.period):
        members = [layers[groups.prefix + g * groups.period + k] for g in range(groups.repeats)]
        flat = [jax.tree.flatten(m)[0] for m in members]
        treedef = jax.tree.structure(members[0])
        stacked = []
        for leaf in range(len(flat[0])):
            stacked.append(stack([f[leaf] for f in flat]))
            for f in flat:
                f[leaf] = None
        period.append(jax.tree.unflatten(treedef, stacked))
    grouped = {"head": list(layers[:groups.prefix]), "period": period, "tail": list(layers[groups.tail_start:])}
    return {**params, "layers": grouped}


def stack_deleting(leaves: list[jax.Array]) -> jax.Array:
    """``jnp.stack`` of device arrays that deletes them once the stack exists: device memory holds
    at most one stacked leaf beside the model while ``stack_layers`` runs."""
    out = jnp.stack(leaves)
    out.block_until_ready()
    for a in leaves:
        a.delete()
    return out


def stack_structs(leaves: list) -> jax.ShapeDtypeStruct:
    """``stack`` for ``stack_layers`` over ``jax.ShapeDtypeStruct`` params (``params.abstract_params``):
    the stacked leaf's struct, for compiling step programs of a model too large to hold."""
    return jax.ShapeDtypeStruct((len(leaves), *leaves[0].shape), leaves[0].dtype)


def stacked_groups(params: dict) -> LayerGroups:
    """The ``LayerGroups`` a stacked ``params`` was made with (read from its shapes)."""
    grouped = params["layers"]
    period = grouped["period"]
    repeats = jax.tree.leaves(period[0])[0].shape[0] if period else 0
    return LayerGroups(len(grouped["head"]), len(period), repeats)


def _layer_body(p: dict, cfg: ModelConfig, i: int, j, x: jax.Array, r: Ragged, pools: Pools, decode: bool):
    """One layer, ``p`` its weights. ``i`` (static) is a layer of this layer's structure (type and
    MLP kind are read from it); ``j`` (an int, or a traced int32 inside the scan) its index among
    the layers of its kind in the pools."""
    layer_type = cfg.layer_types[i]
    h = rms_norm(x, p["input_layernorm"], cfg.rms_norm_eps, cfg.zero_centered_norm)
    if layer_type == LINEAR_ATTENTION:
        with jax.named_scope("linear_attn"):  # names the ops in profiles (jaxserve.profiling.hlo_sources)
            h, conv, rec = gated_deltanet.gated_deltanet(p["linear_attn"], cfg, h, r, pools.conv, pools.rec, j, decode)
        pools = pools._replace(conv=conv, rec=rec)
    else:
        with jax.named_scope("self_attn"):
            h, k, v = attention(p["self_attn"], cfg, layer_type, h, r, pools.k, pools.v, j, decode)
        pools = pools._replace(k=k, v=v)
    x = x + h
    h = rms_norm(x, p["post_attention_layernorm"], cfg.rms_norm_eps, cfg.zero_centered_norm)
    with jax.named_scope("moe" if cfg.moe_layers[i] else "mlp"):
        h = moe(p["mlp"], cfg, h) if cfg.moe_layers[i] else mlp(p["mlp"], h)
    return x + h, pools


def _layer(p: dict, cfg: ModelConfig, i: int, j: int, x: jax.Array, r: Ragged, pools: Pools, decode: bool):
    # The layer's weights pass one barrier with its input, so nothing computed from weights alone
    # (ragged_dot's relaid-out expert weights, 384 MiB a layer at the real size) can be scheduled
    # before the previous layer is done and sit beside every other layer's: the real-size
    # qwen3_5_moe's 32-row decode step on the jnp MoE path needed 9.3 GiB of temporaries, 0.7 with it.
    p, x = jax.lax.optimization_barrier((p, x))
    if decode:
        p = small_linears(p, cfg, x.dtype)
    return _layer_body(p, cfg, i, j, x, r, pools, decode)


def _stacked_layer(period: list, cfg: ModelConfig, groups: LayerGroups, k: int, g: jax.Array, x: jax.Array, *,
                   r: Ragged, pools: Pools, decode: bool):
    """Layer ``k`` of the period in repetition ``g`` (traced) of the scan: its weights are row ``g``
    of the stacked leaves, its pool index ``layer_index`` of its first repetition plus ``g`` times
    the period's layers of its kind.

    The barrier of ``_layer``, moved from the weights to the row index: ``g`` passes it with the
    input, so the slice and everything computed from the weights alone wait for the previous
    layer (the same reason as ``_layer``'s), while the slice itself stays a view its consumers
    read (a sliced weight through a barrier would be materialised: a copy of every layer's weights
    every step)."""
    i = groups.prefix + k
    g, x = jax.lax.optimization_barrier((g, x))
    p = jax.tree.map(lambda a: lax.dynamic_index_in_dim(a, g, keepdims=False), period[k])
    if decode:  # the decode-step projection kernel reads the stack's row in place, as the MoE kernel below
        p = small_linears(p, cfg, x.dtype, stack=period[k], layer=g)
    if cfg.moe_layers[i] and not cfg.expert_parallel and use_moe_kernel(cfg, x.dtype):
        # The MoE kernel's weight operands are buffers of their own: a row of the stack would be
        # copied out every step. It gets the whole stack ([n * E, ...], a free reshape) and the row.
        stack = period[k]["mlp"]
        p = {**p, "mlp": {**p["mlp"], "stack_row": g,
                          **{w: stack[w].reshape(-1, *stack[w].shape[2:]) for w in ("gate_up", "down")}}}
    kinds = [t == LINEAR_ATTENTION for t in cfg.layer_types[groups.prefix:groups.prefix + groups.period]]
    j = layer_index(cfg)[i] + g * sum(kind == kinds[k] for kind in kinds)
    return _layer_body(p, cfg, i, j, x, r, pools, decode)


def _scoped(layer, once: jax.Array, x: jax.Array, pools: Pools):
    """``layer(x, pools=pools)`` as the body of a loop that runs ``once`` (1, hidden from XLA
    behind an optimization barrier, so the loop is not inlined), for the unscanned layers of the
    steps with prefill tokens (every layer of the list layout; the head and tail of the stacked one,
    whose scan body is a computation of its own already).

    Why: a loop body is a computation of its own, so nothing in one layer is merged with or
    scheduled beside another layer's work, and the step's temporaries are those of one layer at a
    time. Without it, XLA merges the identical constant buffers every layer's mixer starts from
    (the chunked delta rule's zero-filled chunk grids, its scan outputs) into one, gives each layer
    a private copy to write in place, and schedules all those copies before the first layer: in the
    real-size qwen3_5_moe (18 GDN layers) 27 of the 30 GiB an 8192-token step still needed on the
    CPU with the MoE and page-table fixes, growing with depth (benchmarks/RESULTS.md "Step memory";
    tests/engine/test_step_memory.py).
    ``x`` and the pools ride in the carry (the pools stay in place, as in ``paged_attention``).
    The cost: a loop with a runtime trip count (on a GPU, the host reads its predicate per layer).
    Decode steps, whose mixers start from no such constants, run the layers inline."""
    return lax.fori_loop(0, once, lambda _, carry: layer(carry[0], pools=carry[1]), (x, pools))


class _Deepstack(NamedTuple):
    """What adding ``images.deepstack`` after a layer needs (``forward_ragged``)."""

    is_image: jax.Array  # [T, 1]
    rows: jax.Array      # [T] image row of each token (clamped)
    stack: jax.Array     # [k, N, H]

    def after(self, i, x: jax.Array) -> jax.Array:
        """``x`` plus deepstack level ``i`` at the image tokens if ``i < k``; ``i`` may be traced
        (inside the scan): the level is read at a clamped index and masked."""
        k = self.stack.shape[0]
        if k == 0 or (isinstance(i, int) and i >= k):
            return x
        add = self.stack[jnp.minimum(i, k - 1)][self.rows].astype(x.dtype)
        return x + jnp.where(self.is_image & (i < k), add, 0)


def _run_list(layers: list, first: int, cfg: ModelConfig, x, r: Ragged, pools: Pools, decode: bool,
              deep: _Deepstack | None, once):
    """Layers ``first, first + 1, ...`` of the stack, one by one (the list layout's every layer)."""
    index = layer_index(cfg)
    for i, p in enumerate(layers, start=first):
        layer = partial(_layer, p, cfg, i, index[i], r=r, decode=decode)
        x, pools = layer(x, pools=pools) if decode else _scoped(layer, once, x, pools)
        if deep is not None:
            x = deep.after(i, x)
    return x, pools


def _run_scan(period: list, groups: LayerGroups, cfg: ModelConfig, x, r: Ragged, pools: Pools, decode: bool,
              deep: _Deepstack | None, once):
    """The scanned layers: ``groups.repeats`` iterations of the period's P layers. ``x`` and the
    pools ride in the carry (updated in place when donated); the stacked weights are closed over
    (loop invariants, indexed per iteration by ``_stacked_layer``).

    A step with prefill tokens still runs each layer of the body as ``_scoped``: the scan body is
    a computation of its own, but it holds P layers, and XLA schedules their mixers' constant
    copies and weight relayouts side by side in it (the real-size qwen3_5_moe's 512-token step:
    4.6 GiB of temporaries with the 4 layers inline in the body, 2.1 with each scoped, as with the
    list layout). Decode steps run the body's layers inline (``_scoped``'s doc)."""
    def body(carry, g):
        x, pools = carry
        for k in range(groups.period):
            layer = partial(_stacked_layer, period, cfg, groups, k, g, r=r, decode=decode)
            x, pools = layer(x, pools=pools) if decode else _scoped(layer, once, x, pools)
            if deep is not None:
                x = deep.after(groups.prefix + g * groups.period + k, x)
        return (x, pools), None

    (x, pools), _ = lax.scan(body, (x, pools), jnp.arange(groups.repeats, dtype=jnp.int32))
    return x, pools


def forward_ragged(params: dict, cfg: ModelConfig, tokens: jax.Array, r: Ragged, pools: Pools, *, decode: bool,
                   last_only: bool = True, images: Images | None = None):
    """The stack over a flat ragged batch: ``tokens [T]`` laid out as ``r`` says. Not jitted: it is
    traced inside the caller's jit. ``params`` in either layout (module doc). ``decode`` (static):
    every row has exactly one token, in row order (T == B), which selects the one-step recurrent
    GDN backend. ``images``: image rows to scatter and multimodal rotary positions (``Images``).
    Returns fp32 logits of each row's last token [B, V] (``last_only``; rows without tokens give
    garbage) or of every token [T, V], and the updated pools."""
    x = params["embed"][tokens]
    deep = None
    if images is not None:
        is_image = (images.row >= 0)[:, None]
        rows = jnp.maximum(images.row, 0)
        x = jnp.where(is_image, images.embeds[rows].astype(x.dtype), x)
        r = r._replace(rope_pos=images.rope_pos)
        deep = _Deepstack(is_image, rows, images.deepstack)
    once = None if decode else lax.optimization_barrier(jnp.int32(1))  # opaque to XLA: see _scoped
    if is_stacked(params):
        grouped, groups = params["layers"], stacked_groups(params)
        x, pools = _run_list(grouped["head"], 0, cfg, x, r, pools, decode, deep, once)
        x, pools = _run_scan(grouped["period"], groups, cfg, x, r, pools, decode, deep, once)
        x, pools = _run_list(grouped["tail"], groups.tail_start, cfg, x, r, pools, decode, deep, once)
    else:
        x, pools = _run_list(params["layers"], 0, cfg, x, r, pools, decode, deep, once)
    if last_only:
        x = x[jnp.maximum(r.cu_seqlens[1:] - 1, 0)]
    x = rms_norm(x, params["norm"], cfg.rms_norm_eps, cfg.zero_centered_norm)
    with jax.named_scope("lm_head"):
        if cfg.tie_word_embeddings:
            return (x @ params["embed"].T).astype(jnp.float32), pools
        # a few rows (each row's last token): the decode-step projection kernel where it is chosen
        return linear(x, small_linears({"w": params["lm_head"]}, cfg, x.dtype)).astype(jnp.float32), pools


def make_ragged(positions, cu_seqlens, context_len, page_table, read_slot, write_slot,
                snap_seq=None, snap_len=None, snap_dst=None) -> Ragged:
    """A ``Ragged`` with each token's row derived from ``cu_seqlens`` (no snapshots if None)."""
    seq, _ = token_segments(cu_seqlens, positions.shape[0])
    if snap_seq is None:
        snap_seq = snap_len = snap_dst = jnp.zeros((0,), jnp.int32)
    return Ragged(positions, cu_seqlens, seq, context_len, page_table, read_slot, write_slot,
                  snap_seq, snap_len, snap_dst)


@partial(jax.jit, static_argnames=("cfg", "last_only"), donate_argnames=("state",))
def forward(params: dict, cfg: ModelConfig, tokens: jax.Array, positions: jax.Array, state: Pools,
            last_only: bool = False, images: Images | None = None):
    """Run ``tokens`` [B, T] at absolute ``positions`` [B, T] (consecutive per row, continuing
    where ``state`` left off). ``images``: as ``forward_ragged`` takes them, with ``row`` [B, T] and
    ``rope_pos`` [B, T, 3]. Returns fp32 logits [B, T, V] (or [B, V] with ``last_only``) and
    the new state. ``state`` is donated: the caller must use the returned one.

    The dense state viewed as pools: row ``b``'s KV ``[b, 0:max_len]`` is pages
    ``b * max_len / ps + [0, max_len / ps)`` with ``ps = gcd(max_len, 64)`` (so key blocks are
    whole pages); its GDN state is slot ``b``, read and written in place.
    """
    B, T = tokens.shape
    n_attn, _ = num_layers_of_kind(cfg)
    _, _, max_len, kvh, hd = state.k.shape
    ps = math.gcd(max_len, KEY_BLOCK)
    per_row = max_len // ps
    width = -(-per_row // (KEY_BLOCK // ps)) * (KEY_BLOCK // ps)
    cols = jnp.arange(width, dtype=jnp.int32)
    page_table = jnp.where(cols < per_row, jnp.arange(B, dtype=jnp.int32)[:, None] * per_row + cols, 0)
    rows = jnp.arange(B, dtype=jnp.int32)
    r = make_ragged(positions.reshape(-1).astype(jnp.int32), jnp.arange(B + 1, dtype=jnp.int32) * T,
                    positions[:, 0].astype(jnp.int32), page_table, rows, rows)
    paged = state._replace(k=state.k.reshape(n_attn, B * per_row, ps, kvh, hd),
                           v=state.v.reshape(n_attn, B * per_row, ps, kvh, state.v.shape[-1]))
    if images is not None:
        images = images._replace(row=images.row.reshape(-1), rope_pos=images.rope_pos.reshape(-1, 3))
    logits, paged = forward_ragged(params, cfg, tokens.reshape(-1), r, paged, decode=T == 1, last_only=last_only,
                                   images=images)
    new_state = paged._replace(k=paged.k.reshape(state.k.shape), v=paged.v.reshape(state.v.shape))
    return (logits if last_only else logits.reshape(B, T, -1)), new_state
