"""Latency histograms: bucket edges, the +Inf bucket, and the JSON shape metrics.py reads."""
from __future__ import annotations

from radixlang.runtime.scheduler.latency import Histogram


def test_histogram_buckets_and_totals():
    h = Histogram((0.1, 1.0))
    h.observe(0.1)          # on the bound: counted in that bucket (Prometheus' le semantics)
    h.observe(0.5, times=2)
    h.observe(7.0)          # above every bound
    d = h.to_dict()
    assert d["buckets"] == [0.1, 1.0] and d["counts"] == [1, 2, 1] and d["count"] == 4
    assert abs(d["sum"] - 8.1) < 1e-9
