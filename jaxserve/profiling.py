"""Where a jitted step's GPU time goes, by kernel: per-kernel durations of a few calls through the
CUPTI hooks of JAX's Mosaic GPU extension (no profiler plugin, no trace files to parse).

Used by ``benchmarks/kernels.py`` (kernel timings and breakdowns) and by the ground-truth trainer's
``--profile`` (``weights/groundtruth/train.py``). Off the GPU (or where the hooks fail) every
function returns None and the callers fall back to wall-clock time.
"""

from __future__ import annotations

import re
from pathlib import Path
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


_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(\S+)\s+([\w\-]+)\(")
_COMPUTATION = re.compile(r"^\s*%?([\w.\-]+)\s.*\{\s*$")
_CALLS = re.compile(r"calls=%?([\w.\-]+)")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_SOURCE = re.compile(r'source_file="([^"]*)"\s+source_line=(\d+)')


_NOISE = re.compile(r"^(jit\(.*\)|vmap\(.*\)|while|body|cond|eval_jaxpr|_step\..*)$")


def _kernel_name(instruction: str) -> str:
    """The GPU kernel XLA emits for an HLO instruction is named after it with ``.`` as ``_``
    (``loop_add_fusion.17`` runs as ``loop_add_fusion_17``)."""
    return instruction.replace(".", "_")


def _op_tail(op_name: str) -> str:
    """A JAX op_name without its jit/vmap/loop wrappers, last three parts
    (``jit(_step)/moe/shared_expert/jit(silu)/mul`` -> ``moe/shared_expert/mul``): the model's
    named scopes and the primitive."""
    return "/".join([part for part in op_name.split("/") if not _NOISE.match(part)][-3:])


def hlo_sources(hlo_text: str, names) -> dict[str, str]:
    """For each kernel name of ``names`` that names an instruction of the optimised HLO text
    ``hlo_text`` (XLA names a fusion's kernel after the fusion; identical fusions share the first
    one's kernel), ``"<opcode> <shape> <file:line>: <op names inside>"``: which JAX operations a
    kernel of a breakdown runs (a fusion lists the distinct op names of its fused computation, at
    most six). cuBLAS/cuDNN kernels (named by the library) have no entry."""
    wanted, found, inside, comp = set(names), {}, {}, None
    lines = hlo_text.splitlines()
    for line in lines:  # op names of every computation's instructions, for the fusions' bodies
        c = _COMPUTATION.match(line)
        if c and "=" not in line.split("{")[0]:
            comp = c.group(1)
            inside[comp] = []
        elif comp is not None and (op := _OP_NAME.search(line)):
            tail = _op_tail(op.group(1))
            if tail not in inside[comp]:
                inside[comp].append(tail)
    for line in lines:
        m = _INSTR.match(line)
        name = m and _kernel_name(m.group(1))
        if not m or name not in wanted or name in found:
            continue
        src = _SOURCE.search(line)
        where = f" {Path(src.group(1)).name}:{src.group(2)}" if src else ""
        calls = _CALLS.search(line)
        ops = inside.get(calls.group(1), []) if calls else []
        if not ops and (op := _OP_NAME.search(line)):
            ops = [_op_tail(op.group(1))]
        found[name] = f"{m.group(3)} {m.group(2)}{where}: {', '.join(ops[:6])}"
    return found


def _scope(op_name: str) -> str:
    """The model scope of a JAX op_name: its named scopes without jit/vmap/loop wrappers and without
    the primitive, the first two (``jit(_step)/while/body/moe/shared_expert/dot_general`` ->
    ``moe/shared_expert``); ``(top)`` for an op outside every scope."""
    parts = [part for part in op_name.split("/") if not _NOISE.match(part)][:-1]
    return "/".join(parts[:2]) or "(top)"


def scope_totals(hlo_text: str, per_call: list[list[tuple[str, float]]]) -> dict[str, dict]:
    """Every kernel of a profile (``kernel_timings``) charged to one model scope (``_scope``), so a
    step's time reads as "MoE 41 %, sampling 3 %" rather than by kernel: ``{scope: {"ms": median
    over calls of the scope's summed time, "kernels": its kernels per call}}``, costliest first.

    A kernel named after an instruction of the optimised HLO ``hlo_text`` (a fusion's kernel is)
    takes the most frequent scope among the instruction's op names (a fusion's: those of its fused
    computation). A Mosaic GPU kernel is charged to ``mosaic:<its kernel_name>``, other kernels no
    instruction names (cuBLAS, cub) to ``library:<the name's first 12 characters>``. Identical fusions share the first
    one's kernel name, so such a kernel is charged to the first fusion's scope."""
    import numpy as np

    comps, comp = {}, None
    own = {}
    for line in hlo_text.splitlines():
        c = _COMPUTATION.match(line)
        if c and "=" not in line.split("{")[0]:
            comp = c.group(1)
            comps[comp] = []
            continue
        op = _OP_NAME.search(line)
        if comp is not None and op:
            comps[comp].append(_scope(op.group(1)))
        m = _INSTR.match(line)
        if m:
            calls = _CALLS.search(line)
            scopes = comps.get(calls.group(1), []) if calls else []
            if not scopes and op:
                scopes = [_scope(op.group(1))]
            if scopes:
                own.setdefault(_kernel_name(m.group(1)), max(set(scopes), key=scopes.count))

    def scope_of(kernel: str) -> str:
        if kernel in own:
            return own[kernel]
        if "_mosaic_gpu" in kernel:  # our Pallas kernels, by their kernel_name
            return "mosaic:" + kernel.split("_mosaic_gpu")[0]
        return f"library:{kernel[:12]}"

    per_scope: dict[str, list[tuple[float, int]]] = {}
    for call in per_call:
        sums: dict[str, list] = {}
        for name, t in call:
            s = sums.setdefault(scope_of(name), [0.0, 0])
            s[0] += t
            s[1] += 1
        for scope, (t, n) in sums.items():
            per_scope.setdefault(scope, []).append((t, n))
    out = {s: {"ms": round(float(np.median([t for t, _ in v])), 5), "kernels": int(np.median([n for _, n in v]))}
           for s, v in per_scope.items()}
    return dict(sorted(out.items(), key=lambda kv: -kv[1]["ms"]))
