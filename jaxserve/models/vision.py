"""The Qwen3.5 / Qwen3.5-MoE / Qwen3-VL vision tower as functional JAX: pixels -> soft tokens.

    inputs = tower_inputs(vcfg, grid, bucket)      # host: numpy indices and weights for one image
    embeds, deepstack = encode(params, vcfg, pixels_padded, levels, inputs)

Per image: the uint8 patches become the processor's float values on the device (a [C, 256] lookup,
``jaxserve.multimodal.preprocess.patch_values``); a patch embedding (the checkpoint's Conv3d, whose
kernel equals its stride, is one matmul over the flattened patch), plus the learned square position
table resampled bilinearly (align_corners) to the image's patch grid; ``depth`` pre-norm blocks
(LayerNorm, bidirectional attention with a 2-D rotary over the patch's (row, column), a tanh-GELU
MLP); then the merger: LayerNorm, ``spatial_merge_size**2`` neighbouring patches concatenated, a
GELU MLP to the text model's width. Qwen3-VL's deepstack mergers (a LayerNorm over the concatenated
patches instead) tap the blocks ``VisionConfig.deepstack_layers`` names.

Bounded compiles. Host code chooses, device code moves bytes: everything that depends on the
image's grid (the position table's taps and weights, the rotary positions, which rows are padding)
is computed by ``tower_inputs`` in numpy, so the jitted ``encode`` depends only on the padded patch
count: one program per power-of-two bucket (``bucket_patches``), not one per image size. Padding
patches are masked out of attention as keys (a real patch's output never depends on them), padding
rows form whole merge groups (buckets and images are multiples of ``merge**2`` patches), and their
soft tokens are never read. Patches arrive in merge-block order
(``jaxserve.multimodal.preprocess.patchify``), so every ``merge**2`` consecutive rows form one soft
token throughout. On the serving path the tower's output stays padded (``EncodedImage``) and a
step's image table is assembled by programs of fixed shapes (``step_image_table``), so a new image
size costs no compile once ``compile_buckets`` has run at start-up.
"""

from __future__ import annotations

import math
from functools import partial
from typing import Mapping, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.config import VisionConfig
from jaxserve.multimodal.preprocess import PixelPatches, patch_values

LAYER_NORM_EPS = 1e-6
PREFIX = "model.visual"


class TowerInputs(NamedTuple):
    """Per patch (padded to the bucket): bilinear taps into the flattened position table and their
    weights [P, 4], the (row, column) rotary position [P, 2], and whether the patch is real [P]."""

    taps: np.ndarray
    weights: np.ndarray
    rc: np.ndarray
    valid: np.ndarray


def _axis_taps(index: np.ndarray, size: int, side: int) -> tuple[np.ndarray, np.ndarray]:
    """Linear interpolation (align_corners) of ``size`` positions onto a ``side``-long table: two taps
    and weights per position, in float32 as transformers computes them."""
    src = index.astype(np.float32) * np.float32(side - 1) / np.float32(max(size - 1, 1))
    floor = np.floor(src)
    taps = np.clip(floor.astype(np.int64)[:, None] + np.arange(2), 0, side - 1)
    weights = np.clip(1 - np.abs(src[:, None] - floor[:, None] - np.arange(2, dtype=np.float32)), 0, None)
    return taps, weights.astype(np.float32)


def tower_inputs(vcfg: VisionConfig, grid: tuple[int, int, int], bucket: int | None = None) -> TowerInputs:
    """The grid-dependent inputs of ``encode`` for one image of ``grid`` (t, h, w) patches, padded
    to ``bucket`` patches (a multiple of ``merge**2``; default: no padding)."""
    t, h, w = grid
    m = vcfg.spatial_merge_size
    n = t * h * w
    bucket = n if bucket is None else bucket
    if bucket < n or bucket % (m * m):
        raise ValueError(f"bucket {bucket} must be a multiple of {m * m} holding {n} patches")
    within = np.arange(n) % (h * w)
    # Merge-block order: (block row, block column, row in block, column in block).
    in_col, in_row = within % m, (within // m) % m
    block_col, block_row = (within // (m * m)) % (w // m), within // (m * m * (w // m))
    row, col = block_row * m + in_row, block_col * m + in_col
    side = int(vcfg.num_position_embeddings**0.5)
    h_taps, h_w = _axis_taps(row, h, side)
    w_taps, w_w = _axis_taps(col, w, side)
    taps = (h_taps[:, :, None] * side + w_taps[:, None, :]).reshape(n, 4)
    weights = (h_w[:, :, None] * w_w[:, None, :]).reshape(n, 4)
    pad = bucket - n
    return TowerInputs(
        taps=np.pad(taps, ((0, pad), (0, 0))).astype(np.int32),
        weights=np.pad(weights, ((0, pad), (0, 0))),
        rc=np.pad(np.stack([row, col], -1), ((0, pad), (0, 0))).astype(np.int32),
        valid=np.arange(bucket) < n,
    )


# -- weights -----------------------------------------------------------------------------------------


def _linear(name: str, out_dim: int, in_dim: int) -> dict[str, tuple[int, ...]]:
    return {f"{name}.weight": (out_dim, in_dim), f"{name}.bias": (out_dim,)}


def _norm(name: str, dim: int) -> dict[str, tuple[int, ...]]:
    return {f"{name}.weight": (dim,), f"{name}.bias": (dim,)}


def _merger_shapes(name: str, vcfg: VisionConfig, postshuffle: bool) -> dict[str, tuple[int, ...]]:
    merged = vcfg.hidden_size * vcfg.spatial_merge_size**2
    return {**_norm(f"{name}.norm", merged if postshuffle else vcfg.hidden_size),
            **_linear(f"{name}.linear_fc1", merged, merged), **_linear(f"{name}.linear_fc2", vcfg.out_hidden_size, merged)}


def hf_shapes(vcfg: VisionConfig) -> dict[str, tuple[int, ...]]:
    """Every tower tensor a checkpoint must hold (canonical names, ``model.visual.*``), with its shape."""
    d, p = vcfg.hidden_size, vcfg.patch_size
    shapes = {f"{PREFIX}.patch_embed.proj.weight": (d, vcfg.in_channels, vcfg.temporal_patch_size, p, p),
              f"{PREFIX}.patch_embed.proj.bias": (d,),
              f"{PREFIX}.pos_embed.weight": (vcfg.num_position_embeddings, d)}
    for i in range(vcfg.depth):
        b = f"{PREFIX}.blocks.{i}"
        shapes.update({**_norm(f"{b}.norm1", d), **_norm(f"{b}.norm2", d), **_linear(f"{b}.attn.qkv", 3 * d, d),
                       **_linear(f"{b}.attn.proj", d, d), **_linear(f"{b}.mlp.linear_fc1", vcfg.intermediate_size, d),
                       **_linear(f"{b}.mlp.linear_fc2", d, vcfg.intermediate_size)})
    shapes.update(_merger_shapes(f"{PREFIX}.merger", vcfg, postshuffle=False))
    for j in range(len(vcfg.deepstack_layers)):
        shapes.update(_merger_shapes(f"{PREFIX}.deepstack_merger_list.{j}", vcfg, postshuffle=True))
    return shapes


def build_params(vcfg: VisionConfig, t: Mapping[str, np.ndarray], to_device) -> dict:
    """Canonical tower tensors (validated against ``hf_shapes``) -> the tower's pytree; linear
    weights [in, out], the patch Conv3d as one [C*tp*p*p, hidden] matmul."""

    def lin(name: str) -> dict:
        return {"w": to_device(np.ascontiguousarray(t[f"{name}.weight"].T)), "b": to_device(t[f"{name}.bias"])}

    def norm(name: str) -> dict:
        return {"w": to_device(t[f"{name}.weight"]), "b": to_device(t[f"{name}.bias"])}

    def merger(name: str) -> dict:
        return {"norm": norm(f"{name}.norm"), "fc1": lin(f"{name}.linear_fc1"), "fc2": lin(f"{name}.linear_fc2")}

    conv = t[f"{PREFIX}.patch_embed.proj.weight"]
    blocks = [{"norm1": norm(f"{PREFIX}.blocks.{i}.norm1"), "norm2": norm(f"{PREFIX}.blocks.{i}.norm2"),
               "qkv": lin(f"{PREFIX}.blocks.{i}.attn.qkv"), "proj": lin(f"{PREFIX}.blocks.{i}.attn.proj"),
               "fc1": lin(f"{PREFIX}.blocks.{i}.mlp.linear_fc1"), "fc2": lin(f"{PREFIX}.blocks.{i}.mlp.linear_fc2")}
              for i in range(vcfg.depth)]
    return {
        "patch": {"w": to_device(np.ascontiguousarray(conv.reshape(conv.shape[0], -1).T)),
                  "b": to_device(t[f"{PREFIX}.patch_embed.proj.bias"])},
        "pos_embed": to_device(t[f"{PREFIX}.pos_embed.weight"]),
        "blocks": blocks,
        "merger": merger(f"{PREFIX}.merger"),
        "deepstack": [merger(f"{PREFIX}.deepstack_merger_list.{j}") for j in range(len(vcfg.deepstack_layers))],
    }


# -- the tower ---------------------------------------------------------------------------------------


def _layer_norm(x: jax.Array, p: dict) -> jax.Array:
    xf = x.astype(jnp.float32)
    mean = jnp.mean(xf, -1, keepdims=True)
    var = jnp.mean(jnp.square(xf - mean), -1, keepdims=True)
    return ((xf - mean) * jax.lax.rsqrt(var + LAYER_NORM_EPS) * p["w"].astype(jnp.float32)
            + p["b"].astype(jnp.float32)).astype(x.dtype)


def _linear_apply(x: jax.Array, p: dict) -> jax.Array:
    return x @ p["w"] + p["b"]


def _rotate(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate-half over the whole head, in fp32 (as the tower does), back to x's dtype."""
    xf = x.astype(jnp.float32)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-xf[..., half:], xf[..., :half]], -1)
    return (xf * cos + rotated * sin).astype(x.dtype)


def _merge(x: jax.Array, p: dict, vcfg: VisionConfig, postshuffle: bool) -> jax.Array:
    merged = vcfg.hidden_size * vcfg.spatial_merge_size**2
    x = _layer_norm(x.reshape(-1, merged), p["norm"]) if postshuffle else _layer_norm(x, p["norm"]).reshape(-1, merged)
    return _linear_apply(jax.nn.gelu(_linear_apply(x, p["fc1"]), approximate=False), p["fc2"])


@partial(jax.jit, static_argnames=("vcfg",))
def encode(params: dict, vcfg: VisionConfig, pixels: jax.Array, levels: jax.Array, inputs: TowerInputs):
    """One image's uint8 patches ``pixels`` [P, C * p * p] (P a bucket, rows past the image are
    padding) and their ``levels`` [C, 256] -> soft tokens [P / merge², out_hidden] and deepstack
    features [len(deepstack_layers), P / merge², out_hidden], in the params' dtype. Rows from padding
    patches are garbage; drop them."""
    dtype = params["pos_embed"].dtype
    nh, hd = vcfg.num_heads, vcfg.head_dim
    x = _linear_apply(patch_values(pixels, levels, vcfg.temporal_patch_size).astype(dtype), params["patch"])
    pos = jnp.sum(params["pos_embed"][inputs.taps] * inputs.weights[..., None].astype(dtype), axis=1)
    x = x + pos
    inv_freq = 1.0 / (vcfg.rope_theta ** (jnp.arange(0, hd // 2, 2, dtype=jnp.float32) / (hd // 2)))
    freqs = inputs.rc.astype(jnp.float32)[..., None] * inv_freq  # [P, 2, hd/4]
    freqs = jnp.concatenate([freqs[:, 0], freqs[:, 1]], -1)
    freqs = jnp.concatenate([freqs, freqs], -1)[:, None, :]  # [P, 1, hd]
    cos, sin = jnp.cos(freqs), jnp.sin(freqs)
    mask = inputs.valid[None, None, :]
    deepstack = []
    for i, blk in enumerate(params["blocks"]):
        h = _layer_norm(x, blk["norm1"])
        q, k, v = jnp.split(_linear_apply(h, blk["qkv"]).reshape(-1, 3 * nh, hd), 3, axis=1)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        s = jnp.einsum("qhd,khd->hqk", q, k, preferred_element_type=jnp.float32) * hd**-0.5
        attn = jax.nn.softmax(jnp.where(mask, s, -jnp.inf), axis=-1)
        o = jnp.einsum("hqk,khd->qhd", attn.astype(v.dtype), v).reshape(-1, nh * hd)
        x = x + _linear_apply(o, blk["proj"])
        h = _layer_norm(x, blk["norm2"])
        act = jax.nn.gelu(_linear_apply(h, blk["fc1"]), approximate=vcfg.hidden_act == "gelu_pytorch_tanh")
        x = x + _linear_apply(act, blk["fc2"])
        if i in vcfg.deepstack_layers:
            j = vcfg.deepstack_layers.index(i)
            deepstack.append(_merge(x, params["deepstack"][j], vcfg, postshuffle=True))
    embeds = _merge(x, params["merger"], vcfg, postshuffle=False)
    deep = jnp.stack(deepstack) if deepstack else jnp.zeros((0, *embeds.shape), embeds.dtype)
    return embeds, deep


def bucket_patches(n: int, merge_size: int) -> int:
    """Padded patch count for ``n`` patches: the next power of two (at least one soft token), so a
    server compiles ``encode`` for a handful of sizes."""
    unit = merge_size**2
    return max(unit, 1 << max(n - 1, 0).bit_length())


def patch_buckets(max_patches: int, merge_size: int) -> tuple[int, ...]:
    """Every bucket an image of at most ``max_patches`` patches pads to, ascending."""
    top, bucket, out = bucket_patches(max_patches, merge_size), bucket_patches(1, merge_size), []
    while bucket <= top:
        out.append(bucket)
        bucket *= 2
    return tuple(out)


class EncodedImage(NamedTuple):
    """The tower's output for one image, padded to its bucket: ``embeds`` [R, H], ``deepstack``
    [k, R, H] with R = bucket / merge²; rows from ``tokens`` on are padding, never read."""

    embeds: jax.Array
    deepstack: jax.Array
    tokens: int


def encode_padded(params: dict, vcfg: VisionConfig, image: PixelPatches) -> EncodedImage:
    """One preprocessed image through ``encode`` at its bucket; the output stays padded."""
    n = image.pixels.shape[0]
    bucket = bucket_patches(n, vcfg.spatial_merge_size)
    inputs = tower_inputs(vcfg, image.grid, bucket)
    padded = np.pad(image.pixels, ((0, bucket - n), (0, 0)))
    embeds, deep = encode(params, vcfg, padded, image.levels, inputs)  # numpy in: a transfer, no program
    return EncodedImage(embeds, deep, n // vcfg.spatial_merge_size**2)


def encode_image(params: dict, vcfg: VisionConfig, image: PixelPatches) -> tuple[jax.Array, jax.Array]:
    """One preprocessed image -> (embeds [n, out_hidden], deepstack [k, n, out_hidden]), n its
    soft-token count (the straight-line path; serving keeps ``encode_padded``'s padding)."""
    out = encode_padded(params, vcfg, image)
    return out.embeds[:out.tokens], out.deepstack[:, :out.tokens]


def encode_images(params: dict, vcfg: VisionConfig, images) -> tuple[jax.Array, jax.Array]:
    """A prompt's images (``PixelPatches`` in prompt order) -> all their soft tokens [n, H] and
    deepstack features [k, n, H], concatenated: row j belongs to the prompt's j-th placeholder."""
    encoded = [encode_image(params, vcfg, im) for im in images]
    return jnp.concatenate([e for e, _ in encoded]), jnp.concatenate([d for _, d in encoded], axis=1)


# -- a serving step's image table --------------------------------------------------------------------

TABLE_BLOCK = 32  # rows of one block of a step's image table (the smallest step token bucket)


def table_block(rows: int) -> int:
    """The block size of a table of ``rows`` rows: ``TABLE_BLOCK``, or a divisor of ``rows`` for a
    step size that is not a multiple of it."""
    return math.gcd(rows, TABLE_BLOCK)


@partial(jax.jit, static_argnames=("rows", "depth", "width", "dtype"))
def _empty_block(rows: int, depth: int, width: int, dtype) -> tuple[jax.Array, jax.Array]:
    return jnp.zeros((rows, width), dtype), jnp.zeros((depth, rows, width), dtype)


@jax.jit
def _place_rows(block: tuple[jax.Array, jax.Array], embeds: jax.Array, deepstack: jax.Array, source: jax.Array,
                take: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Block row i becomes the image's row ``source[i]`` where ``take[i]``; the others are kept."""
    rows, deep = block
    return (jnp.where(take[:, None], embeds[source].astype(rows.dtype), rows),
            jnp.where(take[None, :, None], deepstack[:, source].astype(deep.dtype), deep))


@jax.jit
def _join(blocks: tuple) -> tuple[jax.Array, jax.Array]:
    return jnp.concatenate([e for e, _ in blocks]), jnp.concatenate([d for _, d in blocks], axis=1)


def step_image_table(params: dict, vcfg: VisionConfig, windows, rows: int) -> tuple[jax.Array, jax.Array]:
    """A step's image table (embeds [rows, H], deepstack [k, rows, H]) from ``windows``: (ImagePrompt,
    a, b) in the order the step's placeholders come, each naming the prompt's image rows [a, b)
    inside the step's token window. Table row j is the step's j-th placeholder; rows past them are
    zeros. Each prompt runs the tower once, the first time a window needs it, and keeps its padded
    output (``ImagePrompt.encoded``).

    Programs of fixed shapes only: the table is built in blocks of ``table_block(rows)`` rows, each
    filled from one padded image at a time (one program per image bucket), then joined (one program
    per step size), so a new image size within known buckets compiles nothing and start-up compiles
    buckets + step sizes programs, not their product."""
    if sum(b - a for _, a, b in windows) > rows:
        raise ValueError(f"{sum(b - a for _, a, b in windows)} image rows do not fit a table of {rows}")
    block = table_block(rows)
    zero = _empty_block(block, len(vcfg.deepstack_layers), vcfg.out_hidden_size, params["pos_embed"].dtype)
    blocks, offset = [zero] * (rows // block), 0
    for prompt, a, b in windows:
        if prompt.encoded is None:
            prompt.encoded = [encode_padded(params, vcfg, im) for im in prompt.images]
        for image, start, end in zip(prompt.encoded, prompt.image_starts[:-1], prompt.image_starts[1:]):
            lo, hi = max(a, int(start)), min(b, int(end))
            at = offset + lo - a  # the table row of image row lo
            for first in range(at - at % block, at + hi - lo, block) if lo < hi else ():
                rows_here = np.arange(first, first + block)
                take = (rows_here >= at) & (rows_here < at + hi - lo)
                source = np.where(take, rows_here - at + lo - int(start), 0).astype(np.int32)
                blocks[first // block] = _place_rows(blocks[first // block], image.embeds, image.deepstack, source,
                                                     take)
        offset += b - a
    return _join(tuple(blocks))


def _compile_encode(params: dict, vcfg: VisionConfig, bucket: int) -> jax.stages.Compiled:
    """``encode`` compiled ahead of time for images padded to ``bucket`` patches (nothing runs)."""
    m, channels = vcfg.spatial_merge_size, vcfg.in_channels
    pixels = jax.ShapeDtypeStruct((bucket, channels * vcfg.patch_size**2), jnp.uint8)
    levels = jax.ShapeDtypeStruct((channels, 256), jnp.float32)
    inputs = TowerInputs(*(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in tower_inputs(vcfg, (1, m, m), bucket)))
    return encode.lower(params, vcfg, pixels, levels, inputs).compile()


def encode_need_bytes(params: dict, vcfg: VisionConfig, max_patches: int) -> tuple[int, int] | None:
    """(bucket, bytes) the tower's largest program for images of at most ``max_patches`` patches
    needs beside its params: XLA's temporaries plus its outputs (from the compiled program's
    memory analysis; None where the backend gives none). The engine runs the tower between steps
    on the same stream, so start-up reserves the larger of this and the largest step's need, not
    their sum; the outputs are counted because they outlive the program until a step places them."""
    bucket = patch_buckets(max_patches, vcfg.spatial_merge_size)[-1]
    stats = _compile_encode(params, vcfg, bucket).memory_analysis()
    if stats is None:
        return None
    return bucket, int(stats.temp_size_in_bytes) + int(stats.output_size_in_bytes)


def compile_buckets(params: dict, vcfg: VisionConfig, max_patches: int, table_rows) -> int:
    """Compile every program an image of at most ``max_patches`` patches needs on the serving path:
    ``encode`` at each of its buckets (ahead of time, nothing runs: the largest bucket's attention is
    not allocated here) and the step table's programs (``step_image_table``) for each size in
    ``table_rows`` (the steps' token buckets) and each bucket. After it, no image request waits for
    a compile of the tower or its table. Returns the number of programs.

    An image the clamp lets through has at most ``max_pixels / patch_size**2`` patches (smart resize
    keeps the area under the bound), except a sliver whose short side was raised to one soft token:
    its bucket, if larger, compiles when it first comes."""
    m = vcfg.spatial_merge_size
    buckets = patch_buckets(max_patches, m)
    dtype = params["pos_embed"].dtype
    width, depth = vcfg.out_hidden_size, len(vcfg.deepstack_layers)
    programs = 0
    for bucket in buckets:
        _compile_encode(params, vcfg, bucket)
        programs += 1
    for block in sorted({table_block(rows) for rows in table_rows}):
        zero = _empty_block(block, depth, width, dtype)
        index = (jax.ShapeDtypeStruct((block,), np.int32), jax.ShapeDtypeStruct((block,), np.bool_))
        for bucket in buckets:
            image = (jax.ShapeDtypeStruct((bucket // m**2, width), dtype),
                     jax.ShapeDtypeStruct((depth, bucket // m**2, width), dtype))
            _place_rows.lower(zero, *image, *index).compile()
        programs += 1 + len(buckets)
    for rows in table_rows:
        zero = _empty_block(table_block(rows), depth, width, dtype)
        _join.lower((zero,) * (rows // table_block(rows))).compile()
        programs += 1
    return programs


def text_only(cfg, positions: jax.Array, delta: int, hidden: int, dtype):
    """``decoder.Images`` for tokens that carry no image (decode steps, text after the images):
    every token at ``positions + delta`` on all three rotary axes."""
    from jaxserve.models.decoder import Images

    k = len(cfg.vision.deepstack_layers) if cfg.vision else 0
    pos = (positions + delta).astype(jnp.int32)
    return Images(jnp.full(positions.shape, -1, jnp.int32), jnp.zeros((1, hidden), dtype),
                  jnp.zeros((k, 1, hidden), dtype), jnp.broadcast_to(pos[..., None], (*pos.shape, 3)))


def dense_images(params: dict, cfg, ids, images) -> tuple:
    """One prompt (placeholders already expanded) and its preprocessed images (``PixelPatches`` in
    prompt order) -> (``decoder.Images`` for ``decoder.forward`` over the whole prompt as [1, L],
    the rotary delta for the tokens after it)."""
    from jaxserve.models.decoder import Images
    from jaxserve.multimodal import prompt as mm

    vcfg = cfg.vision
    embeds, deep = encode_images(params["vision"], vcfg, images)
    places = mm.placeholder_positions(ids, vcfg.image_token_id)
    if len(places) != embeds.shape[0]:
        raise ValueError(f"{len(places)} image placeholders for {embeds.shape[0]} soft tokens")
    row = np.full(len(ids), -1, np.int32)
    row[places] = np.arange(len(places))
    pos, delta = mm.mrope_positions(ids, vcfg.image_token_id, [im.grid for im in images], vcfg.spatial_merge_size)
    return Images(jnp.asarray(row)[None], embeds, deep, jnp.asarray(pos)[None]), delta
