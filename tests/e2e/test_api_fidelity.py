"""Native and OpenAI fields that must do what SGLang's or OpenAI's docs say: return_text_in_logprobs,
logit_bias, echo, stop_regex, logprob_start_len, chat_template_kwargs and --chat-template, streamed tools."""
from __future__ import annotations

import json
import re

import httpx
import pytest

from tests.live_server import live_server

pytestmark = pytest.mark.e2e

TEMPLATE = ("{% if shout %}LOUD LOUD LOUD {% endif %}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n"
            "{% endfor %}assistant:")


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    path = tmp_path_factory.mktemp("tpl") / "chat.jinja"
    path.write_text(TEMPLATE)
    with live_server(tiny_model_dir, chat_template=str(path), reasoning_parser="qwen3") as url:
        yield httpx.Client(base_url=url, timeout=120)


def _gen(c, **body):
    r = c.post("/generate", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def test_return_text_in_logprobs_fills_token_text(server):
    out = _gen(server, text="Hello there friend", sampling_params={"max_new_tokens": 3, "temperature": 0},
               return_logprob=True, logprob_start_len=0, top_logprobs_num=2, return_text_in_logprobs=True)
    meta = out["meta_info"]
    assert meta["input_token_logprobs"][0][0] is None
    assert "".join(e[2] for e in meta["input_token_logprobs"]) == "Hello there friend"
    assert "".join(e[2] for e in meta["output_token_logprobs"]) == out["text"]
    assert all(isinstance(e[2], str) for row in meta["output_top_logprobs"] for e in row)
    plain = _gen(server, text="Hello there friend", sampling_params={"max_new_tokens": 3, "temperature": 0},
                 return_logprob=True, logprob_start_len=0)
    assert all(e[2] is None for e in plain["meta_info"]["input_token_logprobs"])


def test_logprob_start_len_past_the_prompt_is_a_400(server):
    r = server.post("/generate", json={"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 1},
                                       "return_logprob": True, "logprob_start_len": 3})
    assert r.status_code == 400 and r.json()["error"]["param"] == "logprob_start_len"
    ok = _gen(server, input_ids=[5, 6, 7], sampling_params={"max_new_tokens": 1}, return_logprob=True,
              logprob_start_len=2)
    whole = _gen(server, input_ids=[5, 6, 7], sampling_params={"max_new_tokens": 1}, return_logprob=True,
                 logprob_start_len=0)["meta_info"]["input_token_logprobs"]
    # a start with a left context is scored (position 0 alone has no logprob)
    assert whole[0][0] is None
    assert [e[1] for e in ok["meta_info"]["input_token_logprobs"]] == [7]
    assert ok["meta_info"]["input_token_logprobs"][0][0] == pytest.approx(whole[2][0], abs=1e-4)
    r = server.post("/generate", json={"text": ["a b c d", "a"], "sampling_params": {"max_new_tokens": 1},
                                       "return_logprob": True, "logprob_start_len": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "logprob_start_len"


def test_logit_bias_native_and_openai(server):
    free = _gen(server, text="Once upon", sampling_params={"max_new_tokens": 4, "temperature": 0})
    forced = _gen(server, text="Once upon", sampling_params={"max_new_tokens": 4, "temperature": 0,
                                                             "logit_bias": {"1234": 100}})
    assert forced["output_ids"] == [1234] * 4 != free["output_ids"]
    banned = _gen(server, text="Once upon", sampling_params={"max_new_tokens": 4, "temperature": 0,
                                                             "logit_bias": {str(free["output_ids"][0]): -100}})
    assert banned["output_ids"][0] != free["output_ids"][0]
    three = _gen(server, text="Once upon", sampling_params={"max_new_tokens": 3, "temperature": 0,
                                                            "logit_bias": {"1234": 100}})["text"]
    for route, body in (("/v1/completions", {"prompt": "Once upon"}),
                        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):
        r = server.post(route, json={**body, "max_tokens": 3, "temperature": 0, "logit_bias": {"1234": 100},
                                     "logprobs": True if "chat" in route else 1})
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        text = choice["text"] if "text" in choice else choice["message"]["content"]
        assert text == three
    for bad in ({"99999999": 1}, {"12": 101}, {"x": 1}):
        r = server.post("/v1/completions", json={"prompt": "a", "max_tokens": 1, "logit_bias": bad})
        assert r.status_code == 400 and r.json()["error"]["param"] == "logit_bias", r.text


def test_echo_with_and_without_logprobs(server):
    r = server.post("/v1/completions", json={"prompt": "The sky is", "max_tokens": 3, "temperature": 0})
    plain = r.json()["choices"][0]["text"]
    r = server.post("/v1/completions", json={"prompt": "The sky is", "max_tokens": 3, "temperature": 0,
                                             "echo": True, "logprobs": 1})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["text"] == "The sky is" + plain
    lp = choice["logprobs"]
    assert "".join(lp["tokens"]) == choice["text"]
    assert lp["token_logprobs"][0] is None and all(isinstance(v, float) for v in lp["token_logprobs"][1:])
    assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:k]) for k in range(len(lp["tokens"]))]
    r = server.post("/v1/completions", json={"prompt": "The sky is", "max_tokens": 3, "temperature": 0,
                                             "echo": True, "stream": True})
    chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    assert "".join(c["choices"][0]["text"] for c in chunks) == "The sky is" + plain


def test_stop_regex_stops_and_trims(server):
    free = _gen(server, text="Count:", sampling_params={"max_new_tokens": 24, "temperature": 0})["text"]
    mid = len(free) // 2
    pattern = "(?:" + re.escape(free[mid:mid + 2]) + ")"  # a regex the greedy reply is known to match
    out = _gen(server, text="Count:", sampling_params={"max_new_tokens": 24, "temperature": 0,
                                                      "stop_regex": ["zzzq{9}", pattern]})
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": pattern}
    assert out["text"] == free[:re.search(pattern, free).start()]
    r = server.post("/generate", json={"text": "a", "sampling_params": {"stop_regex": ["(unclosed"]}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "stop_regex"


def test_chat_template_file_and_kwargs(server):
    def prompt_tokens(**extra):
        r = server.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                      "max_tokens": 1, **extra})
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens"]
    quiet, loud = prompt_tokens(), prompt_tokens(chat_template_kwargs={"shout": True})
    assert loud > quiet
    assert server.get("/get_model_info").json()["chat_template"] == TEMPLATE
    r = server.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                  "chat_template_kwargs": {"tools": []}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs"


def test_stream_with_tools_sends_text_as_it_comes(server):
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 12, "temperature": 0, "tools": [tool]}
    whole = server.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]
    r = server.post("/v1/chat/completions", json={**body, "stream": True})
    chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    pieces = [c["choices"][0]["delta"].get("content") for c in chunks]
    assert sum(1 for p in pieces if p) > 1  # not held back to the end
    assert "".join(p for p in pieces if p) == whole["content"]


def _sse_deltas(r):
    return [json.loads(line[6:])["choices"][0] for line in r.text.splitlines()
            if line.startswith("data: {") and json.loads(line[6:])["choices"]]


def test_reasoning_and_tool_call_from_a_constrained_reply_whole_and_streamed(server):
    # the regex makes the random-weight model write a qwen3 reply: reasoning, then a hermes tool call
    # (enable_thinking false: a grammar then applies from the reply's start, not after </think>)
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
    regex = (r'<think>[a-z]{3,8}</think>ok<tool_call>\{"name": "get_weather", '
             r'"arguments": \{"city": "[a-z]{2,6}"\}\}</tool_call>')
    body = {"messages": [{"role": "user", "content": "weather?"}], "max_tokens": 80, "temperature": 0,
            "tools": [tool], "regex": regex, "chat_template_kwargs": {"enable_thinking": False}}
    r = server.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    msg = choice["message"]
    assert choice["finish_reason"] == "tool_calls"
    assert re.fullmatch("[a-z]{3,8}", msg["reasoning_content"]) and msg["content"] == "ok"
    (call,) = msg["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    assert re.fullmatch("[a-z]{2,6}", json.loads(call["function"]["arguments"])["city"])
    deltas = _sse_deltas(server.post("/v1/chat/completions", json={**body, "stream": True}))
    reasoning = "".join(d["delta"].get("reasoning_content") or "" for d in deltas)
    content = "".join(d["delta"].get("content") or "" for d in deltas)
    calls = [c for d in deltas for c in d["delta"].get("tool_calls") or []]
    assert (reasoning, content) == (msg["reasoning_content"], "ok")
    assert calls[0]["function"]["name"] == "get_weather" and calls[0]["id"].startswith("call_")
    assert "".join(c["function"]["arguments"] for c in calls) == call["function"]["arguments"]
    assert deltas[-1]["finish_reason"] == "tool_calls"
    plain = server.post("/v1/chat/completions", json={**body, "separate_reasoning": False, "tools": None})
    assert plain.json()["choices"][0]["message"]["content"].startswith("<think>")


# what differs between two runs of one request by nature: wall-clock times
_PER_RUN = {"e2e_latency"}


@pytest.mark.parametrize("start", [None, -1, 0, 1, 3])
def test_engine_and_http_give_the_same_meta_info(server, tiny_engine, start):
    """One request means one thing on both transports: the same prompt ids, the same logprob positions
    (a start with a left context is scored on the Engine too), the same counts."""
    opts = {"return_logprob": True, "top_logprobs_num": 2}
    if start is not None:
        opts["logprob_start_len"] = start
    params = {"max_new_tokens": 4, "temperature": 0}
    for prompt in ({"text": "Hello there friend, how are"}, {"input_ids": [5, 6, 7, 8, 9, 10]}):
        rid = f"same-{start}-{len(prompt)}-{next(iter(prompt))}"
        assert tiny_engine.flush_cache()
        ours = tiny_engine.generate(prompt=prompt.get("text"), input_ids=prompt.get("input_ids"),
                                    sampling_params=params, rid=rid, **opts)
        assert server.post("/flush_cache").status_code == 200
        http = _gen(server, **prompt, sampling_params=params, rid=rid, **opts)
        assert ours["output_ids"] == http["output_ids"] and ours["text"] == http["text"]
        a = {k: v for k, v in ours["meta_info"].items() if k not in _PER_RUN}
        b = {k: v for k, v in http["meta_info"].items() if k not in _PER_RUN}
        assert a.keys() == b.keys()
        for key in a:
            assert _close(a[key], b[key]), (key, a[key], b[key])
        rows = a["input_token_logprobs"]
        scored_from = 1 if start in (None, -1, 0) else 0
        assert all(e[0] is not None for e in rows[scored_from:]) and (start not in (None, -1, 0) or rows[0][0] is None)


def _close(a, b) -> bool:
    """Equal, floats within 1e-5 (the two runs batch alike; the server's JSON round trip keeps floats)."""
    if isinstance(a, float) or isinstance(b, float):
        return a is not None and b is not None and abs(a - b) <= 1e-5
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_close(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_close(a[k], b[k]) for k in a)
    return a == b
