"""/tokenize, /detokenize, /tokenizer_info (issue #41 item 4): vLLM's shapes, what lm-eval's remote tokenizer
reads, and ids equal to the ones generation runs on (a text prompt, a chat)."""
from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from radixlang.runtime.entrypoints.engine_front import EngineFront
from radixlang.runtime.entrypoints.http_server import create_app

pytestmark = pytest.mark.e2e

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]


@pytest.fixture(scope="module")
def client(tiny_engine):
    with TestClient(create_app(EngineFront(tiny_engine))) as c:
        yield c


def _ok(r) -> dict:
    assert r.status_code == 200, r.text
    return r.json()


def _prompt_ids(client, **body) -> list[int]:
    """The ids /generate ran on: its scored prompt tokens."""
    out = _ok(client.post("/generate", json={**body, "sampling_params": {"max_new_tokens": 1},
                                             "return_logprob": True, "logprob_start_len": 0}))
    return [tid for _, tid, _ in out["meta_info"]["input_token_logprobs"]]


@pytest.mark.parametrize("text", ["Hello world", "<|im_start|>user\nHi<|im_end|>", "  spaced\n\ttext "])
def test_tokenize_a_prompt_as_generation_does(client, text):
    got = _ok(client.post("/tokenize", json={"prompt": text}))
    assert got["tokens"] == _prompt_ids(client, text=text)
    assert got["count"] == len(got["tokens"]) and got["token_strs"] is None
    info = _ok(client.get("/get_server_info"))
    assert got["max_model_len"] == info["context_length"] > 0


def test_tokenize_without_special_tokens_and_token_strs(client, tiny_model_dir):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    got = _ok(client.post("/tokenize", json={"prompt": "<|im_end|> ok", "add_special_tokens": False,
                                             "return_token_strs": True}))
    assert got["tokens"][0] == 2  # the special token's text is the special token (lm-eval finds EOS this way)
    assert got["token_strs"][0] == "<|im_end|>" and len(got["token_strs"]) == got["count"]
    assert got["tokens"] == tok.encode("<|im_end|> ok", add_special_tokens=False)


def test_tokenize_messages_as_the_chat_route_does(client):
    got = _ok(client.post("/tokenize", json={"messages": MESSAGES}))
    chat = _ok(client.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 1}))
    assert got["count"] == chat["usage"]["prompt_tokens"]
    text = _ok(client.post("/detokenize", json={"tokens": got["tokens"]}))["prompt"]
    assert got["tokens"] == _prompt_ids(client, input_ids=got["tokens"])
    assert text.endswith("<|im_start|>assistant\n") and "Hello there" in text
    bare = _ok(client.post("/tokenize", json={"messages": MESSAGES, "add_generation_prompt": False}))
    assert got["tokens"][:bare["count"]] == bare["tokens"] and bare["count"] < got["count"]
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    with_tools = _ok(client.post("/tokenize", json={"messages": MESSAGES, "tools": tools}))
    assert with_tools["count"] > got["count"]  # the template cannot render tools: a system note describes them


def test_detokenize_round_trip(client):
    ids = _ok(client.post("/tokenize", json={"prompt": "round trip, ok?", "add_special_tokens": False}))["tokens"]
    assert _ok(client.post("/detokenize", json={"tokens": ids})) == {"prompt": "round trip, ok?"}


def test_tokenizer_info_has_what_lm_eval_reads(client):
    info = _ok(client.get("/tokenizer_info"))
    assert info["eos_token"] == "<|im_end|>" and info["bos_token"] == "<|im_start|>"
    assert "pad_token" in info and info["chat_template"].startswith("{% for message in messages %}")
    assert info["tokenizer_class"] and info["vocab_size"] == 49152
    assert "name_or_path" not in info and "added_tokens_decoder" not in info  # no paths of the server's disk
    # lm-eval's RemoteTokenizer: eos_token_id = encode(eos_token)[0]
    eos = _ok(client.post("/tokenize", json={"prompt": info["eos_token"], "add_special_tokens": False}))
    assert eos["tokens"] == [2]


@pytest.mark.parametrize(("route", "body", "param"), [
    ("/tokenize", {"prompt": 3}, "prompt"),
    ("/tokenize", {"prompt": "x", "add_special_tokens": "yes"}, "add_special_tokens"),
    ("/tokenize", {"prompt": "x", "bogus": 1}, "bogus"),
    ("/tokenize", {}, "prompt"),
    ("/tokenize", {"messages": []}, "messages"),
    ("/tokenize", {"messages": [{"role": "wizard", "content": "x"}]}, "messages"),
    ("/detokenize", {"tokens": [1, 10 ** 9]}, "tokens"),
    ("/detokenize", {"tokens": [-1]}, "tokens"),
    ("/detokenize", {"tokens": "abc"}, "tokens"),
    ("/detokenize", {}, "tokens"),
])
def test_bad_input_is_a_400_naming_the_field(client, route, body, param):
    r = client.post(route, json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error", err


def test_a_body_that_is_no_json_object_is_a_400(client):
    r = client.post("/tokenize", content=b"[1, 2]", headers={"content-type": "application/json"})
    assert r.status_code == 400 and "JSON object" in r.json()["error"]["message"]
