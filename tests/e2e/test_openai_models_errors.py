"""Model ids and error details on the OpenAI routes (issue #42 items 5 and 7): the model is served as its
own name, never a path; another model name gets OpenAI's 404; a grammar's error names the field it came
from and says what is wrong; routing errors come in the API's error shape."""
from __future__ import annotations

import json
import os

import pytest
from fastapi.testclient import TestClient

from radixlang.runtime.entrypoints.engine_front import EngineFront
from radixlang.runtime.entrypoints.http_server import create_app
from radixlang.runtime.server_args import ServerArgs, _own_model_name

pytestmark = pytest.mark.e2e

MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def client(tiny_engine):
    with TestClient(create_app(EngineFront(tiny_engine))) as c:
        yield c


def _served(client) -> str:
    r = client.get("/v1/models")
    assert r.status_code == 200
    (entry,) = r.json()["data"]
    return entry["id"]


def test_models_lists_the_models_own_name(client, tiny_model_dir):
    served = _served(client)
    assert served == os.path.basename(tiny_model_dir.rstrip("/")) and os.sep not in served


@pytest.mark.parametrize("route,body", [("/v1/chat/completions", {"messages": MESSAGES}),
                                        ("/v1/completions", {"prompt": "hi"})], ids=["chat", "completions"])
def test_the_served_id_and_default_are_accepted_and_others_are_not_found(client, route, body):
    served = _served(client)
    for model in (served, "default", None):
        sent = {**body, "max_tokens": 2} if model is None else {**body, "max_tokens": 2, "model": model}
        r = client.post(route, json=sent)
        assert r.status_code == 200, (model, r.text)
        assert r.json()["model"] == served  # the id served, whatever alias was sent
    r = client.post(route, json={**body, "max_tokens": 2, "model": "gpt-4o"})
    assert r.status_code == 404
    error = r.json()["error"]
    assert {k: error[k] for k in ("type", "param", "code")} == {
        "type": "invalid_request_error", "param": "model", "code": "model_not_found"}
    assert "gpt-4o" in error["message"] and served in error["message"]


def test_own_model_name_is_never_a_path(tmp_path):
    folder = tmp_path / "My-Model-7B"
    folder.mkdir()
    gguf = tmp_path / "tiny.Q4_K_M.gguf"
    gguf.write_bytes(b"")
    assert _own_model_name(str(folder)) == "My-Model-7B"
    assert _own_model_name(str(folder) + "/") == "My-Model-7B"
    assert _own_model_name(str(gguf)) == "tiny.Q4_K_M"
    assert _own_model_name("HuggingFaceTB/SmolLM2-135M-Instruct") == "HuggingFaceTB/SmolLM2-135M-Instruct"
    embedded = _own_model_name(None)
    assert os.sep not in embedded and not embedded.endswith(".gguf")
    assert ServerArgs(model_path=str(folder), served_model_name="mine", device="cpu").resolve().served_model_name \
        == "mine"


BAD_SCHEMA = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}}
BAD_PATTERN = {"type": "json_schema", "json_schema": {"name": "x", "schema": {
    "type": "object", "properties": {"a": {"type": "string", "pattern": "(("}}}}}
BAD_TOOL = [{"type": "function", "function": {"name": "f", "parameters": {"type": "objectx"}}}]


@pytest.mark.parametrize("body,param", [
    ({"response_format": BAD_SCHEMA}, "response_format"),
    ({"response_format": BAD_PATTERN}, "response_format"),
    ({"tools": BAD_TOOL, "tool_choice": "required"}, "tools"),
    ({"regex": "(ab"}, "regex"),
], ids=["schema", "schema-pattern", "forced-tool", "regex"])
def test_a_refused_grammar_names_the_field_it_came_from(client, body, param):
    r = client.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 2, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    r = client.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 2, "stream": True, **body})
    events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    errors = [e["error"] for e in events if "error" in e]  # streamed: the refusal is an error event
    assert errors and errors[0]["param"] == param, events


@pytest.mark.parametrize("regex,cause", [("(ab", "unclosed group"), ("a{3,1}", "the start must be <= the end")])
def test_a_bad_regex_says_what_is_wrong(client, regex, cause):
    for route, body in (("/v1/completions", {"prompt": "x"}), ("/v1/chat/completions", {"messages": MESSAGES})):
        r = client.post(route, json={**body, "max_tokens": 2, "regex": regex})
        assert r.status_code == 400 and r.json()["error"]["param"] == "regex"
        assert cause in r.json()["error"]["message"], r.text  # not cut off at "regex parse error:"


def test_routing_errors_come_in_the_api_error_shape(client):
    r = client.get("/v1/chat/completions")
    assert r.status_code == 405 and "POST" in r.headers["allow"]
    assert r.json()["error"]["code"] == 405 and "GET" in r.json()["error"]["message"]
    assert r.json()["error"]["type"] == "invalid_request_error"
    r = client.post("/v1/no-such-route", json={})
    assert r.status_code == 404 and r.json()["error"]["code"] == 404 and "/v1/no-such-route" in r.json()["error"][
        "message"]
