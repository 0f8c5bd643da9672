"""One process of the two-process tensor-parallel check (tests/parallel/test_multihost.py).

    python -m tests.parallel.multihost_worker COORDINATOR NUM_PROCESSES PROCESS_ID OUT.npz

Forces two host devices (keeping any other XLA flag it inherits), joins the runtime
(``jaxserve.parallel.distributed``), splits the shipped default model over every process's devices
and runs ``schedule``; every process writes the gathered logits of each step to its own ``OUT.npz``
(``OUT`` + process id). ``schedule`` is
importable without side effects, so the test runs the same steps on one device for the reference.
"""

from __future__ import annotations

import os
import sys

LOCAL_DEVICES = 2


def xla_flags(inherited: str, devices: int = LOCAL_DEVICES) -> str:
    """``XLA_FLAGS`` of a process with ``devices`` host devices: ``inherited`` (this package's flags)
    with its own device count."""
    flags = [f for f in inherited.split() if "device_count" not in f]
    return " ".join([*flags, f"--xla_force_host_platform_device_count={devices}"])


def schedule(tp=None) -> list:
    """A prefill step of two prompts (one snapshotting at 64 tokens) and a decode step; the logits
    of the real rows of each step, as host arrays (gathered from every process under ``tp``)."""
    import dataclasses

    import jax.numpy as jnp
    import numpy as np

    from jaxserve.engine.flags import DEFAULT_MODEL_DIR
    from jaxserve.engine import pools as pool_mod
    from jaxserve.engine import runner
    from weights import load_model

    model = load_model(DEFAULT_MODEL_DIR, dtype="float32", progress=False, tensor_parallel=tp)
    cfg = model.config if tp else dataclasses.replace(model.config, kernels="jnp")
    plan = pool_mod.plan_pools(cfg, jnp.float32, page_size=16, max_seqs=4, num_pages=24, num_slots=8)
    placement = None if tp is None else runner.Placement(model.params, tp.pool_shardings(cfg))
    pools = pool_mod.init_pools(plan, cfg, jnp.float32, None if tp is None else placement.pools)
    buckets = runner.Buckets(tokens=(128,), seqs=(4,), pages_per_seq=8, page_size=16)
    rng = np.random.default_rng(0)
    a, b = rng.integers(10, 1000, 72).tolist(), rng.integers(10, 1000, 30).tolist()
    steps = [[runner.RowSpec(tokens=a, start=0, pages=[1, 2, 3, 4, 5], slot=1, snapshots=[(64, 5)]),
              runner.RowSpec(tokens=b, start=0, pages=[6, 7], slot=2)],
             [runner.RowSpec(tokens=[3], start=72, pages=[1, 2, 3, 4, 5], slot=1),
              runner.RowSpec(tokens=[4], start=30, pages=[6, 7], slot=2)]]
    out = []
    for rows in steps:
        res, pools = runner.step(model.params, cfg, pools, runner.make_batch(rows, buckets), return_logits=True,
                                 placement=placement)
        if tp is None:
            logits = np.asarray(res.logits)
        else:
            from jax.experimental import multihost_utils

            logits = np.asarray(multihost_utils.process_allgather(res.logits, tiled=True))
        out.append(logits[: len(rows)])
    return out


def main(argv: list[str]) -> int:
    coordinator, n, pid, out = argv
    os.environ["XLA_FLAGS"] = xla_flags(os.environ.get("XLA_FLAGS", ""))
    import jax
    import numpy as np

    from jaxserve.parallel.distributed import DistributedSpec, initialize
    from jaxserve.parallel.tensor import TensorParallel

    initialize(DistributedSpec.resolve(coordinator, int(n), int(pid)))
    assert jax.process_count() == int(n) and jax.local_device_count() == LOCAL_DEVICES
    tp = TensorParallel.make(jax.device_count())
    logits = schedule(tp)
    np.savez(f"{out}{pid}.npz", *logits, devices=np.array([jax.device_count(), jax.process_index()]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
