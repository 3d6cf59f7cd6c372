"""The server's process layout: data-parallel replicas, a killed child, a graceful SIGTERM."""
from __future__ import annotations

import os
import signal
import threading
import httpx
import pytest

from radixlang.lang.backends.runtime import Runtime
from tests.waiting import GENEROUS, wait_until

pytestmark = pytest.mark.e2e


def _runtime(model_dir: str, **server_args) -> Runtime:
    args = {"load_format": "dummy", "max_total_tokens": 2048, "log_level": "warning", **server_args}
    return Runtime(model_path=model_dir, launch_timeout=300, **args)


def _wait_running(url: str, count: int = 1) -> None:
    wait_until(lambda: httpx.get(url + "/get_server_info", timeout=GENEROUS).json()["num_running_reqs"] >= count,
               what=f"{count} running requests")


def _generate_in_thread(url: str, body: dict) -> tuple[threading.Thread, dict]:
    result: dict = {}

    def run() -> None:
        try:
            r = httpx.post(url + "/generate", json=body, timeout=2 * GENEROUS)
            result.update(status=r.status_code, body=r.json())
        except httpx.HTTPError as e:
            result.update(error=repr(e))
    worker = threading.Thread(target=run)
    worker.start()
    return worker, result


def test_dp2_spreads_requests_then_a_killed_scheduler_stops_the_server(tiny_model_dir):
    runtime = _runtime(tiny_model_dir, dp_size=2, load_balance_method="round_robin")
    proc = runtime._proc
    try:
        with httpx.Client(base_url=runtime.url, timeout=60) as c:
            info = c.get("/get_server_info").json()
            assert len(info["scheduler_pids"]) == 2 and info["memory"]["kv_total_tokens"] == 2 * 2048
            outs = [c.post("/generate", json={"text": f"request {i}", "sampling_params": {"max_new_tokens": 3}})
                    for i in range(6)]
            assert all(r.status_code == 200 for r in outs)
            assert all(r.json()["meta_info"]["finish_reason"]["type"] == "length" for r in outs)
            info = c.get("/get_server_info").json()
            assert info["num_requests_per_replica"] == [3, 3] and info["num_requests"] == 6
            assert info["router"]["routed"] == [3, 3] and info["router"]["in_flight"] == [0, 0]
            mem = info["memory"]
            assert mem["kv_free_tokens"] + mem["kv_cached_tokens"] == mem["kv_total_tokens"]
            assert c.post("/flush_cache").status_code == 200
            # a request on replica 1 is running when that replica's scheduler dies
            c.post("/generate", json={"text": "to replica 0", "sampling_params": {"max_new_tokens": 1}})
            worker, result = _generate_in_thread(runtime.url, {
                "text": "long", "sampling_params": {"max_new_tokens": 1900, "ignore_eos": True}})
            _wait_running(runtime.url)
            os.kill(info["scheduler_pids"][1], signal.SIGKILL)
            worker.join(timeout=GENEROUS)
            assert result["body"]["meta_info"]["finish_reason"]["type"] == "abort", result
            assert "exited" in result["body"]["meta_info"]["finish_reason"]["message"]
            try:
                assert c.get("/health").status_code == 503
            except httpx.HTTPError:
                pass  # already gone: as good
        assert proc.wait(timeout=GENEROUS) != 0
    finally:
        runtime.shutdown()


def test_sigterm_refuses_new_requests_lets_running_ones_finish_and_exits_zero(tiny_model_dir):
    runtime = _runtime(tiny_model_dir)
    proc = runtime._proc
    try:
        long, long_result = _generate_in_thread(runtime.url, {
            "text": "long", "sampling_params": {"max_new_tokens": 1500, "ignore_eos": True}})
        _wait_running(runtime.url)
        short, short_result = _generate_in_thread(runtime.url, {
            "text": "short", "sampling_params": {"max_new_tokens": 300, "ignore_eos": True}})
        _wait_running(runtime.url, count=2)
        os.kill(proc.pid, signal.SIGTERM)
        refused = httpx.post(runtime.url + "/generate", json={"text": "late"}, timeout=GENEROUS)
        assert refused.status_code == 503 and "shutting down" in refused.json()["error"]["message"]
        assert httpx.get(runtime.url + "/health", timeout=GENEROUS).status_code == 503
        short.join(timeout=GENEROUS)
        meta = short_result["body"]["meta_info"]
        assert meta["finish_reason"]["type"] == "length" and meta["completion_tokens"] == 300, short_result
        assert proc.poll() is None  # the long request still runs: the server waits for it
        os.kill(proc.pid, signal.SIGTERM)  # a second signal: abort what runs and exit now
        long.join(timeout=GENEROUS)
        meta = long_result["body"]["meta_info"]
        assert meta["finish_reason"]["type"] == "abort" and meta["completion_tokens"] < 1500, long_result
        assert proc.wait(timeout=GENEROUS) == 0
    finally:
        runtime.shutdown()
