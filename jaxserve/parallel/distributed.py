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

Offline generation (``jaxserve generate``, ``LLM.generate``) runs over processes, the model split
over every process's devices (tests/parallel/test_multihost.py). No step's batch crosses between
processes there: every process runs the same host scheduler on the same requests, and that
scheduler is deterministic (arrival counters, the radix tree's logical clock, no wall-clock time in
a built-in policy, seeded sampling inside the step; the overlapped loop plans step N+1 before
reading step N whatever the timing), so every process issues the same steps in the same order and
reads the same replicated tokens back. What could make them differ is agreed on or checked in
``engine.llm``: the memory budget is the minimum over processes (``min_over_processes``), so the
pool sizes and prefill buckets are the same everywhere (the resulting plan is checked too), and the
engine arguments and each ``LLM.generate`` call's requests must hash the same in every process
(``require_same``): a process started with other flags or prompts fails at once, in every process,
instead of hanging in a collective. A plug-in policy that reads the scheduler's clock breaks this.
The persistent compile cache may be one directory shared by the processes: JAX writes it from
process 0 only.

An error only one process meets (a missing file, a failed step) leaves the others waiting in their
next collective: ``jaxserve generate`` and ``serve`` then end that process with ``leave_now``, and the others
fail at that collective or are ended by JAX's coordination service. A program of its own using
``LLM`` over processes should do the same.

``serve`` runs over processes the other way round: requests reach process 0 at their own times, so
only process 0 runs the HTTP server, the scheduler and the engine, and the others follow it
(``Channel``): before each device program that runs under the mesh with host inputs (a step, the
pools' re-creation after a failed step), process 0's executor sends the program's name and its host
arrays, and every follower runs the same program on the same arrays, in the same order
(``jaxserve.engine.llm.lead`` / ``follow``). A step's feed buffer and pools are device arrays each
process updates alike, so nothing else needs sending. Process 0 ends the followers with a last
message when it stops; a follower whose process 0 is gone fails (the coordination service lives in
process 0). A model with a vision tower is refused there: an image's table is computed on process 0
and is no host input. ``debug_snapshot_checksums`` reads a slot of pools sharded over processes,
which no process holds whole: it does not work over processes (nor does it in ``generate``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import os
import sys
from typing import NoReturn, Sequence

import numpy as np

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
    collectives go through gloo. A process that has joined already (its program called this, or
    ``jax.distributed.initialize``, first) stays in its runtime, which must match ``spec``."""
    import jax

    if jax.distributed.is_initialized():
        if (jax.process_count(), jax.process_index()) != (spec.num_processes, spec.process_id):
            raise ValueError(f"this process already joined a runtime as process {jax.process_index()} of "
                             f"{jax.process_count()}, not {spec.process_id} of {spec.num_processes}")
        return
    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # read only by the CPU backend
    jax.distributed.initialize(coordinator_address=spec.coordinator, num_processes=spec.num_processes,
                               process_id=spec.process_id)


def leave_now(code: int) -> NoReturn:
    """End this process at once with exit status ``code``, after an error that the other processes
    did not meet. A normal exit would wait in ``jax.distributed``'s shutdown barrier for processes
    that themselves wait for this one in a collective; ending without it lets JAX's coordination
    service see the process gone and end the others (within its heartbeat timeout at worst)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def is_initialized() -> bool:
    """Whether this process has joined a runtime of several processes (``initialize``)."""
    import jax

    return jax.distributed.is_initialized()


def is_main_process() -> bool:
    """Process 0, the one that prints and writes results (True in a single process)."""
    import jax

    return jax.process_index() == 0


def _gather(values: Sequence[int]):
    """[num_processes, len(values)] int32: every process's ``values`` (a collective: every process
    must call it at the same point of the program)."""
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(np.asarray(values, np.int32)))


def min_over_processes(values: Sequence[int]) -> list[int]:
    """Element-wise minimum of ``values`` (each in int32's range) over every process; ``values``
    itself in a single process."""
    import jax

    if jax.process_count() == 1:
        return [int(v) for v in values]
    return _gather(values).min(axis=0).tolist()


def digest(text: str) -> int:
    """A 31-bit digest of ``text``, for ``require_same``."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=4).digest(), "little") >> 1


def require_same(what: str, text: str) -> None:
    """Raise ``ValueError`` naming the processes whose ``text`` differs from process 0's (compared
    by ``digest``). A no-op in a single process. A collective: every process calls it at the same
    point."""
    import jax

    if jax.process_count() == 1:
        return
    got = _gather([digest(text)])[:, 0]
    differ = [i for i, d in enumerate(got.tolist()) if d != got[0]]
    if differ:
        raise ValueError(f"every process must be given the same {what}; process(es) {differ} differ from "
                         f"process 0")


class Channel:
    """Messages from process 0 to every other process, in order, through the coordination service's
    key-value store (``jax.distributed``'s client): message n is the key ``jaxserve/msg/n``. Each
    message is a name and named numpy arrays (``np.savez``, no pickle).

    Not a collective: a follower waits as long as process 0 sends nothing (an idle server), which a
    collective's timeout would not allow, and fails as soon as the store is gone with process 0.
    Process 0 deletes message n - ``KEEP`` when it sends message n: a follower is never that far
    behind, since each message names a program that needs every process, and process 0 reads
    each step's tokens before it dispatches two more."""

    KEEP = 16
    POLL_MS = 10_000  # a follower's wait per try; it tries again while the store is there

    def __init__(self, prefix: str = "jaxserve/msg"):
        from jax._src import distributed as jax_distributed

        self._client = jax_distributed.global_state.client
        if self._client is None:
            raise RuntimeError("a Channel needs a runtime of several processes (initialize)")
        self._prefix, self._sent, self._read = prefix, 0, 0

    def send(self, name: str, arrays: dict[str, np.ndarray] | None = None) -> None:
        """(Process 0) Append a message for every follower."""
        buf = io.BytesIO()
        np.savez(buf, __name__=np.array(name), **(arrays or {}))
        self._client.key_value_set_bytes(f"{self._prefix}/{self._sent}", buf.getvalue())
        if self._sent >= self.KEEP:
            self._client.key_value_delete(f"{self._prefix}/{self._sent - self.KEEP}")
        self._sent += 1

    def receive(self) -> tuple[str, dict[str, np.ndarray]]:
        """(A follower) The next message: blocks until process 0 sends it. Raises ``ConnectionError``
        when the store is gone (process 0 died)."""
        key = f"{self._prefix}/{self._read}"
        while True:
            try:
                data = self._client.blocking_key_value_get_bytes(key, self.POLL_MS)
                break
            except Exception as e:  # noqa: BLE001 - jaxlib's runtime error; its status says which
                if "DEADLINE_EXCEEDED" not in str(e):
                    raise ConnectionError(f"process 0 is gone (the coordination service does not answer): {e}") from e
        self._read += 1
        with np.load(io.BytesIO(data), allow_pickle=False) as z:
            arrays = {k: z[k] for k in z.files}
        return str(arrays.pop("__name__")), arrays
