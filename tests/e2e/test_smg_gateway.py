"""radixlang workers behind SGLang's gateway (the `smg` wheel): registration (--worker-urls and POST /workers),
native and OpenAI requests, streams, errors and an abort through it, SMG's cache_aware hit rate against the
in-process router's, and a killed worker taken out of rotation by SMG's health checks."""
from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import subprocess
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from live_server import live_runtime
from waiting import wait_until

from radixlang import Engine
from radixlang.runtime.entrypoints.smg_routes import smg_executable

pytestmark = pytest.mark.e2e

GREEDY = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}
WORKER_ARGS = {"num_threads": 1, "max_total_tokens": 8192, "served_model_name": "tiny"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def _smg(worker_urls: list[str], log_path: str):
    """`smg launch` on 127.0.0.1 (its metrics listener too), health-checked every second; stopped by PID."""
    port = _free_port()
    cmd = [smg_executable(), "launch", "--host", "127.0.0.1", "--port", str(port), "--worker-urls", *worker_urls,
           "--policy", "cache_aware", "--prometheus-host", "127.0.0.1", "--prometheus-port", str(_free_port()),
           "--health-check-interval-secs", "1", "--health-failure-threshold", "1", "--load-monitor-interval", "1",
           # SMG probes /server_info once to tell an SGLang worker; a first call can take seconds on a busy machine
           "--health-check-timeout-secs", "30",
           "--shutdown-grace-period-secs", "0", "--log-level", "warn"]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _workers(gateway: str) -> list[dict]:
    try:
        return httpx.get(gateway + "/workers", timeout=5).json()["workers"]
    except httpx.HTTPError:
        return []


def _ready_urls(gateway: str) -> set[str]:
    return {w["url"] for w in _workers(gateway) if w["status"] == "ready" and w["is_healthy"]}


@pytest.fixture(scope="module")
def cluster(tiny_model_dir, tmp_path_factory):
    """Two workers: the first given by --worker-urls, the second registered through POST /workers."""
    log = str(tmp_path_factory.mktemp("smg") / "smg.log")
    with contextlib.ExitStack() as stack, ThreadPoolExecutor(2) as pool:
        # started side by side: each start is mostly waiting on its own processes
        starts = [pool.submit(stack.enter_context, live_runtime(tiny_model_dir, **WORKER_ARGS)) for _ in range(2)]
        a, b = (f.result() for f in starts)
        with _smg([a.url], log) as gateway:
            wait_until(lambda: _ready_urls(gateway) == {a.url}, what="smg to register the --worker-urls worker")
            r = httpx.post(gateway + "/workers", json={"url": b.url}, timeout=30)
            assert r.status_code < 300, r.text
            wait_until(lambda: _ready_urls(gateway) == {a.url, b.url}, what="smg to register the POSTed worker")
            yield {"gateway": gateway, "workers": [a, b]}


def test_workers_register_as_sglang_with_loads(cluster):
    workers = _workers(cluster["gateway"])
    assert {w["runtime_type"] for w in workers} == {"sglang"}
    assert {w["model_id"] for w in workers} == {"tiny"}
    wait_until(lambda: all(w.get("engine_load") for w in _workers(cluster["gateway"])),
               what="smg to poll the workers' /v1/loads")
    load = _workers(cluster["gateway"])[0]["engine_load"]["loads"][0]
    assert load["max_total_num_tokens"] == WORKER_ARGS["max_total_tokens"]
    assert 0.0 <= load["token_usage"] <= 1.0


def test_native_generate_through_smg_equals_a_worker(cluster):
    body = {"text": "The quick brown fox", "sampling_params": GREEDY}
    direct = httpx.post(cluster["workers"][0].url + "/generate", json=body, timeout=60).json()
    via = httpx.post(cluster["gateway"] + "/generate", json=body, timeout=60)
    assert via.status_code == 200, via.text
    assert via.json()["output_ids"] == direct["output_ids"]
    assert via.json()["meta_info"]["finish_reason"]["type"] == "length"


def test_native_stream_through_smg(cluster):
    body = {"text": "Once upon a time", "stream": True, "sampling_params": GREEDY}
    with httpx.stream("POST", cluster["gateway"] + "/generate", json=body, timeout=60) as r:
        assert r.status_code == 200
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert len(events) >= 3  # chunks came one by one, not as one body
    assert '"finish_reason":{"type":"length"' in events[-2]


def test_openai_client_through_smg(cluster):
    client = openai.OpenAI(base_url=cluster["gateway"] + "/v1", api_key="none")
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=5, temperature=0)
    assert chat.choices[0].finish_reason in ("length", "stop")
    assert chat.usage.completion_tokens >= 1
    chunks = list(client.completions.create(model="tiny", prompt="hello", max_tokens=5, temperature=0,
                                            stream=True, extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) != ""
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_errors_pass_through_smg(cluster):
    r = httpx.post(cluster["gateway"] + "/generate", json={"text": "x", "sampling_params": {"temperature": -1}},
                   timeout=60)
    assert r.status_code == 400
    assert "temperature" in r.json()["error"]["message"]


def _server_info(url: str) -> dict:
    return httpx.get(url + "/get_server_info", timeout=30).json()


def test_a_closed_stream_aborts_its_request_on_the_worker(cluster):
    before = [_server_info(w.url)["generated_tokens"] for w in cluster["workers"]]
    body = {"text": "abort me", "stream": True, "sampling_params": {"max_new_tokens": 1500, "ignore_eos": True}}
    with httpx.stream("POST", cluster["gateway"] + "/generate", json=body, timeout=60) as r:
        first = next(line for line in r.iter_lines() if line.startswith("data: "))
    assert '"text"' in first

    def idle() -> list[int] | None:
        infos = [_server_info(w.url) for w in cluster["workers"]]
        return [i["generated_tokens"] for i in infos] if all(i["num_running_reqs"] == 0 for i in infos) else None

    after = wait_until(idle, what="the aborted request to leave the worker")
    assert sum(after) - sum(before) < 1500  # stopped early: the gateway passed the disconnect on


def _trace(seed: int = 0) -> list[list[str]]:
    """3 few-shot prefixes of ~100 words, 3 waves of 9 shuffled requests (as tests/e2e/test_dp.py's)."""
    rng = random.Random(seed)
    words = ["alpha", "beta", "gamma", "delta", "omega", "sigma", "kappa", "theta", "lambda", "zeta"]
    prefixes = [" ".join(rng.choice(words) for _ in range(100)) for _ in range(3)]
    waves = []
    for _ in range(3):
        wave = [p + " " + " ".join(rng.choice(words) for _ in range(rng.randrange(3, 9)))
                for p in prefixes for _ in range(3)]
        rng.shuffle(wave)
        waves.append(wave)
    return waves


def _totals(infos: list[dict]) -> tuple[int, int]:
    return sum(i["cached_tokens"] for i in infos), sum(i["prompt_tokens"] for i in infos)


def test_smg_cache_aware_hit_rate_within_10pct_of_the_in_process_router(cluster, tiny_model_dir):
    urls = [w.url for w in cluster["workers"]]
    for url in urls:
        assert httpx.post(url + "/flush_cache", timeout=30).status_code == 200
    before = _totals([_server_info(u) for u in urls])
    with ThreadPoolExecutor(9) as pool:
        for wave in _trace():
            list(pool.map(lambda t: httpx.post(cluster["gateway"] + "/generate", timeout=60,
                                               json={"text": t, "sampling_params": GREEDY}).raise_for_status(), wave))
    after = _totals([_server_info(u) for u in urls])
    smg_rate = (after[0] - before[0]) / (after[1] - before[1])

    with Engine(model_path=tiny_model_dir, load_format="dummy", max_total_tokens=8192, dp_size=2) as engine:
        for wave in _trace():
            engine.generate(wave, sampling_params=GREEDY)
        info = engine.get_server_info()
    ours = info["cached_tokens"] / info["prompt_tokens"]
    assert ours > 0.3  # the trace shares prefixes: a router that ignores them would not get here
    assert smg_rate >= 0.9 * ours, (smg_rate, ours)


def test_a_killed_worker_leaves_rotation(cluster):
    gateway, b = cluster["gateway"], cluster["workers"][1]
    os.kill(b.pid, signal.SIGKILL)  # the launcher; its scheduler and detokenizer die with it
    wait_until(lambda: b.url not in _ready_urls(gateway), what="smg's health check to take the dead worker out")
    for i in range(6):
        r = httpx.post(gateway + "/generate", json={"text": f"after {i}", "sampling_params": GREEDY}, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["meta_info"]["finish_reason"]["type"] == "length"
