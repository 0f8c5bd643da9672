"""Host wall time of ``jaxserve sim`` per scheduling policy on a long waiting queue.

Every request of a shared-prompt workload arrives within a fraction of a second, so the scheduler
plans thousands of steps with a queue of thousands: the case where a policy that ranks the whole
queue every step (``lpm``, ``dfs-weight``, ``spjf``) can cost more host time than the simulated
device. Prints one line per (queue size, policy): wall and CPU seconds of the simulation (CPU time
is the steadier figure on a shared host), steps, the mean waiting queue, the hit rate, and a digest
of the schedule (every request's first-token and finish times and cached tokens), which must not
change when only the speed of a policy changes.

    .venv/bin/python benchmarks/sim_policies.py [--n 2000,8000] [--policies fcfs,lpm,dfs-weight]
"""

from __future__ import annotations

import argparse
import hashlib
import platform
import time

from jaxserve.sim import workload
from jaxserve.sim.cost import FEATURES, CostModel
from jaxserve.sim.simulator import SimConfig, simulate

# A mid-size engine: 64 running, 8k-token steps, a snapshot pool that cannot hold every prefix.
CONFIG = SimConfig(page_size=16, num_pages=16384, num_slots=256, max_prefill_tokens=8192, max_running=64,
                   max_model_len=8192)
COST = CostModel(tuple({"const": 0.01, "tokens": 2e-5, "rows": 1e-4}.get(f, 0.0) for f in FEATURES))


def schedule_digest(result) -> str:
    h = hashlib.blake2b(digest_size=8)
    for r in result.requests:
        h.update(f"{r.rid}:{r.first_token!r}:{r.finish!r}:{r.cached_tokens};".encode())
    return h.hexdigest()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", default="2000,8000", help="requests (= the queue at its longest), comma-separated")
    p.add_argument("--policies", default="fcfs,lpm,dfs-weight,spjf")
    p.add_argument("--groups", type=int, default=32, help="shared system prompts")
    p.add_argument("--output-len", type=int, default=16)
    args = p.parse_args()
    print(f"# {platform.processor() or platform.machine()}, python {platform.python_version()}; "
          f"{CONFIG.max_running} running, {CONFIG.num_slots} slots, {args.groups} prompts of 1024 + ~256 tokens")
    print(f"{'n':>6} {'policy':>11} {'wall_s':>8} {'cpu_s':>8} {'steps':>6} {'mean_waiting':>12} {'hit_rate':>8}  digest")
    for n in (int(x) for x in args.n.split(",")):
        records = workload.shared_prompts(n, rate=n * 10.0, groups=args.groups, output_len=args.output_len, seed=0)
        for policy in args.policies.split(","):
            cpu0 = time.process_time()
            res = simulate(records, policy, COST, CONFIG)
            cpu = time.process_time() - cpu0
            waiting = res.pressure.summary()["waiting"]["mean"]
            print(f"{n:>6} {policy:>11} {res.wall_s:>8.2f} {cpu:>8.2f} {res.steps:>6} {waiting:>12.0f} "
                  f"{res.cache['hit_rate']:>8.3f}  {schedule_digest(res)}", flush=True)


if __name__ == "__main__":
    main()
