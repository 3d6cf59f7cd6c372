"""What the scheduler counts and reports: token and request counters, latency histograms,
the internal-state dict (/get_server_info, metrics) and the KV leak check."""
from __future__ import annotations

import time
from typing import Any

from radixlang.runtime.scheduler.latency import E2E_BUCKETS, ITL_BUCKETS, TTFT_BUCKETS, Histogram
from radixlang.runtime.scheduler.batch import Req
from radixlang.runtime.mem_cache.memory_pool import ReqToTokenPool, TokenToKVPool
from radixlang.runtime.mem_cache.req_cache import ReqCache
from radixlang.runtime.mem_cache.swa_memory_pool import SWATokenToKVPool

COUNTERS = ("prompt_tokens", "cached_tokens", "generated_tokens", "num_requests", "num_retractions",
            "forward_steps", "jump_forward_tokens", "spec_draft_tokens", "spec_accepted_tokens")


class SchedulerStats:
    def __init__(self) -> None:
        self.counts: dict[str, int] = dict.fromkeys(COUNTERS, 0)
        self.latency = {"time_to_first_token_seconds": Histogram(TTFT_BUCKETS),
                        "inter_token_latency_seconds": Histogram(ITL_BUCKETS),
                        "e2e_request_latency_seconds": Histogram(E2E_BUCKETS)}

    def observe_token(self, req: Req, now: float) -> None:
        """A sampled token of ``req`` at ``now`` (time.monotonic): its first-token or inter-token latency."""
        if req.last_token_time is None:
            self.latency["time_to_first_token_seconds"].observe(now - req.arrival_time)
        else:
            self.latency["inter_token_latency_seconds"].observe(now - req.last_token_time)
        req.last_token_time = now

    def observe_finish(self, req: Req) -> None:
        self.counts["prompt_tokens"] += req.prompt_len
        self.counts["cached_tokens"] += req.cached_tokens
        self.latency["e2e_request_latency_seconds"].observe(time.monotonic() - req.arrival_time)

    def internal_state(self, *, kv_pool: TokenToKVPool, cache: ReqCache, num_running: int, num_waiting: int,
                       context_len: int, vocab_size: int) -> dict[str, Any]:
        s = self.counts
        return {
            "memory": {"kv_total_tokens": kv_pool.size, "kv_free_tokens": kv_pool.available_size(),
                       "kv_cached_tokens": cache.cached_size(), "kv_evictable_tokens": cache.evictable_size(),
                       "kv_protected_tokens": cache.protected_size(),
                       "kv_bytes_per_token": kv_pool.per_token_bytes, "kv_total_bytes": kv_pool.total_bytes,
                       **_swa_memory(kv_pool, cache)},
            "cache_hit_rate": (s["cached_tokens"] / s["prompt_tokens"]) if s["prompt_tokens"] else 0.0,
            "num_running_reqs": num_running, "num_waiting_reqs": num_waiting,
            "context_length": context_len, "vocab_size": vocab_size,
            "latency": {name: h.to_dict() for name, h in self.latency.items()},
            **s,
        }


def _swa_memory(kv_pool: TokenToKVPool, cache: ReqCache) -> dict[str, int]:
    """The window layers' slot space, where they have one (kv_total_bytes counts both spaces)."""
    if not isinstance(kv_pool, SWATokenToKVPool):
        return {}
    return {"swa_total_tokens": kv_pool.swa_size, "swa_free_tokens": kv_pool.swa_available_size(),
            "swa_cached_tokens": cache.swa_cached_size(), "swa_bytes_per_token": kv_pool.swa.per_token_bytes,
            "full_bytes_per_token": kv_pool.full.per_token_bytes}


def find_memory_leak(kv_pool: TokenToKVPool, req_to_token_pool: ReqToTokenPool, cache: ReqCache) -> str | None:
    """With no request in flight: every KV slot is free or held by the prefix cache, and every
    request slot is free. Returns what is wrong, or None."""
    free, cached = kv_pool.available_size(), cache.cached_size()
    req_free = req_to_token_pool.available_size()
    if isinstance(kv_pool, SWATokenToKVPool):
        swa_free, swa_cached = kv_pool.swa_available_size(), cache.swa_cached_size()
        if swa_free + swa_cached != kv_pool.swa_size:
            return (f"memory leak detected: swa free {swa_free} + cached {swa_cached} != total "
                    f"{kv_pool.swa_size} window-layer KV slots")
    if free + cached == kv_pool.size and req_free == req_to_token_pool.size:
        return None
    return (f"memory leak detected: free {free} + cached {cached} != total {kv_pool.size} KV slots, "
            f"or req slots free {req_free} != {req_to_token_pool.size}")
