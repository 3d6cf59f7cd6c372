"""Waiting-queue order: lpm (longest prefix match first), dfs-weight, fcfs."""
from __future__ import annotations

from typing import Any

from radixlang.runtime.scheduler.batch import Req

LPM_MAX_QUEUE = 128  # beyond this, matching every waiting request each step costs more than it saves


def order_waiting(waiting: list[Req], policy: str, cache: Any) -> list[Req]:
    """Return the waiting requests in admission order (the list itself is not changed)."""
    if policy == "fcfs" or len(waiting) > LPM_MAX_QUEUE:
        return list(waiting)
    if policy == "lpm":
        return sorted(waiting, key=lambda r: -cache.prefix_len(r))  # stable: FCFS among equals
    if policy == "dfs-weight":
        return cache.dfs_weight_order(waiting)
    raise ValueError(f"unknown schedule policy {policy!r}")
