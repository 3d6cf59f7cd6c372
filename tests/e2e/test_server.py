"""The HTTP server as a subprocess on 127.0.0.1, stopped by PID."""
from __future__ import annotations

import json

import httpx
import pytest

from tests.live_server import live_server
from tests.waiting import GENEROUS, wait_until

pytestmark = pytest.mark.e2e
KEY = "test-key"


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    with live_server(tiny_model_dir, api_key=KEY, served_model_name="tiny") as url:
        yield url


def _client(url: str) -> httpx.Client:
    return httpx.Client(base_url=url, headers={"Authorization": f"Bearer {KEY}"}, timeout=GENEROUS)


def test_api_key_enforced(server):
    assert httpx.get(server + "/health").status_code == 200
    r = httpx.post(server + "/generate", json={"text": "hi"})
    assert r.status_code == 401 and "API key" in r.json()["error"]["message"]


def test_generate_single_batch_and_cache(server):
    with _client(server) as c:
        assert c.post("/flush_cache").status_code == 200
        body = {"input_ids": list(range(50, 80)), "sampling_params": {"max_new_tokens": 4, "temperature": 0}}
        seq = [c.post("/generate", json=body).json()["meta_info"]["cached_tokens"] for _ in range(2)]
        assert seq == [0, 29]
        out = c.post("/generate", json={"text": ["a b", "c d e"], "sampling_params": {"max_new_tokens": 3}}).json()
        assert isinstance(out, list) and len(out) == 2
        out = c.post("/generate", json={"text": "x y", "sampling_params": {"max_new_tokens": 3, "n": 2}}).json()
        assert len(out) == 2
        lp = c.post("/generate", json={"text": "one two three four", "sampling_params": {"max_new_tokens": 2},
                                       "return_logprob": True, "logprob_start_len": 1}).json()["meta_info"]
        assert lp["prompt_tokens"] == 1 + len(lp["input_token_logprobs"])


def test_stream_and_bad_input(server):
    with _client(server) as c:
        frames = []
        with c.stream("POST", "/generate", json={"text": "stream", "stream": True,
                                                 "sampling_params": {"max_new_tokens": 6, "ignore_eos": True}}) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    frames.append(line[6:])
        assert frames[-1] == "[DONE]"
        texts = [json.loads(f)["text"] for f in frames[:-1]]
        assert all(b.startswith(a) for a, b in zip(texts, texts[1:]))
        r = c.post("/generate", json={"text": "x", "sampling_params": {"top_p": 2}})
        assert r.status_code == 400 and "top_p" in r.json()["error"]["message"]
        r = c.post("/generate", json={"txt": "x"})
        assert r.status_code == 400 and "txt" in r.json()["error"]["message"]
        assert c.post("/generate", content=b"{not json").status_code == 400
        assert c.get("/get_server_info").json()["memory"]["kv_total_tokens"] == 4096


def test_openai_client(server):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=server + "/v1", api_key=KEY)
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hello"}],
                                          max_tokens=5, temperature=0)
    assert chat.choices[0].message.role == "assistant" and chat.usage.completion_tokens <= 5
    comp = client.completions.create(model="tiny", prompt="Once upon", max_tokens=4, n=2)
    assert len(comp.choices) == 2
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="tiny", messages=[], max_tokens=2)


def _idle_and_leak_free(c: httpx.Client) -> bool:
    info = c.get("/get_server_info").json()
    mem = info["memory"]
    return info["num_running_reqs"] == 0 and info["num_waiting_reqs"] == 0 and \
        mem["kv_free_tokens"] + mem["kv_cached_tokens"] == mem["kv_total_tokens"]


def _wait_idle(c: httpx.Client) -> None:
    wait_until(lambda: _idle_and_leak_free(c), what="an idle server with every KV slot back")


def test_flush_refused_while_busy_then_abort(server):
    import threading
    long = {"text": "busy", "rid": "long-1", "sampling_params": {"max_new_tokens": 1500, "ignore_eos": True}}
    result = {}
    with _client(server) as c:
        worker = threading.Thread(target=lambda: result.update(c.post("/generate", json=long).json()))
        worker.start()
        wait_until(lambda: c.get("/get_server_info").json()["num_running_reqs"], what="the long request to run")
        r = c.post("/flush_cache")
        assert r.status_code == 400 and "running" in r.json()["error"]["message"]
        assert c.post("/abort_request", json={"rid": "long-1"}).json()["success"]
        worker.join(timeout=GENEROUS)
        assert result["meta_info"]["finish_reason"]["type"] == "abort"
        assert result["meta_info"]["completion_tokens"] < 1500
        _wait_idle(c)
        assert c.post("/flush_cache").status_code == 200


def test_disconnect_mid_stream_aborts_and_frees_kv(server):
    body = {"text": "never ending", "stream": True, "sampling_params": {"max_new_tokens": 1500, "ignore_eos": True}}
    with _client(server) as c:
        before = c.get("/get_server_info").json()["generated_tokens"]
        with c.stream("POST", "/generate", json=body) as r:
            frames = 0
            for line in r.iter_lines():
                frames += line.startswith("data: ")
                if frames == 3:
                    break
        _wait_idle(c)
        info = c.get("/get_server_info").json()
        assert info["generated_tokens"] - before < 1500  # aborted: the stream did not run to its end


def test_generate_refusals_are_400_naming_the_field(server):
    with _client(server) as c:
        r = c.post("/generate", json={"input_ids": [10 ** 9], "sampling_params": {"max_new_tokens": 1}})
        assert r.status_code == 400 and r.json()["error"]["param"] == "input_ids"
        r = c.post("/generate", json={"text": "x", "top_logprobs_num": [1]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "top_logprobs_num"
        r = c.post("/generate", json={"text": "x", "sampling_params": {"temperature": -1}})
        assert r.status_code == 400 and r.json()["error"]["param"] == "temperature"
        assert c.post("/generate", json={"text": "ok", "sampling_params": {"max_new_tokens": 1}}).status_code == 200


def test_metrics_exposed_and_counting(server):
    with _client(server) as c:
        def value(name: str) -> float:
            text = c.get("/metrics").text
            return float(next(line.split()[-1] for line in text.splitlines() if line.startswith(name + " ")))
        names = ("radixlang_num_requests_total", "radixlang_time_to_first_token_seconds_count",
                 "radixlang_inter_token_latency_seconds_count", "radixlang_e2e_request_latency_seconds_count")
        before = {n: value(n) for n in names}
        c.post("/generate", json={"text": "count me", "sampling_params": {"max_new_tokens": 3, "ignore_eos": True}})
        after = {n: value(n) for n in names}
        assert after["radixlang_num_requests_total"] == before["radixlang_num_requests_total"] + 1
        assert after["radixlang_time_to_first_token_seconds_count"] == \
            before["radixlang_time_to_first_token_seconds_count"] + 1
        assert after["radixlang_inter_token_latency_seconds_count"] == \
            before["radixlang_inter_token_latency_seconds_count"] + 2  # 3 tokens: 2 gaps
        assert after["radixlang_e2e_request_latency_seconds_count"] == \
            before["radixlang_e2e_request_latency_seconds_count"] + 1
        assert value('radixlang_time_to_first_token_seconds_bucket{le="+Inf"}') == \
            after["radixlang_time_to_first_token_seconds_count"]
        assert value("radixlang_e2e_request_latency_seconds_sum") > 0
        assert value("radixlang_kv_total_tokens") == 4096
        assert 0.0 <= value("radixlang_cache_hit_rate") <= 1.0
    assert httpx.get(server + "/metrics").status_code == 401
