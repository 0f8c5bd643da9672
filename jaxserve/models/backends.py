"""Which implementation runs each mixer backend: a Pallas Mosaic GPU kernel or the jnp reference.

``ModelConfig.kernels`` (static under jit; ``--kernels`` on the CLI) decides for every kernel:

* ``"jnp"``: the pure-jnp references everywhere (the CPU path and the test oracle);
* ``"pallas"``: every kernel but the ``BY_NAME_ONLY`` ones, on whatever device; a shape a kernel
  cannot take is an error at start-up (``EngineArgs`` checks), never a silent fallback;
* ``"pallas-interpret"``: the same, in Mosaic GPU's interpret mode (CPU tests of the wiring);
* ``"auto"`` (default): on a GPU, the kernels in ``AUTO_ON_GPU`` where the shapes fit and the
  kernel is no less precise than the jnp path would be (``auto_ok``); jnp elsewhere;
* a comma-separated list of kernel names (e.g. ``"gdn_decode,gdn_prefill"``): those kernels, as
  ``"pallas"`` would run them, and jnp for the rest; with the prefix ``"interpret:"`` (e.g.
  ``"interpret:prefill_fused"``) the listed kernels run in interpret mode.

Three names are three implementations of one backend, the chunked delta rule of prefill steps:
``gdn_prefill`` (XLA UT transform + the recurrence kernel, ``pallas_kernels/gdn_chunked.py``),
``prefill_prep`` (the UT transform by a kernel parallel over the chunks, ``gdn_chunk_prep``, then the
recurrence kernel carrying the state as stored, so no transposes around it; GDN layers only, bf16
operands on the GPU) and ``prefill_fused`` (the whole
chunk in one kernel: ``gdn_chunk_fused`` for GDN layers, ``kda_chunk_fused`` for KDA layers).
``prefill_prep`` and ``prefill_fused`` are ``BY_NAME_ONLY``: ``"pallas"`` keeps the device-checked
``gdn_prefill``, and a list naming two of them is an error (``validate``).

``AUTO_ON_GPU`` lists a kernel only once its current version has passed ``benchmarks/gpu_check.py``
on an H200 or H100 and (the mixer kernels) run the engine hammer with hit == cold (``scripts/device/verify_kernels.sh``;
results in ``benchmarks/RESULTS.md``), so the default serving path is always one that was
checked on the device. Kernel names: ``gdn_decode``, ``gdn_prefill``, ``paged_attention``,
``conv1d`` (the GDN short conv, prefill and decode), ``moe`` (the routed experts of MoE layers: a
grouped GEMM over the experts the tokens use, and a gather path for a few tokens,
``pallas_kernels/moe.py``), ``prefill_fused`` (above; passed ``gpu_check --suites gdn_fused,kda_fused`` and the fp32 engine
hammer on the H100, but slower than ``gdn_prefill`` except on ragged 64k-token batches, so not in
``AUTO_ON_GPU``: benchmarks/RESULTS.md), ``prefill_prep`` (above; interpret-mode tests and the sm_90
lowering only: ``gpu_check --suites gdn_prep`` is owed), ``linear`` (a decode
step's dense projections that it tiles, up to 64 rows, one device: ``pallas_kernels/linear_small.py``;
passed ``gpu_check --suites linear`` on the H100, 60 / 60, and takes the real-size qwen3_5_moe's
batch-1 decode step from 5.10 to 3.78 ms: benchmarks/RESULTS.md).
"""

from __future__ import annotations

import jax

from jaxserve.config import ModelConfig

KERNELS = ("gdn_decode", "gdn_prefill", "paged_attention", "conv1d", "moe", "prefill_fused", "prefill_prep", "linear")
# 2026-12-02: gpu_check 26/26 on the H200, the engine hammer with the GDN kernels in
# fp32 (hit == cold) and with every kernel in bf16; speeds in benchmarks/RESULTS.md. conv1d joined
# 2026-12-03: gpu_check 7/7 (final and x64 snapshot conv states bit-exact, outputs
# 7e-8 relative in fp32), faster than XLA in every timed case (prefill 1.2-1.8x, update 2.3-2.5x),
# and the bf16 hammer with every kernel drifted no more than bf16 cold-vs-cold does (RESULTS.md, engine hammer).
# moe joined 2026-12-06: gpu_check 15/15 on the H100 (1 to 4096 tokens, random and skewed
# routing, the kernel's two ring depths and the gather path; closer to the float64 oracle than ragged_dot; deterministic),
# 1.1-23x faster than ragged_dot from 32 to 4096 tokens, and 1.36x decode tok/s for the real-size
# qwen3_5_moe in the engine at batch 1 (benchmarks/RESULTS.md "Serving"). No engine hammer on a
# MoE model yet.
# 2026-12-06: gdn_decode and paged_attention's read kernel now lower once per step program (the
# decode kernel on the pool's flat view with the layer folded into its slot ids, the read kernel with
# the layer as an operand, each through one jitted call); their kernel bodies did not change.
# Interpret-mode tests (runner hit == cold included) and the cuda lowering pass on the CPU; the GPU
# check and a decode-step memory check (no pool copy) are owed at the next device call.
AUTO_ON_GPU: frozenset[str] = frozenset({"gdn_decode", "gdn_prefill", "paged_attention", "conv1d", "moe", "linear"})
# Run only where named in a list (not under "pallas"): alternatives to a kernel "pallas" already runs,
# and linear, which is no mixer kernel: "pallas-interpret" (the engine's interpret-mode kernel cases)
# keeps testing the mixers without interpreting every projection of the model too.
BY_NAME_ONLY: frozenset[str] = frozenset({"prefill_fused", "prefill_prep", "linear"})
# Names of which a list may hold one: implementations of the same backend.
EXCLUSIVE: tuple[frozenset[str], ...] = (frozenset({"gdn_prefill", "prefill_fused", "prefill_prep"}),)
CHOICES = ("auto", "jnp", "pallas", "pallas-interpret")
INTERPRET_PREFIX = "interpret:"


def _listed(kernels: str) -> list[str] | None:
    """The kernel names of a list setting (``INTERPRET_PREFIX`` removed); None for a ``CHOICES`` one."""
    if kernels in CHOICES:
        return None
    return kernels.removeprefix(INTERPRET_PREFIX).split(",")


def validate(kernels: str) -> str:
    """``kernels`` if it is one of ``CHOICES`` or a list of ``KERNELS`` names (optionally behind
    ``INTERPRET_PREFIX``) holding at most one of each ``EXCLUSIVE`` group, else ValueError."""
    names = _listed(kernels)
    if names is None:
        return kernels
    if not set(names) <= set(KERNELS):
        raise ValueError(f"kernels={kernels!r}; choose one of {CHOICES} or a comma-separated subset of {KERNELS}, "
                         f"optionally behind {INTERPRET_PREFIX!r}")
    for group in EXCLUSIVE:
        if len(group & set(names)) > 1:
            raise ValueError(f"kernels={kernels!r}: {' and '.join(sorted(group))} implement the same backend; "
                             "name one")
    return kernels


def use_kernel(cfg: ModelConfig, name: str, fits: bool, shape: str, auto_ok: bool = True) -> bool:
    """Static: run kernel ``name`` for this layer? ``fits``: the kernel takes the layer's shapes
    (``shape`` describes them for the error message). ``auto_ok``: ``"auto"`` may pick it (False
    where the kernel would be less precise than what the user configured, e.g. tf32 products under
    ``jax_default_matmul_precision=highest``); an explicit choice still gets it."""
    assert name in KERNELS, name
    kernels = validate(cfg.kernels)
    names = _listed(kernels)
    if kernels == "jnp":
        return False
    if kernels == "auto":
        return fits and auto_ok and name in AUTO_ON_GPU and jax.default_backend() == "gpu"
    chosen = name not in BY_NAME_ONLY if names is None else name in names  # None: "pallas[-interpret]"
    if not chosen:
        return False
    if not fits:
        raise ValueError(f"kernels={kernels!r}: the {name} kernel does not take {shape}")
    return True


def interpret(cfg: ModelConfig) -> bool:
    """Static: the chosen kernels run in Mosaic GPU's interpret mode (on the CPU)."""
    return cfg.kernels == "pallas-interpret" or cfg.kernels.startswith(INTERPRET_PREFIX)
