"""Expert parallelism: the routed experts split by expert id run per device under ``shard_map``.

``layers.moe`` with ``expert_parallel`` over 2 and 4 forced host devices equals the one-device layer
in fp32 (a few tokens: one ``routed_experts`` call; many: ``routed_experts_blocked``'s blocks), and
the one collective of its compiled program is the all-reduce of the routed output (no expert weight
or routing crosses devices). No collective of the compiled serving step of a model split this way
moves expert weights; its logits against one device's are tests/parallel/test_tensor_parallel.py's
(``qwen3_next`` and ``kimi_linear`` there are expert parallel).
"""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.config import ModelConfig
from jaxserve.engine import pools as pool_mod
from jaxserve.engine import runner
from jaxserve.models import layers
from jaxserve.parallel.layout import AXIS, shard_major
from jaxserve.parallel.tensor import TensorParallel
from tests.parallel.conftest import DEVICES
from tests.parallel.test_tensor_parallel import BUCKETS, FAMILIES, PAGE, REL_TOL
from weights import load_model
from weights.random_checkpoint import write_random_checkpoint

pytestmark = pytest.mark.skipif(
    len(jax.devices()) < DEVICES,
    reason=f"needs {DEVICES} host devices: run tests/parallel in its own pytest process (scripts/test.sh does)")

CFG = dataclasses.replace(ModelConfig.from_hf(FAMILIES["qwen3_5_moe"][0], source="test"), kernels="jnp")


def _moe_params(cfg: ModelConfig, seed: int = 0) -> dict:
    """Random fp32 params of one ``layers.moe`` layer of ``cfg``."""
    rng = np.random.default_rng(seed)
    H, I, E, S = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts, cfg.shared_expert_intermediate_size

    def f(fan_in, *shape):
        return jnp.asarray(rng.normal(size=shape) * fan_in**-0.5, jnp.float32)

    return dict(router=f(H, H, E + 1), gate_up=f(H, E, H, 2 * I), down=f(I, E, I, H),  # router: + the shared gate
                shared_expert=dict(gate_up_proj=dict(w=f(H, H, 2 * S)), down_proj=dict(w=f(S, S, H))))


def _split(tp: TensorParallel, p: dict) -> dict:
    """``p`` on ``tp``'s mesh: the routed experts split by id, the rest replicated; the shared
    expert's ``gate_up_proj`` shard-major (``layers.mlp`` cuts it for the mesh's shard count)."""
    w = np.asarray(p["shared_expert"]["gate_up_proj"]["w"])
    shared = {**p["shared_expert"], "gate_up_proj": {"w": shard_major(w, (w.shape[1] // 2,) * 2, tp.size)}}
    return {k: jax.device_put(v, tp.sharding(AXIS) if k in ("gate_up", "down") else tp.replicated)
            for k, v in {**p, "shared_expert": shared}.items()}


COLLECTIVE = re.compile(r"= (.+?) (all-gather|all-reduce|all-to-all|collective-permute|reduce-scatter)(?:-start)?\(")


def _collectives(hlo: str) -> list[tuple[str, str]]:
    """(op, result type without layouts) of every cross-device collective in compiled HLO text
    (async ones by their start), e.g. ``("all-reduce", "f32[3,64]")``."""
    return [(m[2], re.sub(r"\{[^}]*\}", "", m[1])) for m in COLLECTIVE.finditer(hlo)]


def _run(cfg: ModelConfig, p: dict, x: jax.Array, tp: TensorParallel | None):
    """(output, compiled HLO text) of ``layers.moe`` under ``tp``'s mesh (None: one device)."""
    f = jax.jit(lambda p, x: layers.moe(p, cfg, x))
    if tp is None:
        return np.asarray(f(p, x)), None
    with jax.set_mesh(tp.mesh):
        x = jax.device_put(x, tp.replicated)
        compiled = f.lower(p, x).compile()
        return np.asarray(compiled(p, x)), compiled.as_text()


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("tokens", [3, 100])
def test_moe_layer_equals_one_device(n, tokens, monkeypatch):
    """Equal to one device's layer, and the program's one collective is the all-reduce of the
    routed output: no expert weight (nor routing) crosses devices. ``tokens=100`` with a zero
    expansion budget runs 16-token blocks (``routed_experts_blocked``)."""
    if tokens > 16:
        monkeypatch.setattr(layers, "MOE_EXPANSION_BYTES", 0)
    p = _moe_params(CFG)
    x = jnp.asarray(np.random.default_rng(1).normal(size=(tokens, CFG.hidden_size)), jnp.float32)
    want, _ = _run(CFG, p, x, None)
    tp = TensorParallel.make(n, expert_parallel=True)
    got, hlo = _run(dataclasses.replace(CFG, expert_parallel=True), _split(tp, p), x, tp)
    err, scale = np.max(np.abs(got - want)), np.max(np.abs(want))
    assert err <= REL_TOL * scale, f"max |Δ| {err:.3g} > {REL_TOL} · {scale:.3g}"
    assert _collectives(hlo) == [("all-reduce", f"f32[{tokens},{CFG.hidden_size}]")]


def test_step_moves_no_expert_weights(tmp_path):
    """The compiled prefill step of ``qwen3_next`` split over 4 devices by expert id: no collective
    produces or takes an array shaped like a layer's experts, whole or one device's share."""
    hf, expert_parallel = FAMILIES["qwen3_next"]
    assert expert_parallel
    folder = write_random_checkpoint(hf, tmp_path / "qwen3_next", dtype="float32", seed=0, init_std=0.2)
    tp = TensorParallel.make(DEVICES, expert_parallel=True)
    model = load_model(folder, dtype="float32", progress=False, tensor_parallel=tp)
    cfg = model.config
    assert cfg.expert_parallel
    plan = pool_mod.plan_pools(cfg, jnp.float32, page_size=PAGE, max_seqs=4, num_pages=24, num_slots=8)
    placement = runner.Placement(model.params, tp.pool_shardings(cfg))
    pools = pool_mod.init_pools(plan, cfg, jnp.float32, placement.pools)
    prefill = next(p for p in BUCKETS.programs() if not p[3])
    hlo = runner.lower_step(model.params, cfg, pools, BUCKETS, prefill, placement).compile().as_text()
    mlp = model.params["layers"][0]["mlp"]
    shapes = {s for w in (mlp["gate_up"], mlp["down"]) for s in (w.shape, (w.shape[0] // DEVICES, *w.shape[1:]))}
    dims = {f"[{','.join(map(str, s))}]" for s in shapes}
    collectives = _collectives(hlo)
    assert ("all-reduce", f"f32[{BUCKETS.tokens[0]},{cfg.hidden_size}]") in collectives
    moved = [line for line in hlo.splitlines() if COLLECTIVE.search(line) and any(d in line for d in dims)]
    assert not moved, moved
