"""Data parallelism as users start it: ``jaxserve serve-replicas`` (two replicas of the shipped default
model behind SGLang's router, cache-aware), beside one plain ``jaxserve serve`` with the same flags.

One multi-turn chat workload (``jaxserve bench``'s: each turn resends the conversation so far, so a
turn hits the prefix cache only on the replica that served the turn before) goes to the single
server and through the router: every answer must be the single server's (greedy), and the share of
prompt tokens served from the prefix caches (``usage.prompt_tokens_details.cached_tokens``) must
hold. A round-robin router over the same replicas, given a fresh workload of the same shape, is
the baseline that shows the routing is what holds it. Also: the router's ``/v1/models`` names the
served model (it reads the replicas' ``/server_info``), one non-streamed completion goes through,
and SIGTERM stops every process.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("sglang_router")

from jaxserve import replicas  # noqa: E402
from jaxserve.bench.client import Client, request_body  # noqa: E402
from jaxserve.bench.run import Config, run_once  # noqa: E402
from jaxserve.bench.workload import make_workload  # noqa: E402

MODEL = "tiny"
# The pools hold the whole workload on each server, so no hit is lost to eviction and the shares
# compare routing alone.
SERVE = ["--dtype", "float32", "--num-pages", "256", "--num-slots", "32", "--max-prefill-length", "64",
         "--max-running-requests", "4", "--served-model-name", MODEL]
# 5 sessions of 4 turns, one request at a time, in round order (s0t0, s1t0, ..., s4t0, s0t1, ...): a
# turn resends ~55 tokens more than the turn before, so on the replica that served that turn it hits
# its ×64 boundaries (0, 0, 64, 128 tokens for turns 0..3). Round robin over two replicas with an odd
# number of sessions sends each turn to the other replica than the turn before: only the turn two
# back is there (0, 0, 0, 64), a third of the share.
WORKLOAD = dict(num_prompts=20, turns=4, input_len=40, output_len=6, prompt_format="text")
CONCURRENCY = 1


def _free_ports(n: int) -> int:
    """The first of ``n`` consecutive ports nothing listens on."""
    for base in range(20000 + os.getpid() % 20000, 65000, 17):
        socks = []
        try:
            for p in range(base, base + n):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", p))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no free ports")


def _env() -> dict[str, str]:
    """The children's environment: without this package's forced host devices (one device each)."""
    return {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}


def _wait_ready(url: str, procs: list[subprocess.Popen], logs: list, ready) -> None:
    deadline = time.monotonic() + 600
    while True:
        for i, p in enumerate(procs):
            assert p.poll() is None, open(logs[i].name).read()[-3000:] if i < len(logs) else f"{p.args} exited"
        assert time.monotonic() < deadline, f"{url} not ready"
        try:
            r = httpx.get(url, timeout=2)
            if r.status_code == 200 and ready(r.json()):
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)


def _stop(proc: subprocess.Popen, sig=signal.SIGINT) -> int:
    if proc.poll() is None:
        proc.send_signal(sig)
    try:
        return proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait()


@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
    """(router url, single-server url, replica urls, the serve-replicas process, its log path)."""
    logs_dir = tmp_path_factory.mktemp("replicas")
    serve = [*SERVE, "--compile-cache", str(logs_dir / "xla")]  # the replicas load what the single server compiled
    base = _free_ports(4)  # replicas base, base + 1; the router base + 2; the single server base + 3
    rep_log, one_log = open(logs_dir / "replicas.log", "w"), open(logs_dir / "single.log", "w")
    router, one = f"http://127.0.0.1:{base + 2}", f"http://127.0.0.1:{base + 3}"
    single = subprocess.Popen([sys.executable, "-m", "jaxserve.cli", "serve", "--port", str(base + 3), *serve],
                              stdout=one_log, stderr=subprocess.STDOUT, env=_env())
    replicas = None
    try:
        # the single server first: on a cold compile cache it compiles, and the replicas load its programs
        _wait_ready(f"{one}/health", [single], [one_log], lambda _: True)
        replicas = subprocess.Popen([sys.executable, "-m", "jaxserve.cli", "serve-replicas", "--replicas", "2",
                                     "--base-port", str(base), "--router-port", str(base + 2), *serve],
                                    stdout=rep_log, stderr=subprocess.STDOUT, env=_env())
        _wait_ready(f"{router}/readiness", [single, replicas], [one_log, rep_log],
                    lambda r: r.get("healthy_workers") == 2)
        yield router, one, [f"http://127.0.0.1:{base + i}" for i in range(2)], replicas, logs_dir / "replicas.log"
    finally:
        _stop(single)
        if replicas is not None:
            _stop(replicas, signal.SIGTERM)
        rep_log.close()
        one_log.close()


def _run(url: str, seed: int) -> list:
    """The workload (``seed``) through ``url``: the bench's records, in workload order."""
    cfg = Config(url=url, workload="multi-turn", api="chat", seed=seed, timeout=300.0, **WORKLOAD)
    sessions = make_workload("multi-turn", seed=seed, num_prompts=cfg.num_prompts, input_len=cfg.input_len,
                             output_len=cfg.output_len, prompt_format="text", turns=cfg.turns)

    async def go():
        async with httpx.AsyncClient(timeout=cfg.timeout) as http:
            records, _ = await run_once(Client(http, url, None, "chat"), cfg, MODEL, sessions, CONCURRENCY,
                                        lambda rec: None)
        return records

    records = asyncio.run(go())
    assert all(r.ok for r in records), [r.error for r in records if not r.ok][:3]
    return records


def _share(records) -> float:
    return sum(r.cached_tokens for r in records) / sum(r.prompt_tokens for r in records)


def test_router_lists_the_model_and_forwards(deployment):
    router, one, _, _, _ = deployment
    assert httpx.get(f"{one}/server_info").json() == {"served_model_name": MODEL}
    assert [m["id"] for m in httpx.get(f"{router}/v1/models").json()["data"]] == [MODEL]
    body = request_body("completions", MODEL, "Hello there", 4, True, stream=False)
    ours, theirs = (httpx.post(f"{u}/v1/completions", json=body, timeout=120).json() for u in (router, one))
    assert ours["choices"][0]["text"] == theirs["choices"][0]["text"] and ours["usage"]["completion_tokens"] == 4


def test_cache_aware_routing_keeps_the_hit_rate(deployment):
    router, one, urls, _, _ = deployment
    single = _run(one, seed=0)
    routed = _run(router, seed=0)
    assert [r.text for r in routed] == [r.text for r in single]
    assert all(r.cached_tokens == 0 for r in single if r.item.turn == 0)  # every session starts cold
    s_single, s_routed = _share(single), _share(routed)
    assert s_single > 0.3, s_single  # the workload really reuses its prefixes
    assert s_routed >= 0.9 * s_single, (s_routed, s_single)

    # baseline: the same replicas behind a round-robin router, a fresh workload of the same shape
    port = _free_ports(2)
    rr = subprocess.Popen([sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port",
                           str(port), "--policy", "round_robin", "--worker-urls", *urls,
                           "--worker-startup-check-interval", "1", "--log-level", "error",
                           "--prometheus-port", str(port + 1)], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    try:
        _wait_ready(f"http://127.0.0.1:{port}/readiness", [rr], [], lambda r: r.get("healthy_workers") == 2)
        s_rr = _share(_run(f"http://127.0.0.1:{port}", seed=1))
    finally:
        _stop(rr, signal.SIGTERM)
    assert s_rr < 0.6 * s_routed, (s_rr, s_routed)


def test_sigterm_stops_every_process(deployment):
    router, _, urls, command, log_path = deployment
    assert _stop(command, signal.SIGTERM) == 0, open(log_path).read()[-3000:]
    for url in (router, *urls):
        with pytest.raises(httpx.TransportError):
            httpx.get(f"{url}/health", timeout=2)


# ------------------------------------------------------------------ the plan and the flags (no process)


def test_plan_gives_each_replica_its_own_devices():
    got = replicas.plan(2, 9001, 9000, 2, ("0", "1", "2", "3", "4"))
    assert [(r.port, r.devices) for r in got] == [(9001, ("0", "1")), (9002, ("2", "3"))]
    assert [r.devices for r in replicas.plan(3, 9001, 9000, 1, None)] == [None] * 3  # a CPU host
    assert replicas.visible_devices("4, 5") == ("4", "5")


@pytest.mark.parametrize("args, message", [
    ((0, 9001, 9000, 1, None), "--replicas must be >= 1"),
    ((2, 9001, 9002, 1, None), "is one of the replicas' ports"),
    ((2, 65535, 9000, 1, None), "must be in 1..65535"),
    ((2, 9001, 9000, 2, ("0", "1", "2")), "need 4 devices, but only 3"),
    ((2, 9001, 9000, 1, ("0", "0")), "lists a device twice"),
])
def test_plan_errors(args, message):
    with pytest.raises(replicas.ReplicasError, match=message):
        replicas.plan(*args)


def test_bad_flags_exit_2_before_starting_anything(capsys):
    assert replicas.main(["--port", "8000"]) == 2
    assert "--port is set per replica" in capsys.readouterr().err
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert replicas.main(["--router-port", str(port), "--base-port", str(_free_ports(2))]) == 2
    assert f"cannot listen on 127.0.0.1:{port}" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:  # a flag neither serve-replicas nor serve knows: argparse's exit 2
        replicas.main(["--no-such-flag"])
    assert e.value.code == 2
