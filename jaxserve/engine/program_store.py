"""Compiled step programs kept on disk and loaded without tracing or lowering them again.

JAX's persistent compilation cache (``startup.enable_compile_cache``) saves a restart XLA's
compile, but a cache hit still traces and lowers the program to compute its key: for the real-size
model, with its Mosaic GPU kernels lowered in every program, that is most of a cached start. The
store keeps each program's serialized executable (``jax.experimental.serialize_executable``) and a
restart deserializes it (tenths of a second a program) instead.

Invariant: an entry is used only where the program it holds is the one this process would build.
Its key hashes everything a program is made from: the sources of ``jaxserve`` and
``pallas_kernels`` (any edit gives new keys), the JAX and jaxlib versions, the platform and its
devices, ``XLA_FLAGS`` and the other ``XLA_`` / ``JAX_`` variables, the JAX settings that change
what a program computes, and the caller's description of the program (its name, the model config,
the abstract arguments). Something outside that list that changes a program would make the store
serve a stale one: keep the list whole. An entry that fails to load (truncated, from another
build) is a miss: it is deleted and compiled again.

What is stored: executables XLA compiled in this process. One that JAX's persistent cache loaded
instead is stored only where the platform re-serializes a loaded executable whole
(``RESERIALIZES``): XLA:CPU does not (jaxlib 0.11.2: the reloaded program fails with "Function ...
not found", its split-out functions missing), so a program the cache served is left to the cache
(a fresh machine's first start compiles, and stores, every program). A compile counts as served by
the cache when JAX reported a cache hit on its thread while it ran.

Layout: ``root/<identity hash>/<program key>.bin`` with ``identity.json`` (what the hash covers,
for a reader). Only the ``KEEP_IDENTITIES`` most recently used identity folders stay: each edit of
the code starts a new one.
"""

from __future__ import annotations

import collections
import functools
import hashlib
import json
import os
import pickle
import shutil
import sys
import tempfile
import threading
from pathlib import Path

import jax
from jax.experimental import serialize_executable

KEEP_IDENTITIES = 4
# Platforms whose cache-loaded executables store whole: none shown yet (benchmarks/program_store_check.py
# --reserialize tests a platform; it fails on the CPU, the GPU is to be run).
RESERIALIZES: frozenset = frozenset()
_SOURCE_PACKAGES = ("jaxserve", "pallas_kernels")
_CONFIG_NAMES = ("jax_enable_x64", "jax_default_matmul_precision", "jax_default_prng_impl",
                 "jax_threefry_partitionable", "jax_numpy_rank_promotion")


@functools.cache
def source_hash() -> str:
    """sha256 over the path and bytes of every ``.py`` file of the packages programs are built from."""
    root = Path(__file__).resolve().parents[2]
    h = hashlib.sha256()
    for pkg in _SOURCE_PACKAGES:
        for path in sorted((root / pkg).rglob("*.py")):
            h.update(str(path.relative_to(root)).encode())
            h.update(path.read_bytes())
    return h.hexdigest()


def identity() -> dict:
    """What every program of this process shares: code, JAX, devices, flags."""
    import jaxlib

    devices = jax.devices()
    env = {k: v for k, v in sorted(os.environ.items()) if k.startswith(("XLA_", "JAX_"))}
    return {
        "sources": source_hash(),
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        "platform": devices[0].platform,
        "platform_version": devices[0].client.platform_version,
        "devices": [d.device_kind for d in devices],
        "processes": jax.process_count(),
        "env": env,
        "config": {name: str(getattr(jax.config, name, None)) for name in _CONFIG_NAMES},
    }


def describe_args(tree) -> str:
    """A text of ``tree``'s structure and each leaf's shape, dtype and sharding (arrays or
    ``ShapeDtypeStruct``s): the part of a program's key its arguments give."""
    leaves, treedef = jax.tree.flatten(tree)
    parts = [str(treedef)]
    for x in leaves:
        parts.append(f"{tuple(x.shape)}:{x.dtype}:{getattr(x, 'sharding', None)}")
    return "\n".join(parts)


class ProgramStore:
    """Serialized executables under ``root``, keyed by ``identity()`` and each program's own text.
    Thread-safe: ``load`` and ``save`` run from the compile workers."""

    def __init__(self, root: Path):
        ident = identity()
        self.platform = ident["platform"]
        blob = json.dumps(ident, sort_keys=True)
        self.dir = Path(root) / hashlib.sha256(blob.encode()).hexdigest()[:20]
        self.dir.mkdir(parents=True, exist_ok=True)
        (self.dir / "identity.json").write_text(json.dumps(ident, indent=1, sort_keys=True))
        self.loaded: collections.Counter = collections.Counter()  # by the description's first word ("step")
        self.saved = self.failed = self.left_to_cache = 0
        self._lock = threading.Lock()
        _prune(Path(root), keep=self.dir)

    @staticmethod
    def key(description: str) -> str:
        return hashlib.sha256(description.encode()).hexdigest()[:32]

    def load(self, description: str) -> jax.stages.Compiled | None:
        """The executable saved under ``description``, or None (never saved, or unusable: then the
        file is removed so that the next ``save`` replaces it)."""
        path = self.dir / f"{self.key(description)}.bin"
        try:
            blob = path.read_bytes()
        except OSError:  # not there (or the folder gone): a miss
            return None
        try:
            serialized, in_tree, out_tree = pickle.loads(blob)
            compiled = serialize_executable.deserialize_and_load(serialized, in_tree, out_tree)
        except Exception as e:  # noqa: BLE001 - a bad entry is a miss, never a failed start
            print(f"jaxserve: dropping an unusable stored program {path.name}: {e!r}", file=sys.stderr)
            path.unlink(missing_ok=True)
            with self._lock:
                self.failed += 1
            return None
        with self._lock:
            self.loaded[description.split(" ", 1)[0]] += 1
        return compiled

    def save(self, description: str, compiled: jax.stages.Compiled) -> None:
        """Write ``compiled`` under ``description`` (atomically: a reader sees all of it or none)."""
        try:
            blob = pickle.dumps(serialize_executable.serialize(compiled))
        except Exception as e:  # noqa: BLE001 - a program that cannot be serialized just is not stored
            print(f"jaxserve: not storing a program: {e!r}", file=sys.stderr)
            return
        path = self.dir / f"{self.key(description)}.bin"
        try:
            fd, tmp = tempfile.mkstemp(dir=self.dir, suffix=".tmp")
            with os.fdopen(fd, "wb") as f:
                f.write(blob)
            os.replace(tmp, path)
        except OSError as e:  # a full or read-only disk costs the next start its speed, not this one
            print(f"jaxserve: not storing a program in {self.dir}: {e!r}", file=sys.stderr)
            return
        with self._lock:
            self.saved += 1

    def clear(self) -> None:
        """Drop every program of this identity (the next load of each is a miss) and forget that any
        was loaded."""
        for entry in self.dir.glob("*.bin"):
            entry.unlink(missing_ok=True)
        with self._lock:
            self.loaded.clear()

    def get_or_compile(self, description: str, lower) -> jax.stages.Compiled:
        """The stored executable of ``description``, else ``lower().compile()`` (then stored, unless
        the persistent cache served it on a platform that cannot re-serialize it)."""
        compiled = self.load(description)
        if compiled is None:
            hits = getattr(_local, "hits", 0)
            compiled = lower().compile()
            if getattr(_local, "hits", 0) > hits and self.platform not in RESERIALIZES:
                with self._lock:
                    self.left_to_cache += 1
            else:
                self.save(description, compiled)
        return compiled


_local = threading.local()  # .hits: persistent-cache hits JAX reported on this thread


def _on_event(event: str, **_) -> None:
    if event == "/jax/compilation_cache/cache_hits":
        _local.hits = getattr(_local, "hits", 0) + 1


jax.monitoring.register_event_listener(_on_event)


def _prune(root: Path, keep: Path) -> None:
    """Remove all but the ``KEEP_IDENTITIES`` most recently used identity folders (``keep`` is one)."""
    os.utime(keep)
    folders = sorted((p for p in root.iterdir() if p.is_dir()), key=lambda p: p.stat().st_mtime, reverse=True)
    for old in folders[KEEP_IDENTITIES:]:
        if old != keep:
            shutil.rmtree(old, ignore_errors=True)


def open_store(root: Path | None) -> ProgramStore | None:
    """The store at ``root``, or None (no root, or a folder that cannot be made: said on stderr;
    the server then starts without it)."""
    if root is None:
        return None
    try:
        return ProgramStore(root)
    except OSError as e:
        print(f"jaxserve: no program store at {root} ({e!r}): every start compiles or loads JAX's cache",
              file=sys.stderr)
        return None


def store_dir(compile_cache: Path | None) -> Path | None:
    """Where the program store of a compile cache at ``compile_cache`` lives (a sibling folder:
    JAX's cache folder holds its own files only); None when the cache is off."""
    return None if compile_cache is None else compile_cache.with_name(compile_cache.name + "-programs")

