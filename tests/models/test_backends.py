"""Backend choice (jaxserve/models/backends.py): which kernels a ``kernels`` setting runs."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from jaxserve.config import ModelConfig
from jaxserve.models import backends


def _cfg(kernels: str) -> ModelConfig:
    base = ModelConfig.from_file(Path(__file__).resolve().parents[2] / "weights" / "default" / "config.json")
    return dataclasses.replace(base, kernels=kernels)


def test_jnp_never_and_auto_only_verified_kernels_on_a_gpu():
    for name in backends.KERNELS:
        assert not backends.use_kernel(_cfg("jnp"), name, True, "")
        # this machine has no GPU: auto is jnp whatever is verified
        assert not backends.use_kernel(_cfg("auto"), name, True, "")


@pytest.mark.parametrize("kernels", ["pallas", "pallas-interpret"])
def test_pallas_runs_every_kernel_and_refuses_a_misfit(kernels):
    for name in backends.KERNELS:
        assert backends.use_kernel(_cfg(kernels), name, True, "")
        with pytest.raises(ValueError, match=f"the {name} kernel does not take dk=32"):
            backends.use_kernel(_cfg(kernels), name, False, "dk=32")
    assert backends.interpret(_cfg(kernels)) == (kernels == "pallas-interpret")


def test_a_list_selects_kernels():
    cfg = _cfg("gdn_prefill,gdn_decode")
    assert backends.use_kernel(cfg, "gdn_prefill", True, "") and backends.use_kernel(cfg, "gdn_decode", True, "")
    assert not backends.use_kernel(cfg, "paged_attention", True, "")
    assert not backends.use_kernel(cfg, "paged_attention", False, "")  # not asked for: no error
    with pytest.raises(ValueError, match="comma-separated subset"):
        backends.validate("gdn_decode,flash")
    with pytest.raises(ValueError):
        backends.validate("")
