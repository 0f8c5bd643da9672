"""Mosaic GPU kernels lower to the same bytes every time, so the persistent compilation cache hits.

jaxlib 0.11's Mosaic GPU lowering (``jax.experimental.mosaic.gpu.core.lower_mgpu_module``) stamps
each kernel module with ``mosaic_gpu.dump_basename = "<kernel name>_<n>"``, ``n`` a per-process
counter of the kernels of that name lowered so far; the attribute is only the file name for
``MOSAIC_GPU_DUMP`` output, but it sits in the serialized kernel that JAX hashes into the
persistent-cache key and that Mosaic GPU dedupes compiled kernels by. So the same step program got
another key whenever it was lowered after another number of kernels: ``compile_all`` lowers the
programs on worker threads in whatever order they run, and on the H100 a restart of the server
loaded 0 of its 19 step programs from the cache (~110 s of compiling instead of seconds), and each
call site of a kernel with equal shapes compiled its own copy.

``install`` stamps the name without the counter first (the lowering keeps an existing stamp), so
a kernel's bytes depend only on what it computes. Dumps of kernels with one name then share a
file name, the price of that debugging aid.
"""

from __future__ import annotations

import threading

_ATTR = "mosaic_gpu.dump_basename"
_lock = threading.Lock()
_installed = False


def install() -> bool:
    """Make Mosaic GPU kernel lowering deterministic in this process (idempotent). False where the
    installed jax has no such stamp to fix (other versions: nothing to do)."""
    global _installed
    with _lock:
        if _installed:
            return True
        try:
            from jax.experimental.mosaic.gpu import core
            from jaxlib.mlir import ir
        except ImportError:
            return False
        stamp = getattr(core.dialect, "get_or_set_dump_options", None)
        if stamp is None:
            return False

        def stable_stamp(module):
            attrs = module.operation.attributes
            if _ATTR not in attrs:
                attrs[_ATTR] = ir.StringAttr.get(ir.StringAttr(attrs["sym_name"]).value)
            return stamp(module)

        core.dialect.get_or_set_dump_options = stable_stamp
        _installed = True
        return True
