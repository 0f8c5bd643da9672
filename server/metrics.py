"""Prometheus text exposition (format 0.0.4) without a client library.

The engine thread writes (counters, gauges, histograms); ``/metrics`` reads and renders. Each
value is one Python object guarded by a lock, so a scrape sees every metric whole (a histogram's
buckets, sum and count agree), though not all metrics at the same instant.

Derived rates a dashboard computes: tokens/s = rate(jaxserve_generation_tokens_total), prefix-cache
hit rate = rate(jaxserve_cached_prompt_tokens_total) / rate(jaxserve_prompt_tokens_total), pool
pressure = *_used / *_total.
"""

from __future__ import annotations

import bisect
import math
import threading

PREFIX = "jaxserve_"


def _fmt(v: float) -> str:
    if v == math.inf:
        return "+Inf"
    if float(v).is_integer():
        return str(int(v))
    return repr(float(v))


def _labels(labels: dict[str, str]) -> str:
    if not labels:
        return ""
    esc = lambda s: str(s).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')  # noqa: E731
    return "{" + ",".join(f'{k}="{esc(v)}"' for k, v in sorted(labels.items())) + "}"


class _Metric:
    kind = "untyped"

    def __init__(self, name: str, help: str):
        self.name, self.help = PREFIX + name, help
        self._lock = threading.Lock()

    def header(self) -> list[str]:
        return [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} {self.kind}"]


class Counter(_Metric):
    """A monotonic counter, optionally split by one label (``reason=...``)."""

    kind = "counter"

    def __init__(self, name: str, help: str, label: str | None = None):
        super().__init__(name, help)
        self.label = label
        self._values: dict[str | None, float] = {} if label else {None: 0.0}

    def inc(self, amount: float = 1, **labels: str) -> None:
        key = labels.get(self.label) if self.label else None
        with self._lock:
            self._values[key] = self._values.get(key, 0.0) + amount

    def value(self, **labels: str) -> float:
        key = labels.get(self.label) if self.label else None
        with self._lock:
            return self._values.get(key, 0.0)

    def render(self) -> list[str]:
        with self._lock:
            items = sorted(self._values.items(), key=lambda kv: str(kv[0]))
        return self.header() + [f"{self.name}{_labels({self.label: k} if self.label else {})} {_fmt(v)}" for k, v in items]


class Gauge(_Metric):
    kind = "gauge"

    def __init__(self, name: str, help: str):
        super().__init__(name, help)
        self._value = 0.0

    def set(self, v: float) -> None:
        self._value = float(v)

    def value(self) -> float:
        return self._value

    def render(self) -> list[str]:
        return self.header() + [f"{self.name} {_fmt(self._value)}"]


class Observed(_Metric):
    """A value read when scraped, from a function set by whoever owns it (``observe``): for numbers
    kept elsewhere, like the process's compile counts. 0 until a function is set."""

    def __init__(self, name: str, help: str, kind: str = "gauge"):
        super().__init__(name, help)
        self.kind = kind
        self._fn = lambda: 0.0

    def observe(self, fn) -> None:
        self._fn = fn

    def value(self) -> float:
        return float(self._fn())

    def render(self) -> list[str]:
        return self.header() + [f"{self.name} {_fmt(self.value())}"]


class Histogram(_Metric):
    kind = "histogram"

    def __init__(self, name: str, help: str, buckets: tuple[float, ...]):
        super().__init__(name, help)
        self.buckets = tuple(sorted(buckets)) + (math.inf,)
        self._counts = [0] * len(self.buckets)
        self._sum = 0.0
        self._count = 0

    def observe(self, v: float) -> None:
        i = bisect.bisect_left(self.buckets, v)
        with self._lock:
            self._counts[i] += 1
            self._sum += v
            self._count += 1

    @property
    def count(self) -> int:
        return self._count

    def render(self) -> list[str]:
        with self._lock:
            counts, total, n = list(self._counts), self._sum, self._count
        lines, acc = self.header(), 0
        for le, c in zip(self.buckets, counts):
            acc += c
            lines.append(f'{self.name}_bucket{{le="{_fmt(le)}"}} {acc}')
        return lines + [f"{self.name}_sum {_fmt(total)}", f"{self.name}_count {n}"]


_LATENCY = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)


class Metrics:
    def __init__(self):
        self.running = Gauge("num_requests_running", "Requests admitted to the engine (holding pages/slots).")
        self.waiting = Gauge("num_requests_waiting", "Requests queued for admission.")
        self.prompt_tokens = Counter("prompt_tokens_total", "Prompt tokens of accepted requests.")
        self.cached_tokens = Counter("cached_prompt_tokens_total", "Prompt tokens served from the prefix cache.")
        self.generation_tokens = Counter("generation_tokens_total", "Tokens generated.")
        self.requests_finished = Counter("request_finished_total", "Finished requests by finish reason.", label="reason")
        self.pages_used = Gauge("kv_pages_used", "KV pages held by requests or the prefix tree.")
        self.pages_total = Gauge("kv_pages_total", "KV pages in the pool.")
        self.slots_used = Gauge("state_slots_used", "Linear-state slots held by requests or tree snapshots.")
        self.slots_total = Gauge("state_slots_total", "Linear-state slots in the pool.")
        self.tree_snapshots = Gauge("prefix_cache_snapshots", "Linear-state snapshots held by the prefix tree.")
        self.tree_pages = Gauge("prefix_cache_pages", "KV pages held by the prefix tree.")
        self.preemptions = Gauge("num_preemptions", "Requests preempted since start (monotonic).")
        self.step_failures = Gauge("step_failures", "Steps that failed on the device since start (monotonic); each "
                                   "failed only the requests it carried (finish reason 'error').")
        self.checksum_mismatches = Gauge("snapshot_checksum_mismatches",
                                         "Snapshot checksum mismatches (--debug-snapshot-checksums); must stay 0.")
        self.step_compiles = Observed("step_compiles_total", "XLA compiles (or compile-cache loads) of the serving "
                                      "step in this process; a server makes all of them before it is ready.",
                                      kind="counter")
        self.compiles_after_ready = Observed("compiles_after_ready_total", "XLA compiles (or compile-cache loads) of any "
                                             "program after the server became ready; stays 0 when no request waits for "
                                             "a compile.", kind="counter")
        self.ttft = Histogram("time_to_first_token_seconds", "Time from request arrival to its first token.", _LATENCY)
        self.itl = Histogram("inter_token_latency_seconds", "Time between consecutive tokens of a request.", _LATENCY)
        self.e2e = Histogram("e2e_request_latency_seconds", "Time from request arrival to its end.", _LATENCY)

    def render(self) -> str:
        lines: list[str] = []
        for m in vars(self).values():
            if isinstance(m, _Metric):
                lines += m.render()
        return "\n".join(lines) + "\n"
