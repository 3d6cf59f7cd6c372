"""A bounded soak against a live server: mixed requests at 16-way concurrency, no errors, no leaked KV."""
from __future__ import annotations

import pytest

from bench.soak import soak
from tests.live_server import live_server

pytestmark = pytest.mark.e2e


def test_soak_200_mixed_requests(tiny_model_dir):
    # a small KV pool, so 16 requests in flight also exercise queueing and retraction
    with live_server(tiny_model_dir, max_total_tokens=1024) as url:
        result = soak(url, 200, 16, time_limit_s=300)
    assert result["errors"] == [], result["errors"][:5]
    assert result["leaked_kv_slots"] == 0 and result["running_after"] == 0, result
