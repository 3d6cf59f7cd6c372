from __future__ import annotations

import pytest

from radixlang.runtime.io_struct import (
    CheckMemoryLeakOut, FlushCacheOut, GetInternalStateOut, GetInternalStateReq, SchedulerReady, decode, encode,
)
from radixlang.runtime.scheduler.latency import TTFT_BUCKETS, Histogram
from radixlang.runtime.dp.replica_states import merge_states


def _state(requests: int, prompt: int, cached: int, free: int, ttft: list[float]) -> dict:
    h = Histogram(TTFT_BUCKETS)
    for v in ttft:
        h.observe(v)
    return {"memory": {"kv_total_tokens": 100, "kv_free_tokens": free}, "num_requests": requests,
            "prompt_tokens": prompt, "cached_tokens": cached, "cache_hit_rate": cached / prompt,
            "context_length": 2048, "vocab_size": 50, "latency": {"time_to_first_token_seconds": h.to_dict()}}


def test_merge_states_sums_counts_memory_and_histograms():
    a, b = _state(2, 10, 5, 90, [0.02]), _state(3, 30, 0, 70, [0.02, 100.0])
    merged = merge_states([a, b])
    assert merged["num_requests"] == 5 and merged["memory"] == {"kv_total_tokens": 200, "kv_free_tokens": 160}
    assert merged["cache_hit_rate"] == 5 / 40
    assert merged["context_length"] == 2048 and merged["vocab_size"] == 50
    h = merged["latency"]["time_to_first_token_seconds"]
    assert h["count"] == 3 and h["counts"][1] == 2 and h["counts"][-1] == 1 and h["buckets"] == list(TTFT_BUCKETS)
    assert merge_states([a]) is a


@pytest.mark.parametrize("msg", [
    GetInternalStateReq(rid="c1"), GetInternalStateOut(state={"x": [1, 2]}, rid="c1"),
    FlushCacheOut(success=False, message="busy", rid="c2"), CheckMemoryLeakOut(ok=True, rid="c3"),
    SchedulerReady(replica=1, pid=42, server_args={"dp_size": 2}, model_path="m", tokenizer_path="t"),
])
def test_control_messages_round_trip_with_their_ids(msg):
    assert decode(encode(msg)) == msg
