"""Load a Hugging Face checkpoint folder (config.json + safetensors) into the models' params pytree.

    model = load_model("path/to/Qwen3.5-0.8B", dtype="bfloat16")
    model.config, model.params

What it accepts: the folder ``save_pretrained`` writes, with ``model.safetensors`` or shards listed by
``model.safetensors.index.json`` (transformers' own preference order: the single file first).
Tensor names are mapped to the canonical names of ``jaxserve.models.params.hf_shapes``:
- the multimodal wrapper's ``model.language_model.`` becomes ``model.``;
- the vision tower (``model.visual.*``; older checkpoints' ``visual.*``) is loaded when config.json has
  a ``vision_config`` (``jaxserve.models.vision``); other vision tensors and multi-token-prediction
  (``mtp.*``) tensors are skipped, announced in ONE line on stderr, as are rotary ``inv_freq``
  buffers and an ``lm_head.weight`` that a tied config ignores (transformers ignores it too);
- per-expert MoE tensors ``mlp.experts.{j}.{gate,up,down}_proj.weight`` (what transformers v5
  ``save_pretrained`` writes for qwen3_5_moe and qwen3_next; it fuses them only in memory) are
  stacked into the fused ``mlp.experts.gate_up_proj`` [E, 2I, H] (gate rows, then up rows) and
  ``mlp.experts.down_proj`` [E, H, I]; checkpoints already holding the fused tensors pass through.

Invariants:
- All or nothing. Every name, shape and dtype is checked against ``hf_shapes(config)`` from the
  headers alone, before any tensor data is read, so every failure is one ``CheckpointError`` (or a
  ``ConfigError`` for config.json) naming the file and the tensor, never a KeyError, never a
  partly loaded model. Any tensor that is neither expected nor a known skippable kind is an error:
  it almost always means config.json and the weights disagree, and serving would silently drop it.
- One host copy at a time. Tensor data is read on demand, leaf by leaf, while ``build_params``
  builds the pytree, and each host array is freed once ``to_device`` has copied it; peak host
  memory is about one (stacked) leaf, not the model.
- Everything in the requested dtype (float32, bfloat16 or float16), including ``A_log`` and
  ``dt_bias``: one rule, no per-tensor exceptions to keep in sync with the models.

Why not ``safetensors.safe_open``: its numpy backend cannot return BF16 tensors (numpy has no
bfloat16; it raises TypeError), and ``framework="flax"`` would materialise every tensor on the
default JAX device in its stored dtype, before the host-side stacking, transposes and conversion
that loading needs. The safetensors format is deliberately trivial (8-byte little-endian header
length, a JSON header of ``{name: {dtype, shape, data_offsets}}``, then raw little-endian bytes), so
we parse the header ourselves and ``readinto`` each tensor's byte range, viewing BF16 through
``ml_dtypes.bfloat16`` (the type JAX itself uses). That is as lazy as safe_open (headers only until
a tensor is asked for), reads straight into an owned buffer, and never memory-maps a file that
could change under a live array.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import json
import os
import math
import re
import struct
import sys
from collections import Counter
from pathlib import Path
from typing import Any, Iterator, Mapping

import ml_dtypes
import numpy as np

from jaxserve.config import ModelConfig
from jaxserve.models.params import build_params, hf_shapes

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

# safetensors dtype tag -> numpy dtype (little-endian, as the format specifies).
_STORED_DTYPES = {
    "F32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F64": np.dtype("<f8"),
}
_TARGET_DTYPES = {np.dtype(np.float32), np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16)}

# Known kinds of tensors that jaxserve does not use: (prefixes or predicate, description).
_VISION_PREFIXES = ("model.visual.", "visual.", "model.vision_tower.", "vision_tower.")
_MTP_PREFIXES = ("mtp.", "model.mtp.")
_EXPERT_RE = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_PROGRESS_MIN_BYTES = 100 * 2**20


class CheckpointError(ValueError):
    """A checkpoint folder that cannot be loaded; the message names the folder or file and tensor."""


@dataclasses.dataclass(frozen=True)
class LoadedModel:
    config: ModelConfig
    params: dict  # pytree of jax arrays, all of ``dtype`` (layout: jaxserve.models.params.build_params)
    path: Path
    dtype: Any = None  # numpy dtype of every leaf


# -- safetensors headers --------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Entry:
    """One tensor in one file: where its bytes are and how to view them."""

    file: Path
    name: str  # name as stored in the file
    dtype_tag: str
    shape: tuple[int, ...]
    start: int  # absolute byte offsets in the file
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start

    def read(self) -> np.ndarray:
        """The tensor's bytes in an owned buffer (not ``bytearray(n)``, which zero-fills first), a
        large one read in ``_READ_PIECE`` pieces on ``_READERS`` threads: one thread copies ~2 GB/s
        out of the page cache, a fraction of what the host can move."""
        buf = np.empty(self.nbytes, np.uint8)
        fd = os.open(self.file, os.O_RDONLY)
        try:
            pieces = [(off, min(off + _READ_PIECE, self.nbytes)) for off in range(0, self.nbytes, _READ_PIECE)]
            read = lambda p: os.preadv(fd, [memoryview(buf)[p[0]:p[1]]], self.start + p[0]) == p[1] - p[0]  # noqa: E731
            complete = all(map(read, pieces)) if len(pieces) < 2 else all(_readers().map(read, pieces))
        finally:
            os.close(fd)
        if not complete:
            raise CheckpointError(f"{self.file}: tensor {self.name!r} is truncated (file shorter than its header says)")
        return buf.view(_STORED_DTYPES[self.dtype_tag]).reshape(self.shape)


_READ_PIECE = 32 << 20
_READERS = 8


@functools.lru_cache(maxsize=1)
def _readers() -> concurrent.futures.ThreadPoolExecutor:
    return concurrent.futures.ThreadPoolExecutor(_READERS, thread_name_prefix="checkpoint-read")


def _read_header(path: Path) -> dict[str, _Entry]:
    """Parse and sanity-check a safetensors header; no tensor data is read."""
    if not path.is_file():
        raise CheckpointError(f"{path}: no such file")
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise CheckpointError(f"{path}: not a safetensors file (shorter than its 8-byte header length)")
        (n,) = struct.unpack("<Q", head)
        if n > min(size - 8, 100 * 2**20):
            raise CheckpointError(f"{path}: not a safetensors file (header length {n} with file size {size})")
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{path}: not a safetensors file (header is not JSON: {e})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: not a safetensors file (header is not a JSON object)")
    header.pop("__metadata__", None)
    entries = {}
    for name, info in header.items():
        try:
            tag, shape, (start, end) = info["dtype"], tuple(int(d) for d in info["shape"]), info["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{path}: malformed header entry for tensor {name!r}: {info!r}") from None
        itemsize = _STORED_DTYPES[tag].itemsize if tag in _STORED_DTYPES else None
        if itemsize is not None and end - start != math.prod(shape) * itemsize:
            raise CheckpointError(
                f"{path}: tensor {name!r} has {end - start} bytes for shape {list(shape)} of {tag}"
            )
        if not 0 <= start <= end <= size - 8 - n:
            raise CheckpointError(f"{path}: tensor {name!r} lies outside the file (truncated download?)")
        entries[name] = _Entry(path, name, tag, shape, 8 + n + start, 8 + n + end)
    return entries


def _checkpoint_files(folder: Path) -> tuple[list[Path], dict[str, str] | None, Path | None]:
    """The safetensors files to read (and the index's weight_map, if sharded)."""
    if not folder.is_dir():
        raise CheckpointError(f"{folder}: no such checkpoint folder")
    if (folder / SINGLE_FILE).is_file():
        return [folder / SINGLE_FILE], None, None
    index_path = folder / INDEX_FILE
    if not index_path.is_file():
        found = sorted(p.name for p in folder.glob("*.safetensors"))
        raise CheckpointError(
            f"{folder}: no {SINGLE_FILE} or {INDEX_FILE}; not a Hugging Face safetensors checkpoint"
            + (f" (found {', '.join(found)})" if found else "")
        )
    try:
        weight_map = json.loads(index_path.read_text())["weight_map"]
        assert isinstance(weight_map, dict)
    except (json.JSONDecodeError, KeyError, TypeError, AssertionError):
        raise CheckpointError(f"{index_path}: not a safetensors index (needs a JSON object with 'weight_map')") from None
    shards = sorted(set(weight_map.values()))
    for shard in shards:
        if not (folder / shard).is_file():
            users = [k for k, v in weight_map.items() if v == shard]
            raise CheckpointError(
                f"{index_path}: names shard file {shard!r} (for {len(users)} tensors, e.g. {users[0]!r}), "
                f"which is not in {folder}"
            )
    return [folder / s for s in shards], weight_map, index_path


# -- name mapping -----------------------------------------------------------------------------------


def _skip_kind(name: str) -> str | None:
    if name.startswith(_VISION_PREFIXES):
        return "vision"
    if name.startswith(_MTP_PREFIXES):
        return "mtp"
    if name.endswith("rotary_emb.inv_freq"):
        return "buffer"
    return None


# Kimi-Linear's checkpoints (and transformers' save_pretrained of KimiLinear) name the MoE block
# ``block_sparse_moe`` and its experts' projections w1 (gate), w3 (up), w2 (down).
_KIMI_EXPERT_RE = re.compile(r"\.block_sparse_moe\.experts\.(\d+)\.w([123])\.weight$")
_KIMI_W = {"1": "gate_proj", "3": "up_proj", "2": "down_proj"}


def _canonical(name: str) -> str:
    for old, new in (("model.language_model.", "model."), ("language_model.model.", "model."),
                     ("language_model.lm_head.", "lm_head."), ("visual.", "model.visual.")):
        if name.startswith(old):
            name = new + name[len(old):]
            break
    if ".block_sparse_moe." in name:
        name = _KIMI_EXPERT_RE.sub(lambda m: f".block_sparse_moe.experts.{m[1]}.{_KIMI_W[m[2]]}.weight", name)
        name = name.replace(".block_sparse_moe.", ".mlp.")
    return name


_SKIP_NOTES = {
    "vision": "vision-tower tensors (config.json has no vision_config for them)",
    "mtp": "multi-token-prediction tensors (speculative decoding is not supported yet)",
    "buffer": "rotary inv_freq buffers (recomputed from the config)",
    "tied": "lm_head.weight (the config ties the output layer to embed_tokens, as transformers does)",
}


@dataclasses.dataclass
class _Source:
    """How to produce one canonical tensor: a single stored tensor, or per-expert tensors stacked
    along a new axis 0 and (for gate_up) concatenated along axis 1, in ``parts`` order."""

    shape: tuple[int, ...]
    parts: list[list[_Entry]]  # [group][expert]; one group of one entry for a plain tensor

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for g in self.parts for e in g)

    def load(self, dtype: np.dtype) -> np.ndarray:
        if len(self.parts) == 1 and len(self.parts[0]) == 1:
            return self.parts[0][0].read().astype(dtype, copy=False)
        out = np.empty(self.shape, dtype)
        row = 0
        for group in self.parts:
            rows = group[0].shape[0]
            for j, entry in enumerate(group):
                out[j, row : row + rows] = entry.read()  # casts to dtype on assignment
            row += rows
        return out


def _plan(folder: Path, expected: Mapping[str, tuple[int, ...]], tie_word_embeddings: bool) -> dict[str, _Source]:
    """Match the checkpoint's headers against ``expected``; raise on any mismatch; read no data."""
    files, weight_map, index_path = _checkpoint_files(folder)
    searched = ", ".join(f.name for f in files)
    stored: dict[str, _Entry] = {}
    for path in files:
        for name, entry in _read_header(path).items():
            if name in stored:
                raise CheckpointError(f"{folder}: tensor {name!r} is stored twice, in {stored[name].file.name} and {path.name}")
            stored[name] = entry
    if weight_map is not None:
        for name, shard in weight_map.items():
            if name not in stored or stored[name].file.name != shard:
                raise CheckpointError(f"{index_path}: lists tensor {name!r} in {shard}, which does not hold it")

    skipped: Counter[str] = Counter()
    sources: dict[str, _Source] = {}
    experts: dict[str, dict[tuple[str, int], _Entry]] = {}
    unexpected: list[_Entry] = []
    for raw, entry in stored.items():
        kind = _skip_kind(raw)
        if kind and not (kind == "vision" and _canonical(raw) in expected):
            skipped[kind] += 1
            continue
        name = _canonical(raw)
        m = _EXPERT_RE.match(name)
        if m and f"{m[1]}.gate_up_proj" in expected:
            experts.setdefault(m[1], {})[(m[3], int(m[2]))] = entry
            continue
        if name not in expected:
            if name == "lm_head.weight" and tie_word_embeddings:
                skipped["tied"] += 1
            else:
                unexpected.append(entry)
            continue
        if name in sources:
            raise CheckpointError(
                f"{folder}: tensor {name!r} is stored twice (as {sources[name].parts[0][0].name!r} and {raw!r})"
            )
        sources[name] = _Source(entry.shape, [[entry]])

    for prefix, parts in experts.items():
        fused_gate_up, fused_down = f"{prefix}.gate_up_proj", f"{prefix}.down_proj"
        if fused_gate_up in sources or fused_down in sources:
            raise CheckpointError(f"{folder}: {prefix} holds both fused and per-expert tensors")
        E = expected[fused_gate_up][0]
        missing = [f"{prefix}.{j}.{p}.weight" for j in range(E) for p in ("gate_proj", "up_proj", "down_proj")
                   if (p, j) not in parts]
        if missing:
            raise CheckpointError(
                f"{folder}: missing expert tensor {missing[0]!r} ({len(missing)} missing in {prefix}; "
                f"the config has {E} experts); searched {searched}"
            )
        unexpected += [e for (p, j), e in parts.items() if j >= E]
        gate, up, down = ([parts[(p, j)] for j in range(E)] for p in ("gate_proj", "up_proj", "down_proj"))
        sources[fused_gate_up] = _Source(expected[fused_gate_up], [gate, up])
        sources[fused_down] = _Source(expected[fused_down], [down])
        inter, hidden = expected[fused_down][2], expected[fused_down][1]
        for group, shape in ((gate, (inter, hidden)), (up, (inter, hidden)), (down, (hidden, inter))):
            for e in group:
                if e.shape != shape:
                    raise CheckpointError(
                        f"{e.file}: tensor {e.name!r} has shape {list(e.shape)}, expected {list(shape)} "
                        f"(from config.json)"
                    )

    missing = [name for name in expected if name not in sources]
    if missing:
        extra = f"; the checkpoint also holds {len(unexpected)} tensors the config does not use, e.g. {unexpected[0].name!r}" if unexpected else ""
        raise CheckpointError(
            f"{folder}: missing tensor {missing[0]!r} ({len(missing)} missing in all); searched {searched}{extra}"
        )
    if unexpected:
        e = unexpected[0]
        raise CheckpointError(
            f"{e.file}: unexpected tensor {e.name!r} ({len(unexpected)} in all) that the config does not account "
            f"for; config.json and the weights probably disagree (model_type, num_hidden_layers, layer_types, "
            f"tie_word_embeddings, num_experts?)"
        )
    for name, src in sources.items():
        if len(src.parts[0]) == 1 and len(src.parts) == 1:
            e = src.parts[0][0]
            if e.shape != tuple(expected[name]):
                raise CheckpointError(
                    f"{e.file}: tensor {e.name!r} has shape {list(e.shape)}, expected {list(expected[name])} "
                    f"(from config.json)"
                )
        for group in src.parts:
            for e in group:
                if e.dtype_tag not in _STORED_DTYPES:
                    raise CheckpointError(
                        f"{e.file}: tensor {e.name!r} is stored as {e.dtype_tag}; jaxserve reads "
                        f"{', '.join(_STORED_DTYPES)} (quantised checkpoints are not supported)"
                    )

    if skipped:
        notes = ", ".join(f"{n} {_SKIP_NOTES[k]}" for k, n in sorted(skipped.items()))
        print(f"jaxserve: {folder}: skipping {notes}", file=sys.stderr)
    return sources


def _target_dtype(dtype: Any) -> np.dtype:
    import jax.numpy as jnp

    try:
        d = np.dtype(jnp.dtype(dtype))
    except TypeError:
        d = None
    if d not in _TARGET_DTYPES:
        raise ValueError(f"dtype {dtype!r} is not supported; use float32, bfloat16 or float16")
    return d


def _progress_bar(total: int, enabled: bool, folder: Path):
    from tqdm import tqdm

    show = enabled and (total > _PROGRESS_MIN_BYTES or sys.stderr.isatty())
    return tqdm(total=total, unit="B", unit_scale=True, desc=f"loading {folder.name}", disable=not show,
                file=sys.stderr, leave=False)


class _LazyTensors(Mapping):
    """Canonical name -> host array, read and converted when first asked for (see the module's
    one-copy invariant); ``in`` looks at names only."""

    def __init__(self, sources: dict[str, _Source], dtype: np.dtype, bar):
        self._sources, self._dtype, self._bar = sources, dtype, bar

    def __getitem__(self, name: str) -> np.ndarray:
        src = self._sources[name]
        arr = src.load(self._dtype)
        self._bar.update(src.nbytes)
        return arr

    def __contains__(self, name: object) -> bool:
        return name in self._sources

    def __iter__(self) -> Iterator[str]:
        return iter(self._sources)

    def __len__(self) -> int:
        return len(self._sources)


def load_tensors(
    folder: str | Path, expected: Mapping[str, tuple[int, ...]], dtype: Any = "float32", *,
    tie_word_embeddings: bool = False,
) -> dict[str, np.ndarray]:
    """Every tensor of ``expected`` (canonical names, e.g. ``hf_shapes(cfg)``), read from the folder's
    safetensors, mapped and stacked as the module describes, as host arrays of ``dtype``.
    ``tie_word_embeddings`` lets a stored ``lm_head.weight`` be ignored. Loads everything at once;
    ``load_model`` streams instead."""
    folder = Path(folder)
    target = _target_dtype(dtype)
    sources = _plan(folder, expected, tie_word_embeddings)
    return {name: src.load(target) for name, src in sources.items()}


def check_checkpoint(path: str | Path) -> ModelConfig:
    """The config of the checkpoint folder ``path`` after the checks ``load_model`` makes before it
    reads a weight (config.json, every expected tensor's file, name and shape in the headers):
    raises ``CheckpointError`` as ``load_model`` would, at once, reading no weight data. For a
    caller that loads in the background (``jaxserve.engine.llm.build_engine``)."""
    folder = Path(path)
    if not folder.is_dir():
        raise CheckpointError(f"{folder}: no such checkpoint folder")
    cfg = ModelConfig.from_file(folder / "config.json")
    _plan(folder, hf_shapes(cfg), cfg.tie_word_embeddings)
    return cfg


def put_permuted(a: np.ndarray, dtype: np.dtype):
    """``jax.device_put(np.asarray(a, dtype))`` for ``a`` a view of a C-contiguous buffer with its
    axes permuted (a transposed weight, ``build_params``'s [in, out] layout): the buffer goes to the
    device as stored and the axes are permuted there. A host transpose is a strided copy on one
    core: laying out the real-size qwen3_5_moe's 12.6 GB that way took most of a minute."""
    import jax

    a = np.asarray(a)
    if a.ndim >= 2 and not a.flags.c_contiguous:
        order = tuple(int(i) for i in np.argsort(a.strides, kind="stable")[::-1])  # storage order, outermost first
        stored = a.transpose(order)
        if stored.flags.c_contiguous:
            return _permute(jax.device_put(stored.astype(dtype, copy=False)), tuple(int(i) for i in np.argsort(order)))
    return jax.device_put(np.asarray(a, dtype))


@functools.lru_cache(maxsize=None)
def _permute_fn(axes: tuple[int, ...]):
    import jax
    import jax.numpy as jnp

    return jax.jit(lambda x: jnp.transpose(x, axes))


def _permute(x, axes: tuple[int, ...]):
    return _permute_fn(axes)(x)


def load_model(path: str | Path, dtype: Any = "float32", progress: bool = True, tensor_parallel=None,
               stacked: bool = False) -> LoadedModel:
    """Load config.json and the weights of a checkpoint folder; params are device arrays of ``dtype``
    ("float32", "bfloat16", "float16" or the matching jnp/numpy dtype) on JAX's default device, or,
    with ``tensor_parallel`` (``jaxserve.parallel.tensor.TensorParallel``), split over its mesh; the
    config is then the one the split model runs (``TensorParallel.configure``).

    ``stacked``: the params in the decoder's stacked layout (``decoder.stack_layers``; the serving
    engine's), else the list layout. On one device the layers are stacked leaf by leaf on the
    device, each source deleted once its stack exists (``decoder.stack_deleting``: at most one
    stacked leaf beside the model); under tensor parallelism on the host, before placement."""
    from jaxserve.models import decoder

    folder = Path(path)
    if not folder.is_dir():
        raise CheckpointError(f"{folder}: no such checkpoint folder")
    cfg = ModelConfig.from_file(folder / "config.json")
    target = _target_dtype(dtype)
    sources = _plan(folder, hf_shapes(cfg), cfg.tie_word_embeddings)
    with _progress_bar(sum(s.nbytes for s in sources.values()), progress, folder) as bar:
        if tensor_parallel is None:  # transposes on the device (``put_permuted``)
            params = build_params(cfg, _LazyTensors(sources, target, bar), lambda a: put_permuted(a, target),
                                  contiguous=lambda a: a)
            if stacked:
                params = decoder.stack_layers(cfg, params, decoder.stack_deleting)
        else:  # host arrays first: the split layout is made on the host, then each device gets its share
            host = build_params(cfg, _LazyTensors(sources, target, bar), lambda a: np.asarray(a, target))
            if stacked:
                host = decoder.stack_layers(cfg, host, np.stack)
            split_cfg = tensor_parallel.configure(cfg)
            params = tensor_parallel.place(split_cfg, host, kv_heads=cfg.num_kv_heads)
            cfg = split_cfg
    return LoadedModel(config=cfg, params=params, path=folder, dtype=target)
