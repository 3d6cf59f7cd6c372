"""A bounded soak against a live server: mixed requests at 16-way concurrency, no errors, no leaked KV,
and the server's resident memory flat after warm-up."""
from __future__ import annotations

import os

import pytest

from bench.soak import soak
from tests.live_server import live_runtime

pytestmark = pytest.mark.e2e

# RSS (VmRSS summed over the server process and its children) may grow by at most this much over the
# 200 requests after a 100-request warm-up. Measured on the tiny model: 0.3-7 MB of allocator and
# cache settling. A leak of one float32 vocab row (49,152 x 4 B = 192 KB) per finished request, made
# on purpose in the scheduler, grew it by 53 MB; the bound sits between the two (~160 KB a request).
RSS_GROWTH_BOUND_MB = 32


def test_soak_300_mixed_requests(tiny_model_dir):
    # a small KV pool, so 16 requests in flight also exercise queueing and retraction
    with live_runtime(tiny_model_dir, max_total_tokens=1024) as runtime:
        result = soak(runtime.url, 300, 16, pid=runtime.pid, time_limit_s=300, warmup=100)
    assert result["errors"] == [], result["errors"][:5]
    assert result["leaked_kv_slots"] == 0 and result["running_after"] == 0, result
    assert result["rss_before_mb"] > 100, result  # the server's own memory was read (model, torch)
    assert result["rss_growth_mb"] < RSS_GROWTH_BOUND_MB, result


def test_rss_sums_the_process_tree():
    import subprocess
    import sys

    from bench.soak import rss_mb
    alone = rss_mb(os.getpid())
    child = subprocess.Popen([sys.executable, "-c", "import sys; x = bytearray(64 << 20); print(1, flush=True); "
                              "sys.stdin.read()"], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert child.stdout.readline().strip() == b"1"  # its 64 MiB are touched
        assert rss_mb(os.getpid()) - alone > 60
    finally:
        child.stdin.close()
        child.wait(timeout=10)
    assert rss_mb(2 ** 22 + 12345) is None  # no such process
