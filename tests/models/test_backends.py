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
def test_pallas_runs_every_kernel_but_the_by_name_ones_and_refuses_a_misfit(kernels):
    for name in backends.KERNELS:
        if name in backends.BY_NAME_ONLY:
            assert not backends.use_kernel(_cfg(kernels), name, True, "")
            assert not backends.use_kernel(_cfg(kernels), name, False, "dk=32")  # not chosen: no error
            continue
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


def test_two_prefill_kernels_exclude_each_other_and_interpret_prefix_lists():
    """``gdn_prefill`` and ``prefill_fused`` implement one backend: a list names at most one. The
    ``interpret:`` prefix runs a list in interpret mode and selects exactly the same kernels."""
    with pytest.raises(ValueError, match="implement the same backend"):
        backends.validate("gdn_prefill,conv1d,prefill_fused")
    for kernels in ("prefill_fused,conv1d", "interpret:prefill_fused,conv1d"):
        cfg = _cfg(kernels)
        assert backends.interpret(cfg) == kernels.startswith("interpret:")
        assert backends.use_kernel(cfg, "prefill_fused", True, "") and backends.use_kernel(cfg, "conv1d", True, "")
        assert not backends.use_kernel(cfg, "gdn_prefill", True, "")
        with pytest.raises(ValueError, match="the prefill_fused kernel does not take dk=32"):
            backends.use_kernel(cfg, "prefill_fused", False, "dk=32")
    for bad in ("interpret:", "interpret:pallas", "interpret:gdn_decode,flash"):
        with pytest.raises(ValueError, match="comma-separated subset"):
            backends.validate(bad)


@pytest.mark.parametrize("kda", [False, True])
def test_prefill_kernel_choice_for_gdn_and_kda_layers(kda):
    """The layer's prefill path: the fused kernel only where named (bf16 operands on the GPU, fp32
    in the interpreter, which has no SMEM limit), ``gdn_prefill`` under ``pallas``; naming the fused
    kernel for head dims it cannot take fails (the engine's start-up check calls this)."""
    from jaxserve.models import gated_deltanet

    base = dataclasses.replace(_cfg("jnp"), kda=kda, linear_key_head_dim=128, linear_value_head_dim=128)

    def pick(kernels, **shape):
        return gated_deltanet.prefill_kernel(dataclasses.replace(base, kernels=kernels, **shape))

    assert pick("jnp") is None and pick("auto") is None  # no GPU here
    assert pick("pallas") == pick("gdn_prefill") == "gdn_prefill"
    assert pick("prefill_fused") == pick("interpret:prefill_fused") == "prefill_fused"
    assert pick("gdn_decode,conv1d") is None
    assert gated_deltanet.use_prefill_kernel(dataclasses.replace(base, kernels="prefill_fused"))
    for kernels in ("prefill_fused", "interpret:prefill_fused"):
        with pytest.raises(ValueError, match="the prefill_fused kernel does not take dk=32, dv=128"):
            pick(kernels, linear_key_head_dim=32)
    with pytest.raises(ValueError, match="does not take dk=128, dv=96 with float32 operands"):
        pick("interpret:prefill_fused", linear_value_head_dim=96)
    # prefill_prep: GDN layers only; never under "pallas"; one of the three per list
    if kda:
        with pytest.raises(ValueError, match="the prefill_prep kernel does not take KDA"):
            pick("interpret:prefill_prep")
    else:
        assert pick("prefill_prep") == pick("interpret:prefill_prep,conv1d") == "prefill_prep"
        with pytest.raises(ValueError, match="the prefill_prep kernel does not take GDN dk=32"):
            pick("prefill_prep", linear_key_head_dim=32)
    with pytest.raises(ValueError, match="implement the same backend"):
        pick("gdn_prefill,prefill_prep")


def test_auto_on_a_gpu_takes_verified_kernels_unless_less_precise(monkeypatch):
    """On a GPU ``auto`` runs every kernel in AUTO_ON_GPU that fits; the prefill kernel's tf32
    products are left out when the user asked for full fp32 matmuls (an explicit choice keeps it)."""
    import jax

    from jaxserve.models import gated_deltanet

    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    auto = _cfg("auto")
    for name in backends.KERNELS:
        assert backends.use_kernel(auto, name, True, "") == (name in backends.AUTO_ON_GPU)
        assert not backends.use_kernel(auto, name, False, "")  # misfit under auto: jnp, no error
        assert not backends.use_kernel(auto, name, True, "", auto_ok=False)
    assert backends.use_kernel(_cfg("pallas"), "gdn_prefill", True, "", auto_ok=False)
    gdn = dataclasses.replace(auto, linear_key_head_dim=128, linear_value_head_dim=128)
    assert gated_deltanet.use_prefill_kernel(gdn) == ("gdn_prefill" in backends.AUTO_ON_GPU)
    with jax.default_matmul_precision("highest"):
        assert not gated_deltanet.use_prefill_kernel(gdn)
        assert gated_deltanet.use_prefill_kernel(dataclasses.replace(gdn, kernels="gdn_prefill"))


def test_conv1d_kernel_where_the_conv_dim_fits(monkeypatch):
    """conv1d passed gpu_check: ``auto`` picks it on a GPU where the channels fit its
    tiling, falls back to jnp where they do not; naming it on a misfit is an error."""
    import jax

    from jaxserve.models import gated_deltanet

    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert backends.AUTO_ON_GPU == {"gdn_decode", "gdn_prefill", "paged_attention", "conv1d", "moe", "linear"}
    cfg = dataclasses.replace(_cfg("auto"), linear_key_head_dim=64, linear_value_head_dim=64)
    assert cfg.linear_conv_dim % 128 == 0 and gated_deltanet.use_conv_kernel(cfg)
    assert not gated_deltanet.use_conv_kernel(dataclasses.replace(cfg, kernels="jnp"))
    assert gated_deltanet.use_conv_kernel(dataclasses.replace(cfg, kernels="conv1d"))
    assert not gated_deltanet.use_conv_kernel(dataclasses.replace(cfg, kernels="gdn_decode"))
    odd = dataclasses.replace(cfg, linear_key_head_dim=24)
    assert not gated_deltanet.use_conv_kernel(odd)  # auto: jnp, no error
    with pytest.raises(ValueError, match="the conv1d kernel does not take conv_dim="):
        gated_deltanet.use_conv_kernel(dataclasses.replace(odd, kernels="conv1d"))
    monkeypatch.setattr(jax, "default_backend", lambda: "cpu")
    assert not gated_deltanet.use_conv_kernel(cfg)  # the CPU path stays jnp


def test_auto_paged_attention_only_at_contract_head_dims(monkeypatch):
    import jax
    import jax.numpy as jnp

    from jaxserve.models import layers

    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    for hd, expect in [(256, True), (128, True), (64, False)]:
        cfg = dataclasses.replace(_cfg("auto"), head_dim=hd, num_heads=8, num_kv_heads=2)
        assert layers.use_attention_kernel(cfg, jnp.bfloat16, 16) == (expect and "paged_attention" in backends.AUTO_ON_GPU)
        assert not layers.use_attention_kernel(cfg, jnp.float32, 16)  # bf16 / fp16 only
    assert layers.use_attention_kernel(dataclasses.replace(_cfg("pallas"), head_dim=64), jnp.bfloat16, 16)


def test_moe_kernel_on_a_gpu_for_bf16_only(monkeypatch):
    """moe passed gpu_check: ``auto`` picks it on a GPU for bf16 / fp16 activations
    and sizes its tiles divide; fp32 (tf32 WGMMA would be less precise) and misfits stay on jnp;
    naming it on a misfit is an error."""
    import jax
    import jax.numpy as jnp

    from jaxserve.models import layers

    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    cfg = dataclasses.replace(_cfg("auto"), hidden_size=2048, moe_intermediate_size=512)
    assert layers.use_moe_kernel(cfg, jnp.bfloat16) and layers.use_moe_kernel(cfg, jnp.float16)
    assert not layers.use_moe_kernel(cfg, jnp.float32)
    assert not layers.use_moe_kernel(dataclasses.replace(cfg, kernels="jnp"), jnp.bfloat16)
    misfit = dataclasses.replace(cfg, moe_intermediate_size=40)
    assert not layers.use_moe_kernel(misfit, jnp.bfloat16)
    with pytest.raises(ValueError, match="moe kernel does not take"):
        layers.use_moe_kernel(dataclasses.replace(misfit, kernels="moe"), jnp.bfloat16)
