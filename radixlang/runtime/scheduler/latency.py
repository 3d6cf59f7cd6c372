"""Latency histograms the scheduler keeps: time to first token, inter-token latency, end to end.

Plain counts in fixed buckets (seconds), JSON-able for get_server_info and
rendered by metrics.py as Prometheus histograms. Times are measured in the
scheduler from the moment a request is added, so they include queueing and
grammar compilation but not tokenization or HTTP.
"""
from __future__ import annotations

from typing import Any

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ITL_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class Histogram:
    def __init__(self, buckets: tuple[float, ...]) -> None:
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)  # the last: above every bound (+Inf)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float, times: int = 1) -> None:
        i = next((k for k, bound in enumerate(self.buckets) if value <= bound), len(self.buckets))
        self.counts[i] += times
        self.sum += value * times
        self.count += times

    def to_dict(self) -> dict[str, Any]:
        return {"buckets": list(self.buckets), "counts": list(self.counts), "sum": self.sum, "count": self.count}
