"""HTTP backends against scripted transports; Runtime's CLI and launch failure; no torch in lang."""
from __future__ import annotations

import json
import subprocess
import sys

import httpx
import pytest

import radixlang.lang as sgl
from radixlang.lang.backends.base import GenParams
from radixlang.lang.backends.runtime import Runtime, server_args_to_cli
from radixlang.lang.backends.runtime_endpoint import RuntimeEndpoint
from radixlang.lang.backends.openai import OpenAI
from test_chat_template import SMOLLM


class FakeServer:
    """SGLang's native API over characters as tokens: logprob of a char = -1 for 'b', else -3."""

    def __init__(self) -> None:
        self.requests: list[tuple[str, dict]] = []

    def _one(self, text: str, body: dict) -> dict:
        params = body.get("sampling_params") or {}
        out = "" if params.get("max_new_tokens") == 0 else " gen"
        meta = {"prompt_tokens": len(text), "completion_tokens": len(out), "cached_tokens": 0,
                "finish_reason": {"type": "length"}}
        if body.get("return_logprob"):
            start = body.get("logprob_start_len", len(text) - 1)
            meta["input_token_logprobs"] = [[None if i == start else (-1.0 if ch == "b" else -3.0), ord(ch), ch]
                                            for i, ch in enumerate(text) if i >= start]
        return {"text": out, "meta_info": meta}

    def __call__(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        body = json.loads(request.content) if request.content else {}
        self.requests.append((path, body))
        if request.headers.get("authorization") != "Bearer k":
            return httpx.Response(401, json={"error": {"message": "bad key"}})
        if path == "/get_model_info":
            return httpx.Response(200, json={"model_path": "/m/smollm", "chat_template": SMOLLM})
        if path == "/get_server_info":
            return httpx.Response(200, json={"version": "x"})
        if path == "/flush_cache":
            return httpx.Response(200, json={"success": True})
        if path == "/generate":
            if "input_ids" in body:
                texts = ["".join(chr(t) for t in ids) for ids in body["input_ids"]]
            else:
                texts = body["text"]
            if (body.get("sampling_params") or {}).get("temperature") == 9:
                return httpx.Response(400, json={"error": {"message": "temperature too hot"}})
            if body.get("stream"):
                chunks = [{"text": " g", "meta_info": {"finish_reason": None}},
                          {"text": " gen", "meta_info": {"finish_reason": {"type": "length"}}}]
                sse = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
                return httpx.Response(200, text=sse, headers={"content-type": "text/event-stream"})
            if isinstance(texts, list):
                return httpx.Response(200, json=[self._one(t, body) for t in texts])
            return httpx.Response(200, json=self._one(texts, body))
        return httpx.Response(404)


@pytest.fixture
def endpoint():
    server = FakeServer()
    return RuntimeEndpoint("http://fake", api_key="k", transport=httpx.MockTransport(server)), server


def test_endpoint_generate_and_payload(endpoint):
    ep, server = endpoint
    text, meta = ep.generate("Hi", GenParams({"max_new_tokens": 3}, return_logprob=True, logprob_start_len=0))
    assert text == " gen" and meta["prompt_tokens"] == 2
    path, body = server.requests[-1]
    assert path == "/generate" and body["text"] == "Hi" and body["sampling_params"] == {"max_new_tokens": 3}
    assert body["return_logprob"] is True and body["logprob_start_len"] == 0
    with pytest.raises(ValueError, match="temperature too hot"):
        ep.generate("Hi", GenParams({"temperature": 9}))


def test_endpoint_stream_deltas(endpoint):
    ep, _ = endpoint
    deltas = [d for d, _ in ep.generate_stream("Hi", GenParams({}))]
    assert deltas == [" g", "en"]


def test_endpoint_select_prefills_prefix_then_scores_choice_tokens(endpoint):
    ep, server = endpoint
    d = ep.select("Pick:", ["aa", "bb", "ab"], 0.0, sgl.token_length_normalized)
    assert d.decision == "bb"
    assert d.meta_info["normalized_prompt_logprobs"] == [-3.0, -1.0, -2.0]
    (p1, prefill), (p2, scoring) = server.requests[-2:]
    assert prefill["sampling_params"] == {"max_new_tokens": 0}
    assert scoring["text"] == ["Pick:aa", "Pick:bb", "Pick:ab"] and scoring["logprob_start_len"] == 4
    # the unconditional method sends the choice tokens alone
    d = ep.select("Pick:", ["aa", "bb"], 0.0, sgl.unconditional_likelihood_normalized)
    assert server.requests[-1][1]["input_ids"] == [[97, 97], [98, 98]]


def test_endpoint_chat_template_and_info(endpoint):
    ep, _ = endpoint
    assert ep.chat_template.role_prefix_and_suffix["user"][0] == "<|im_start|>user\n"
    assert ep.get_server_info() == {"version": "x"} and ep.flush_cache() is True


def test_program_on_endpoint(endpoint):
    ep, _ = endpoint

    @sgl.function
    def prog(s):
        s += sgl.user("q") + sgl.assistant(sgl.gen("a") + sgl.select("c", ["a", "b"]))

    state = prog.run(backend=ep)
    assert state["a"] == " gen" and state["c"] == "b"


def test_openai_chat_completions_and_select():
    seen = []

    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        seen.append((request.url.path, body))
        content = "blue" if "regex" in body else "Hello!"
        return httpx.Response(200, json={"id": "1", "choices": [{"message": {"content": content},
                                                                 "finish_reason": "stop"}],
                                         "usage": {"prompt_tokens": 3, "completion_tokens": 1}})

    be = OpenAI("m", base_url="http://oai/v1", api_key="sk", transport=httpx.MockTransport(handler))

    @sgl.function
    def prog(s):
        s += sgl.system("S") + sgl.user("Hi")
        s += sgl.assistant(sgl.gen("a", max_tokens=5))
        s += sgl.user("color?") + sgl.assistant(sgl.select("c", ["red", "blue"]))

    state = prog.run(backend=be, temperature=0)
    assert state["a"] == "Hello!" and state["c"] == "blue"
    path, body = seen[0]
    assert path == "/v1/chat/completions" and body["max_tokens"] == 5
    assert body["messages"] == [{"role": "system", "content": "S"}, {"role": "user", "content": "Hi"}]
    assert seen[1][1]["regex"] == "(red|blue)"

    @sgl.function
    def midturn(s):
        s += sgl.assistant("partial" + sgl.gen("x"))

    assert "start of an assistant turn" in str(midturn.run(backend=be).error())


def test_openai_select_without_regex_support_is_clear():
    def handler(request):
        return httpx.Response(200, json={"choices": [{"text": "purple", "finish_reason": "stop"}]})

    be = OpenAI("m", base_url="http://oai/v1", is_chat_model=False, transport=httpx.MockTransport(handler))
    with pytest.raises(ValueError, match="honours the 'regex'"):
        be.select("x", ["red", "blue"], 0.0, sgl.token_length_normalized)


def test_server_args_to_cli():
    argv = server_args_to_cli({"model_path": "/m", "disable_radix_cache": True, "enable_metrics": False,
                               "max_total_tokens": 64, "api_key": None})
    assert argv == ["--model-path", "/m", "--disable-radix-cache", "--no-enable-metrics",
                    "--max-total-tokens", "64"]


def test_runtime_launch_failure_reports_stderr():
    with pytest.raises(RuntimeError, match="no-such-option"):
        Runtime(no_such_option=1, launch_timeout=60)


def test_lang_imports_no_torch():
    code = ("import sys, radixlang.lang, radixlang.lang.backends.engine, radixlang.lang.backends.runtime; "
            "assert 'torch' not in sys.modules and 'radixlang.runtime' not in sys.modules, 'loaded'")
    subprocess.run([sys.executable, "-c", code], check=True)
