"""bench/llama_server.py's driver against a fake llama-server: the requests it sends and what it counts.

The real server is never built or started here (that is a benchmark's job, not the suite's)."""
from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from bench.llama_server import LlamaServerBackend, command, completion_body
from radixlang.lang.backends.base import GenParams


class _Fake(BaseHTTPRequestHandler):
    bodies: list = []

    def do_POST(self):  # noqa: N802 (http.server's name)
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).bodies.append((self.path, body))
        # llama-server's /completion reply: 40 prompt tokens, 30 of them from the slot's cache
        out = {"content": " Paris.", "tokens_evaluated": 40, "tokens_predicted": 3, "stop_type": "word",
               "timings": {"prompt_n": 10, "predicted_n": 3}}
        data = json.dumps(out).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@pytest.fixture
def fake_server():
    _Fake.bodies = []
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Fake)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


def test_generate_sends_a_greedy_cached_completion_and_counts_the_cache(fake_server, smollm_path):
    backend = LlamaServerBackend(fake_server, smollm_path)
    params = GenParams(sampling_params={"max_new_tokens": 12, "temperature": 0, "stop": "\n"})
    text, meta = backend.generate("Q: capital of France?\nA:", params)
    assert text == " Paris."
    assert meta == {"prompt_tokens": 40, "completion_tokens": 3, "cached_tokens": 30,
                    "finish_reason": {"type": "stop"}}
    path, body = _Fake.bodies[-1]
    assert path == "/completion"
    assert body["prompt"] == "Q: capital of France?\nA:" and body["n_predict"] == 12
    assert body["cache_prompt"] is True and body["temperature"] == 0 and body["top_k"] == 1
    assert body["stop"] == ["\n"] and body["stream"] is False
    c = backend.counters()
    assert (c.prompt_tokens, c.cached_tokens, c.completion_tokens) == (40, 30, 3)


def test_request_shapes_and_refusals():
    body = completion_body("x", {"max_new_tokens": 5, "temperature": 0, "ignore_eos": True,
                                 "json_schema": '{"type": "object"}'})
    assert body["ignore_eos"] is True and body["json_schema"] == {"type": "object"}
    with pytest.raises(ValueError, match="regex"):
        completion_body("x", {"temperature": 0, "regex": "a+"})
    with pytest.raises(ValueError, match="greedy"):
        completion_body("x", {"temperature": 0.7})
    argv = command("/bin/llama-server", "m.gguf", port=8090, parallel=32, threads=2, ctx_per_slot=1024)
    assert argv[argv.index("--parallel") + 1] == "32" and argv[argv.index("--ctx-size") + 1] == str(32 * 1024)
    assert argv[argv.index("--threads") + 1] == argv[argv.index("--threads-batch") + 1] == "2"


class _FakeStream(BaseHTTPRequestHandler):
    bodies: list = []

    def do_POST(self):  # noqa: N802 (http.server's name)
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).bodies.append(body)
        # llama-server's streamed /completion: a chunk per token, then a final one with the timings
        chunks = [{"content": "a", "tokens": [7], "stop": False, "tokens_predicted": i + 1}
                  for i in range(body["n_predict"])]
        chunks.append({"content": "", "tokens": [], "stop": True, "tokens_predicted": body["n_predict"],
                       "timings": {"cache_n": 6, "prompt_n": 4, "predicted_n": body["n_predict"]}})
        data = b"".join(b"data: " + json.dumps(c).encode() + b"\n\n" for c in chunks)
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


def test_serving_bench_streams_from_llama_server():
    import asyncio

    from bench.serving import run_load, send_one_llama_server
    from bench.serving_data import BenchRequest

    _FakeStream.bodies = []
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _FakeStream)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        reqs = [BenchRequest(input_ids=list(range(10)), output_len=5), BenchRequest(input_ids=[1, 2], output_len=3)]
        url = f"http://127.0.0.1:{httpd.server_address[1]}"
        results, _ = asyncio.run(run_load(url, reqs, request_rate=float("inf"), max_concurrency=None,
                                          time_limit_s=30, sender=send_one_llama_server))
    finally:
        httpd.shutdown()
        httpd.server_close()
    assert [r["ok"] for r in results] == [True, True], results
    assert [r["output_len"] for r in results] == [5, 3] and [r["cached_tokens"] for r in results] == [6, 6]
    assert all(r["ttft"] is not None and len(r["itl"]) == r["output_len"] - 1 for r in results)
    body = _FakeStream.bodies[0]
    assert body["stream"] is True and body["ignore_eos"] is True and body["cache_prompt"] is True
    assert body["temperature"] == 0.0 and body["prompt"] in (list(range(10)), [1, 2])
