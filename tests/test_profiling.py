"""jaxserve/profiling.py's naming of a profile's kernels, on a program compiled here (CPU): the
optimised HLO names its fusions as XLA names their kernels on the GPU."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp

from jaxserve import profiling


def _program_text() -> str:
    def f(x, w):
        with jax.named_scope("moe"), jax.named_scope("route"):
            y = jnp.tanh(x @ w) * 2 + 1
        with jax.named_scope("sample"):
            s = jnp.sort(y, axis=-1)
            z = jnp.exp(s).sum(-1) + jnp.cumsum(s, axis=-1)[:, -1]
        return z

    return jax.jit(f).lower(jnp.ones((4, 8)), jnp.ones((8, 8))).compile().as_text()


def _entry_instructions(text: str) -> dict[str, str]:
    """ENTRY's instruction names -> their own op_name, as the test's independent reading."""
    entry = text[text.index("ENTRY"):]
    return {m.group(1): m.group(2) for m in re.finditer(r'%([\w.\-]+) = .*?op_name="([^"]*)"', entry)}


def test_scope_totals_charge_each_kernel_to_its_model_scope():
    text = _program_text()
    instrs = _entry_instructions(text)
    route = [n for n, op in instrs.items() if "/moe/route/" in op]
    sample = [n for n, op in instrs.items() if "/sample/" in op and "/moe/" not in op]
    assert route and sample, instrs
    route, sample = [n.replace(".", "_") for n in route], [n.replace(".", "_") for n in sample]  # kernels: "_" for "."
    calls = [[(route[0], 1.0 + c), *((n, 0.25) for n in sample), ("nvjet_sm90_tst_64x8", 0.5),
              ("gdn_decode_mosaic_gpu_kernel", 0.125)] for c in range(3)]
    totals = profiling.scope_totals(text, calls)
    assert totals["moe/route"]["kernels"] >= 1
    assert totals["library:nvjet_sm90_t"] == {"ms": 0.5, "kernels": 1}
    assert totals["mosaic:gdn_decode"] == {"ms": 0.125, "kernels": 1}
    assert abs(sum(v["ms"] for v in totals.values()) - (2.125 + 0.25 * len(sample) + 0.5)) < 1e-6  # median call: c = 1
    assert sum(v["kernels"] for v in totals.values()) == 3 + len(sample)
    assert list(totals) == sorted(totals, key=lambda s: -totals[s]["ms"])
    # a fusion holding ops of both scopes goes to the scope most of its ops are in: never lost
    assert set(totals) <= {"moe/route", "sample", "(top)", "library:nvjet_sm90_t", "mosaic:gdn_decode"}


def test_scope_drops_wrappers_and_the_primitive():
    assert profiling._scope("jit(_step)/while/body/moe/shared_expert/dot_general") == "moe/shared_expert"
    assert profiling._scope("jit(_step)/linear_attn/project/conv/jit(silu)/mul") == "linear_attn/project"
    assert profiling._scope("jit(_step)/add") == "(top)"
