"""Data-parallel replicas' state seen as one: ``merge_states`` sums the replicas'
``Scheduler.get_internal_state()`` dicts into one of the same shape (the Engine and the
server's TokenizerManager both use it; which replica serves a request is dp/router.py's).
"""
from __future__ import annotations

from typing import Any

# per-replica values that are the same on every replica: taken from the first
_SHARED_KEYS = frozenset({"context_length", "vocab_size", "kv_bytes_per_token"})


def merge_states(states: list[dict[str, Any]]) -> dict[str, Any]:
    """One state for all replicas: counts and KV sizes summed, histograms added bucket by bucket."""
    if not states:
        raise ValueError("merge_states needs at least one replica state, got none")
    if len(states) == 1:
        return states[0]
    merged = _merge(states)
    prompt, cached = merged["prompt_tokens"], merged["cached_tokens"]
    merged["cache_hit_rate"] = cached / prompt if prompt else 0.0
    return merged


def _merge(values: list[Any], key: str = "") -> Any:
    first = values[0]
    if isinstance(first, dict):
        if "buckets" in first and "counts" in first:  # a latency histogram
            return {**first, "counts": [sum(c) for c in zip(*(v["counts"] for v in values))],
                    "sum": sum(v["sum"] for v in values), "count": sum(v["count"] for v in values)}
        return {k: _merge([v[k] for v in values], k) for k in first}
    if key in _SHARED_KEYS or isinstance(first, (str, bool)) or first is None:
        return first
    if isinstance(first, (int, float)):
        return sum(values)
    return first
