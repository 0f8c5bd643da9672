"""``jaxserve serve-replicas``: data parallelism, N ``jaxserve serve`` replicas behind SGLang's router.

    jaxserve serve-replicas --replicas 2 --base-port 8001 --router-port 8000 [--host H]
                            [--router-policy cache_aware] [--devices 0,1,2,3] [serve flags ...]

Each replica is a whole ``jaxserve serve`` process (its own engine, scheduler and prefix cache) on
``--base-port + i``; every flag this command does not know goes to each replica unchanged (checked
by ``serve``'s own parser before anything starts). The router (``sglang_router.launch_router``, the
``router`` extra) listens on ``--router-port`` and forwards the OpenAI routes, streams included.

Routing: ``cache_aware`` (the default) keeps an approximate radix tree of the request text each
replica has been sent and sends a request to the replica holding its longest prefix (when the match
covers at least the router's cache threshold, else to the replica with the smallest tree), unless
the replicas' loads are out of balance, when it picks the least loaded. A multi-turn conversation
therefore stays on the replica whose prefix cache holds it. The tree is built from text (chat
messages, text prompts): sglang-router 0.3.2 refuses a ``/v1/completions`` prompt of token ids.

Devices: with ``--devices`` (or ``CUDA_VISIBLE_DEVICES``, or the ``/dev/nvidia<N>`` nodes of this
host) each replica gets its own ``--tensor-parallel-size`` of them through ``CUDA_VISIBLE_DEVICES``;
on a host without GPUs the replicas are plain processes sharing the CPU.

The router first probes each replica for gRPC; uvicorn logs that once per replica as "Invalid HTTP
request received", which is harmless.

Life cycle: the replicas start together and the router only after every replica answers
``/health`` (so it registers them at once); the command is ready when the router reports every
replica healthy. Ctrl-C / SIGTERM stops the router (SIGTERM) and the replicas (SIGINT, as Ctrl-C
stops ``serve``), killing what has not exited ``STOP_GRACE_S`` later. If any child exits on its own,
the rest are stopped and the command exits 1: a partial deployment is never left serving.
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Callable, Sequence

STOP_GRACE_S = 20.0
POLL_S = 0.2
POLICIES = ("cache_aware", "round_robin")  # those tested here; power_of_two polls /get_load, which jaxserve lacks


class ReplicasError(Exception):
    """A usage or start-up error: one line on stderr, exit code 2."""


@dataclasses.dataclass(frozen=True)
class Replica:
    """One replica: its index, port and the devices it may see (None: no device assignment)."""
    index: int
    port: int
    devices: tuple[str, ...] | None


def visible_devices(flag: str | None) -> tuple[str, ...] | None:
    """The GPU ids to split among the replicas: ``--devices``, else ``CUDA_VISIBLE_DEVICES``, else
    this host's ``/dev/nvidia<N>`` nodes; None when there are none (a CPU host). Never starts CUDA:
    the parent must not take device memory from its replicas."""
    text = flag if flag is not None else os.environ.get("CUDA_VISIBLE_DEVICES")
    if text is not None:
        ids = tuple(t.strip() for t in text.split(",") if t.strip())
        if not ids:
            raise ReplicasError(f"--devices / CUDA_VISIBLE_DEVICES lists no device: {text!r}")
        return ids
    nodes = sorted(int(p[len("/dev/nvidia"):]) for p in glob.glob("/dev/nvidia[0-9]*") if p[len("/dev/nvidia"):].isdigit())
    return tuple(str(n) for n in nodes) or None


def plan(replicas: int, base_port: int, router_port: int, per_replica: int,
         devices: tuple[str, ...] | None) -> list[Replica]:
    """The replicas' ports and device sets; checks that they fit (a ReplicasError names the flag)."""
    if replicas < 1:
        raise ReplicasError(f"--replicas must be >= 1, got {replicas}")
    ports = range(base_port, base_port + replicas)
    for flag, port in (("--base-port", base_port), ("--base-port + --replicas - 1", ports[-1]),
                       ("--router-port", router_port)):
        if not 0 < port < 65536:
            raise ReplicasError(f"{flag} must be in 1..65535, got {port}")
    if router_port in ports:
        raise ReplicasError(f"--router-port {router_port} is one of the replicas' ports {ports[0]}..{ports[-1]}")
    if devices is None:
        return [Replica(i, p, None) for i, p in enumerate(ports)]
    if len(set(devices)) != len(devices):
        raise ReplicasError(f"--devices lists a device twice: {','.join(devices)}")
    need = replicas * per_replica
    if len(devices) < need:
        raise ReplicasError(f"{replicas} replicas x {per_replica} device(s) each need {need} devices, "
                            f"but only {len(devices)} are visible ({','.join(devices)}); pass --devices")
    return [Replica(i, p, tuple(devices[i * per_replica:(i + 1) * per_replica])) for i, p in enumerate(ports)]


def free_port(host: str) -> int:
    """A port nothing listens on now (the router's metrics need one of their own: its default is
    fixed, so a second router on the host would fail to start)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _pump(stream, prefix: str) -> None:
    """Copy a child's output to our stderr, each line prefixed with the child's name."""
    for line in iter(stream.readline, ""):
        sys.stderr.write(f"[{prefix}] {line}")
        sys.stderr.flush()
    stream.close()


class Children:
    """The started processes, in start order; ``stop`` ends them in reverse order (router first)."""

    def __init__(self) -> None:
        self.procs: list[tuple[str, subprocess.Popen, int]] = []

    def start(self, name: str, argv: Sequence[str], env: dict[str, str], stop_signal: int) -> subprocess.Popen:
        proc = subprocess.Popen(list(argv), env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, errors="replace")
        self.procs.append((name, proc, stop_signal))
        threading.Thread(target=_pump, args=(proc.stdout, name), daemon=True).start()
        return proc

    def exited(self) -> tuple[str, int] | None:
        """The first child that has exited, with its status, or None while all run."""
        for name, proc, _ in self.procs:
            if proc.poll() is not None:
                return name, proc.returncode
        return None

    def stop(self) -> None:
        for _, proc, stop_signal in reversed(self.procs):
            if proc.poll() is None:
                proc.send_signal(stop_signal)
        deadline = time.monotonic() + STOP_GRACE_S
        for _, proc, _ in reversed(self.procs):
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _wait(what: str, ready: Callable[[], bool], children: Children, timeout: float) -> None:
    """Poll ``ready`` until it holds; a ReplicasError if a child exits first or ``timeout`` passes."""
    deadline = time.monotonic() + timeout
    while not ready():
        gone = children.exited()
        if gone is not None:
            raise ReplicasError(f"{gone[0]} exited with status {gone[1]} while waiting for {what}")
        if time.monotonic() > deadline:
            raise ReplicasError(f"{what}: not ready after {timeout:.0f}s")
        time.sleep(POLL_S)


def _get_json(url: str) -> dict | None:
    import httpx

    try:
        r = httpx.get(url, timeout=5)
        return r.json() if r.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        return None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="jaxserve serve-replicas",
        description="N `jaxserve serve` replicas behind SGLang's router (prefix-cache-aware routing). Flags not "
                    "listed here go to every replica (see `jaxserve serve --help`).")
    p.add_argument("--replicas", type=int, default=2, metavar="N", help="replicas to start (default: %(default)s)")
    p.add_argument("--host", default="127.0.0.1", help="address the router and the replicas listen on "
                                                       "(default: %(default)s)")
    p.add_argument("--base-port", type=int, default=8001, metavar="P",
                   help="replica i listens on P + i (default: %(default)s)")
    p.add_argument("--router-port", type=int, default=8000, metavar="P",
                   help="the port clients use (default: %(default)s)")
    p.add_argument("--router-policy", choices=POLICIES, default="cache_aware",
                   help="how the router picks a replica (default: %(default)s)")
    p.add_argument("--router-metrics-port", type=int, default=None, metavar="P",
                   help="the router's Prometheus metrics (default: a free port, printed when ready)")
    p.add_argument("--devices", default=None, metavar="IDS",
                   help="GPU ids to split among the replicas, --tensor-parallel-size each, set as each replica's "
                        "CUDA_VISIBLE_DEVICES (default: $CUDA_VISIBLE_DEVICES, else every GPU of the host)")
    p.add_argument("--start-timeout", type=float, default=1800.0, metavar="S",
                   help="seconds the replicas may take to load and compile (default: %(default)s)")
    return p


def serve_flags_check(serve_args: list[str]) -> argparse.Namespace:
    """``serve``'s own parser over the pass-through flags (a bad one exits 2 before anything starts)."""
    for own in ("--port", "--host"):
        if any(a == own or a.startswith(own + "=") for a in serve_args):
            raise ReplicasError(f"{own} is set per replica by serve-replicas (use --base-port / --host)")
    from jaxserve.cli import build_parser as cli_parser

    return cli_parser().parse_args(["serve", *serve_args])


def main(argv: list[str]) -> int:
    try:
        return _run(argv)
    except ReplicasError as e:
        print(f"jaxserve serve-replicas: error: {e}", file=sys.stderr)
        return 2


def _run(argv: list[str]) -> int:
    args, serve_args = build_parser().parse_known_args(argv)
    if not args.start_timeout > 0:
        raise ReplicasError(f"--start-timeout must be > 0, got {args.start_timeout}")
    serve = serve_flags_check(serve_args)
    try:
        import httpx  # noqa: F401
        import sglang_router  # noqa: F401
    except ImportError as e:
        raise ReplicasError(f"serve-replicas needs the 'server' and 'router' extras "
                            f"(pip install -e '.[server,router]'): {e}") from None
    replicas = plan(args.replicas, args.base_port, args.router_port, serve.tensor_parallel_size,
                    visible_devices(args.devices))
    for port in (args.router_port, *(r.port for r in replicas)):  # a busy port fails now, not after the compiles
        try:
            socket.create_server((args.host, port)).close()
        except OSError as e:
            raise ReplicasError(f"cannot listen on {args.host}:{port}: {e.strerror or e}") from None
    children = Children()
    stopping = threading.Event()

    def on_signal(signum, _frame):
        stopping.set()
        raise KeyboardInterrupt

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        for r in replicas:
            env = dict(os.environ)
            if r.devices is not None:
                env["CUDA_VISIBLE_DEVICES"] = ",".join(r.devices)
            children.start(f"replica {r.index}", [sys.executable, "-m", "jaxserve.cli", "serve", "--host", args.host,
                                                  "--port", str(r.port), *serve_args], env, signal.SIGINT)
        urls = [f"http://{args.host}:{r.port}" for r in replicas]
        for url in urls:
            _wait(f"{url}/health", lambda: _get_json(f"{url}/health") is not None, children, args.start_timeout)
        metrics_port = args.router_metrics_port or free_port(args.host)
        router_argv = [sys.executable, "-m", "sglang_router.launch_router", "--host", args.host, "--port",
                       str(args.router_port), "--policy", args.router_policy, "--worker-urls", *urls,
                       "--worker-startup-check-interval", "1", "--log-level", "warn",
                       "--prometheus-host", args.host, "--prometheus-port", str(metrics_port),
                       "--shutdown-grace-period-secs", str(int(STOP_GRACE_S))]
        children.start("router", router_argv, dict(os.environ), signal.SIGTERM)
        root = f"http://{args.host}:{args.router_port}"

        def router_ready() -> bool:
            r = _get_json(f"{root}/readiness")
            return bool(r) and r.get("healthy_workers") == len(replicas)

        _wait("the router", router_ready, children, 120)
        print(f"jaxserve serve-replicas: ready: {len(replicas)} replicas ({', '.join(urls)}) behind {root} "
              f"(policy {args.router_policy}; router metrics on http://{args.host}:{metrics_port}/metrics)",
              file=sys.stderr, flush=True)
        while (gone := children.exited()) is None:
            time.sleep(POLL_S)
        print(f"jaxserve serve-replicas: {gone[0]} exited with status {gone[1]}; stopping the others",
              file=sys.stderr, flush=True)
        return 1
    except KeyboardInterrupt:
        if not stopping.is_set():
            raise
        return 0
    finally:
        for s in old:  # a second Ctrl-C must not cut the shutdown short
            signal.signal(s, signal.SIG_IGN)
        children.stop()
        for s, h in old.items():
            signal.signal(s, h)
