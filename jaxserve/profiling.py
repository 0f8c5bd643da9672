"""Where a jitted step's GPU time goes, by kernel: per-kernel durations of a few calls through the
CUPTI hooks of JAX's Mosaic GPU extension (no profiler plugin, no trace files to parse).

Used by ``benchmarks/kernels.py`` (kernel timings and breakdowns) and by the ground-truth trainer's
``--profile`` (``weights/groundtruth/train.py``). Off the GPU (or where the hooks fail) every
function returns None and the callers fall back to wall-clock time.
"""

from __future__ import annotations

from typing import Callable


def _cupti():
    try:
        from jax._src.lib import mosaic_gpu as lib

        return lib._mosaic_gpu_ext
    except Exception:  # noqa: BLE001 - no Mosaic GPU extension (a CPU-only jaxlib)
        return None


def kernel_timings(run: Callable[[], object], calls: int) -> list[list[tuple[str, float]]] | None:
    """``[(kernel name, ms), ...]`` for each of ``calls`` calls of ``run`` (which must block until
    its device work is done), all in one CUPTI session (attaching costs about a second). None if
    CUPTI is unavailable or the kernels do not split evenly into ``calls`` equal calls."""
    ext = _cupti()
    if ext is None:
        return None
    try:
        ext._cupti_init()
        try:
            for _ in range(calls):
                run()
        finally:
            timings = ext._cupti_get_timings(True)
    except Exception as e:  # noqa: BLE001
        print(f"  CUPTI unavailable ({type(e).__name__}: {e}); using wall-clock", flush=True)
        return None
    if not timings or len(timings) % calls:
        return None
    per = len(timings) // calls
    return [list(timings[c * per:(c + 1) * per]) for c in range(calls)]


def summarize(per_call: list[list[tuple[str, float]]], top: int = 6, divide: float = 1.0) -> dict:
    """Median over calls of the total kernel time and of each kernel name's time (summed within a
    call), divided by ``divide`` (e.g. steps per call): ``{"kernel_ms", "kernel_ms_spread",
    "kernels" (first 8 names, sorted), "kernel_breakdown_ms" (the ``top`` costliest)}``."""
    import numpy as np

    totals = [sum(t for _, t in call) / divide for call in per_call]
    by_name: dict[str, list[float]] = {}
    for call in per_call:
        per_name: dict[str, float] = {}
        for name, t in call:
            per_name[name] = per_name.get(name, 0.0) + t / divide
        for name, t in per_name.items():
            by_name.setdefault(name, []).append(t)
    costliest = sorted(((float(np.median(v)), n) for n, v in by_name.items()), reverse=True)[:top]
    return dict(kernel_ms=float(np.median(totals)), kernel_ms_spread=float(np.ptp(totals)),
                kernels=sorted(by_name)[:8], kernel_breakdown_ms={n: round(t, 5) for t, n in costliest})
