"""Several processes (hosts) as one JAX runtime: ``jax.distributed.initialize`` before any device use.

    spec = DistributedSpec.resolve(coordinator, num_processes, process_id)  # else the JAXSERVE_* env
    if spec: initialize(spec)      # then jax.devices() lists every process's devices
    tp = TensorParallel.make(size) # the mesh may span processes: XLA's collectives cross them

Every process runs the same program on the same inputs (JAX's multi-controller model): each calls
the same jitted steps in the same order, and XLA moves data between processes (NCCL on GPUs; on
CPUs the gloo collectives, switched on here because JAX's CPU default has no cross-process
collectives). Process 0 hosts the coordinator at ``coordinator`` (``host:port``, reachable from
every process).

Call before anything touches a device: JAX fixes its backends at first use, and a process that
started them without the coordinator sees only its own devices.

Scope: the model's step (``engine.runner.step`` under a ``TensorParallel`` placement) runs split
over processes (tests/parallel/test_multihost.py). The engine does not yet: the first thing that
fails is its memory budget, which asks ``jax.devices()[0]`` (another process's device outside
process 0) for its memory; and ``serve`` would need process 0 to broadcast each step's batch so
that every process runs the same steps. Until then the CLI has no multi-process flags.
"""

from __future__ import annotations

import dataclasses
import os

ENV = {"coordinator": "JAXSERVE_COORDINATOR_ADDRESS", "num_processes": "JAXSERVE_NUM_PROCESSES",
       "process_id": "JAXSERVE_PROCESS_ID"}


@dataclasses.dataclass(frozen=True)
class DistributedSpec:
    coordinator: str
    num_processes: int
    process_id: int

    @classmethod
    def resolve(cls, coordinator: str | None = None, num_processes: int | None = None,
                process_id: int | None = None) -> "DistributedSpec | None":
        """The arguments, each falling back to its ``JAXSERVE_*`` variable; None when none is set
        (one process). Raises ``ValueError`` for a partial or inconsistent set."""
        given = {"coordinator": coordinator, "num_processes": num_processes, "process_id": process_id}
        for key, var in ENV.items():
            if given[key] is None and os.environ.get(var, "") != "":
                given[key] = os.environ[var]
        if all(v is None for v in given.values()):
            return None
        missing = [k for k, v in given.items() if v is None]
        if missing:
            raise ValueError(f"several processes need all of coordinator, num_processes and process_id (or "
                             f"{', '.join(ENV.values())}); missing {', '.join(missing)}")
        try:
            n, pid = int(given["num_processes"]), int(given["process_id"])
        except ValueError:
            raise ValueError(f"num_processes and process_id must be integers, got {given['num_processes']!r} "
                             f"and {given['process_id']!r}") from None
        addr = str(given["coordinator"])
        host, _, port = addr.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"coordinator must be HOST:PORT, got {addr!r}")
        if n < 1 or not 0 <= pid < n:
            raise ValueError(f"process_id must be in 0..num_processes - 1 (and num_processes >= 1), "
                             f"got process {pid} of {n}")
        return cls(addr, n, pid)


def initialize(spec: DistributedSpec) -> None:
    """Join the runtime (blocks until every process has joined). On a CPU-only JAX, cross-process
    collectives go through gloo."""
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # read only by the CPU backend
    jax.distributed.initialize(coordinator_address=spec.coordinator, num_processes=spec.num_processes,
                               process_id=spec.process_id)
