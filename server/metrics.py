"""The server's Prometheus metrics (prometheus-client, one registry per ``Metrics``).

Two kinds of source:
- events the engine thread sees as they happen (tokens, finished requests, latencies): counters and
  histograms updated on that thread;
- the engine's own state and counters (pools, queue lengths, preemptions, failed steps, prefix-cache
  and barrier counters): the latest ``EngineStats`` snapshot (``engine_stats``, replaced whole by
  the engine thread after every round), rendered when scraped; and numbers owned elsewhere
  (``observe``: the process's compile counts).
A scrape sees each metric whole (a histogram's buckets, sum and count agree), and all the
snapshot's metrics from the same instant.

Derived rates a dashboard computes: tokens/s = rate(jaxserve_generation_tokens_total), prefix-cache
hit rate = rate(jaxserve_cached_prompt_tokens_total) / rate(jaxserve_prompt_tokens_total), pool
pressure = *_used / *_total, share of host time spent waiting for the device =
rate(jaxserve_barrier_seconds_total).
"""

from __future__ import annotations

from typing import Callable

import prometheus_client
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from jaxserve.engine.engine import EngineStats

PREFIX = "jaxserve_"

# No "<counter>_created" timestamp series (process-wide, the library's only switch): a server
# process has one start time, and every counter here starts with it.
prometheus_client.disable_created_metrics()

_LATENCY = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)

# EngineStats fields: (metric name, kind, help). Counters get prometheus' "_total" suffix.
_ENGINE = (
    ("running", "num_requests_running", "gauge", "Requests admitted to the engine (holding pages/slots)."),
    ("waiting", "num_requests_waiting", "gauge", "Requests queued for admission."),
    ("pages_used", "kv_pages_used", "gauge", "KV pages held by requests or the prefix tree."),
    ("pages_total", "kv_pages_total", "gauge", "KV pages in the pool."),
    ("slots_used", "state_slots_used", "gauge", "Linear-state slots held by requests or tree snapshots."),
    ("slots_total", "state_slots_total", "gauge", "Linear-state slots in the pool."),
    ("tree_snapshots", "prefix_cache_snapshots", "gauge", "Linear-state snapshots held by the prefix tree."),
    ("tree_pages", "prefix_cache_pages", "gauge", "KV pages held by the prefix tree."),
    ("preemptions", "num_preemptions", "counter", "Requests preempted (released, requeued, recomputed)."),
    ("failed_steps", "step_failures", "counter", "Steps that failed on the device; each failed only the requests "
     "it carried (finish reason 'error')."),
    # A gauge by name for the probe's sake (`jaxserve probe` reads it by this suffix); it never falls.
    ("checksum_mismatches", "snapshot_checksum_mismatches", "gauge",
     "Snapshot checksum mismatches (--debug-snapshot-checksums); must stay 0."),
)
_CACHE_HELP = {
    "queries": "Prefix-cache lookups (one per admission).",
    "hits": "Prefix-cache lookups that found a usable prefix.",
    "query_tokens": "Tokens looked up in the prefix cache.",
    "hit_tokens": "Tokens found in the prefix cache (usable: ending at a live snapshot).",
    "inserts": "Prefixes inserted into the prefix cache.",
    "snapshots_adopted": "Donated linear-state snapshots the tree kept.",
    "snapshots_deduped": "Donated snapshots freed because their boundary already had one.",
    "snapshots_evicted": "Snapshots evicted under slot pressure.",
    "snapshots_bounded": "Snapshots dropped by the per-path bound.",
    "kv_pages_dropped": "Tree references to KV pages dropped by evictions and removals.",
    "kv_pages_freed": "KV pages freed by the tree (their last reference dropped).",
}


class Metrics:
    def __init__(self):
        self.registry = r = CollectorRegistry()
        self.content_type = CONTENT_TYPE_LATEST
        self.engine_stats: EngineStats | None = None
        self._observed: dict[str, tuple[str, Callable[[], float]]] = {}
        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", "Prompt tokens of accepted requests.", registry=r)
        self.cached_tokens = Counter(PREFIX + "cached_prompt_tokens", "Prompt tokens served from the prefix cache.",
                                     registry=r)
        self.generation_tokens = Counter(PREFIX + "generation_tokens", "Tokens generated.", registry=r)
        self.requests_finished = Counter(PREFIX + "request_finished", "Finished requests by finish reason.",
                                         ["reason"], registry=r)
        self.ttft = Histogram(PREFIX + "time_to_first_token_seconds", "Time from request arrival to its first token.",
                              buckets=_LATENCY, registry=r)
        self.itl = Histogram(PREFIX + "inter_token_latency_seconds", "Time between consecutive tokens of a request.",
                             buckets=_LATENCY, registry=r)
        self.e2e = Histogram(PREFIX + "e2e_request_latency_seconds", "Time from request arrival to its end.",
                             buckets=_LATENCY, registry=r)
        r.register(_Snapshot(self))

    def observe(self, name: str, help: str, fn: Callable[[], float]) -> None:
        """A counter kept elsewhere (``name`` without ``_total``), read with ``fn()`` when scraped."""
        self._observed[name] = (help, fn)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def value(self, name: str, **labels: str) -> float:
        """A sample's current value (``name`` as exposed, e.g. ``jaxserve_request_finished_total``); 0 if absent."""
        return self.registry.get_sample_value(name, labels) or 0.0


class _Snapshot:
    """Renders the latest ``EngineStats`` and the observed counters at scrape time."""

    def __init__(self, metrics: Metrics):
        self.metrics = metrics

    def collect(self):
        for name, (help, fn) in self.metrics._observed.items():
            yield CounterMetricFamily(PREFIX + name, help, value=float(fn()))
        st = self.metrics.engine_stats
        if st is None:
            return
        for field, name, kind, help in _ENGINE:
            family = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
            yield family(PREFIX + name, help, value=float(getattr(st, field)))
        for field, value in st.cache.items():
            help = _CACHE_HELP.get(field, f"Prefix cache: {field}.")
            yield CounterMetricFamily(f"{PREFIX}prefix_cache_{field}", help, value=float(value))
        count = CounterMetricFamily(PREFIX + "barriers", "Times the host waited for the device to finish its "
                                    "dispatched steps (ARCHITECTURE.md invariant 3), by site.", labels=["site"])
        seconds = CounterMetricFamily(PREFIX + "barrier_seconds", "Seconds the host spent waiting in those barriers, "
                                      "by site.", labels=["site"])
        for site, (n, secs) in st.barriers.items():
            count.add_metric([site], float(n))
            seconds.add_metric([site], float(secs))
        yield count
        yield seconds
