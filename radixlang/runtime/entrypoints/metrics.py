"""Prometheus /metrics: a collector that reads the scheduler's counters at scrape time.

One registry per app (no module-level state); values come from
``Engine.get_server_info()`` so nothing is counted twice.
"""
from __future__ import annotations

from typing import Any, Callable, Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

_HISTOGRAMS = {"time_to_first_token_seconds": "seconds from arrival at the scheduler to the first output token",
               "inter_token_latency_seconds": "seconds between consecutive output steps of a request",
               "e2e_request_latency_seconds": "seconds from arrival at the scheduler to the finish"}
_COUNTERS = {"num_requests": "requests finished", "prompt_tokens": "prompt tokens of finished requests",
             "cached_tokens": "prompt tokens served from the prefix cache",
             "generated_tokens": "tokens generated", "num_retractions": "requests retracted for lack of KV",
             "spec_draft_tokens": "tokens drafted by speculative decoding",
             "spec_accepted_tokens": "drafted tokens the model accepted"}


class EngineCollector:
    def __init__(self, server_info: Callable[[], dict[str, Any]]) -> None:
        self.server_info = server_info

    def collect(self) -> Iterator[Any]:
        info = self.server_info()
        for key, doc in _COUNTERS.items():
            yield CounterMetricFamily(f"radixlang_{key}", doc, value=info[key])
        mem = info["memory"]
        gauges = {"num_running_reqs": (info["num_running_reqs"], "requests decoding"),
                  "num_queue_reqs": (info["num_waiting_reqs"], "requests waiting"),
                  "cache_hit_rate": (info["cache_hit_rate"], "cached / prompt tokens of finished requests"),
                  "kv_total_tokens": (mem["kv_total_tokens"], "KV pool size in tokens"),
                  "kv_used_tokens": (mem["kv_total_tokens"] - mem["kv_free_tokens"], "KV slots in use or cached"),
                  "token_usage": ((mem["kv_total_tokens"] - mem["kv_free_tokens"] - mem["kv_cached_tokens"])
                                  / mem["kv_total_tokens"], "fraction of KV held by running requests")}
        for key, (value, doc) in gauges.items():
            yield GaugeMetricFamily(f"radixlang_{key}", doc, value=value)
        for key, doc in _HISTOGRAMS.items():
            h = info["latency"][key]
            cumulative, acc = [], 0
            for bound, n in zip([*map(str, h["buckets"]), "+Inf"], h["counts"]):
                acc += n
                cumulative.append((bound, acc))
            yield HistogramMetricFamily(f"radixlang_{key}", doc, buckets=cumulative, sum_value=h["sum"])


def make_registry(server_info: Callable[[], dict[str, Any]]) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(EngineCollector(server_info))
    return registry


def render(registry: CollectorRegistry) -> bytes:
    return generate_latest(registry)
