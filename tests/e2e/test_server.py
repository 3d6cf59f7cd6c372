"""The HTTP server as a subprocess on 127.0.0.1, stopped by PID."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

pytestmark = pytest.mark.e2e
KEY = "test-key"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "radixlang.launch_server", "--model-path", tiny_model_dir,
                             "--load-format", "dummy", "--port", str(port), "--api-key", KEY,
                             "--max-total-tokens", "4096", "--log-level", "warning"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 120
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(proc.stderr.read().decode()[-2000:])
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(0.5)
    else:
        proc.kill()
        raise RuntimeError("server did not become healthy")
    yield url
    os.kill(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        os.kill(proc.pid, signal.SIGKILL)


def _client(url: str) -> httpx.Client:
    return httpx.Client(base_url=url, headers={"Authorization": f"Bearer {KEY}"}, timeout=60)


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
