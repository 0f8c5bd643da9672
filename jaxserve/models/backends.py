"""Which implementation runs each mixer backend: a Pallas Mosaic GPU kernel or the jnp reference.

``ModelConfig.kernels`` (static under jit; ``--kernels`` on the CLI) decides for every kernel:

* ``"jnp"``: the pure-jnp references everywhere (the CPU path and the test oracle);
* ``"pallas"``: every kernel, on whatever device; a shape a kernel cannot take is an error at
  start-up (``EngineArgs`` checks), never a silent fallback;
* ``"pallas-interpret"``: the same, in Mosaic GPU's interpret mode (CPU tests of the wiring);
* ``"auto"`` (default): on a GPU, the kernels in ``AUTO_ON_GPU`` where the shapes fit; jnp elsewhere;
* a comma-separated list of kernel names (e.g. ``"gdn_decode,gdn_prefill"``): those kernels, as
  ``"pallas"`` would run them, and jnp for the rest.

``AUTO_ON_GPU`` lists a kernel only once its current version has passed ``benchmarks/gpu_check.py``
on the H200 and run the engine hammer with hit == cold (``scripts/device/verify_kernels.sh``;
results in ``benchmarks/RESULTS.md``), so the default serving path is always one that was
checked on the device. Kernel names: ``gdn_decode``, ``gdn_prefill``, ``paged_attention``.
"""

from __future__ import annotations

import jax

from jaxserve.config import ModelConfig

KERNELS = ("gdn_decode", "gdn_prefill", "paged_attention")
# None yet: the serving forms of the three kernels (2026-12-02) have run in interpret mode and
# lowered for sm_90 on the CPU, not on the H200.
AUTO_ON_GPU: frozenset[str] = frozenset()
CHOICES = ("auto", "jnp", "pallas", "pallas-interpret")


def validate(kernels: str) -> str:
    """``kernels`` if it is one of ``CHOICES`` or a list of ``KERNELS`` names, else ValueError."""
    if kernels in CHOICES or (kernels and set(kernels.split(",")) <= set(KERNELS)):
        return kernels
    raise ValueError(f"kernels={kernels!r}; choose one of {CHOICES} or a comma-separated subset of {KERNELS}")


def use_kernel(cfg: ModelConfig, name: str, fits: bool, shape: str) -> bool:
    """Static: run kernel ``name`` for this layer? ``fits``: the kernel takes the layer's shapes
    (``shape`` describes them for the error message)."""
    assert name in KERNELS, name
    kernels = validate(cfg.kernels)
    if kernels == "jnp":
        return False
    if kernels == "auto":
        return fits and name in AUTO_ON_GPU and jax.default_backend() == "gpu"
    if kernels not in ("pallas", "pallas-interpret") and name not in kernels.split(","):
        return False
    if not fits:
        raise ValueError(f"kernels={kernels!r}: the {name} kernel does not take {shape}")
    return True


def interpret(cfg: ModelConfig) -> bool:
    return cfg.kernels == "pallas-interpret"
