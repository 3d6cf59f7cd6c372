"""Smoke test: bench.serving starts two servers on the tiny model (with and without the radix cache),
streams a handful of requests to each and writes a JSON with every metric; every request succeeds."""
from __future__ import annotations

import json

import pytest

from bench import serving
from bench.serving_data import random_dataset, shared_prefix_dataset

pytestmark = pytest.mark.e2e

METRICS = ("completed", "failed", "duration_s", "request_throughput", "input_token_throughput",
           "output_token_throughput", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms",
           "e2e_p50_ms", "e2e_p99_ms", "cache_hit_rate")


def test_serving_bench_on_tiny_model(tiny_model_dir, tmp_path):
    out = tmp_path / "serving.json"
    serving.main(["--model-path", tiny_model_dir, "--load-format", "dummy", "--max-total-tokens", "4096",
                  "--num-groups", "2", "--prompts-per-group", "3", "--system-prompt-len", "96",
                  "--question-len", "8", "--output-len", "5", "--max-concurrency", "4", "--time-limit", "120",
                  "--out", str(out)])
    result = json.loads(out.read_text())
    assert set(result["runs"]) == {"radix_cache", "no_radix_cache"}
    for name, run in result["runs"].items():
        assert all(m in run for m in METRICS), (name, sorted(run))
        assert run["completed"] == 6 and run["failed"] == 0, run["errors"]
        assert run["total_output_tokens"] == 6 * 5  # ignore_eos: every request ran to its budget
        assert run["ttft_p50_ms"] > 0 and run["itl_p50_ms"] > 0
    # 2 system prompts shared by 3 questions each: the cached server reuses them, the other cannot
    assert result["runs"]["radix_cache"]["cache_hit_rate"] > 0.3
    assert result["runs"]["no_radix_cache"]["cache_hit_rate"] == 0.0
    assert set(result["ratios"]) >= {"request_throughput", "ttft_p50_ms", "e2e_p99_ms"}


def test_datasets_are_seeded_and_sized():
    a = random_dataset(5, (10, 20), (3, 7), vocab_size=5000, seed=1)
    assert a == random_dataset(5, (10, 20), (3, 7), vocab_size=5000, seed=1)
    assert all(10 <= len(r.input_ids) <= 20 and 3 <= r.output_len <= 7 for r in a)
    assert all(1000 <= t < 5000 for r in a for t in r.input_ids)
    shared = shared_prefix_dataset(3, 4, 50, 6, 8, vocab_size=5000, seed=0)
    assert len(shared) == 12 and all(len(r.input_ids) == 56 for r in shared)
    assert len({tuple(r.input_ids[:50]) for r in shared}) == 3  # three system prompts, four questions each
    with pytest.raises(ValueError, match="MIN <= MAX"):
        random_dataset(2, (20, 10), (1, 2), vocab_size=5000)
