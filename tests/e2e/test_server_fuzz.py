"""Hypothesis-made request bodies against a live server: never a 5xx, and it keeps serving."""
from __future__ import annotations

import httpx
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st


pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def server(tiny_server):
    return tiny_server

# small numbers only, so a valid body never asks for a long generation
_scalar = st.one_of(st.none(), st.booleans(), st.integers(-3, 8), st.floats(-3, 3),
                    st.text(max_size=6))
_value = st.recursive(_scalar, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner,
                                                                                           max_size=3), max_leaves=6)
_sampling = st.dictionaries(st.sampled_from(["max_new_tokens", "temperature", "top_p", "top_k", "stop", "n",
                                             "regex", "json_schema", "min_new_tokens", "bogus"]), _value, max_size=4)
_generate = st.fixed_dictionaries({}, optional={
    "text": st.one_of(st.text(max_size=20), _value), "input_ids": st.lists(st.integers(-2, 60000), max_size=5),
    "sampling_params": st.one_of(_sampling, _value), "return_logprob": _value, "logprob_start_len": _value,
    "top_logprobs_num": _value, "stream": st.just(False), "junk": _value})
_message = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "x"]),
                                  "content": st.one_of(st.text(max_size=12), _value)})
_chat = st.fixed_dictionaries({"messages": st.one_of(st.lists(_message, max_size=2), _value)}, optional={
    "max_tokens": st.integers(-1, 6) | _value, "temperature": _value, "top_p": _value, "n": st.integers(-1, 3),
    "stop": _value, "seed": _value, "logprobs": _value, "top_logprobs": _value, "response_format": _value,
    "tools": _value, "tool_choice": _value, "stream": st.booleans(), "unknown": _value})

_SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))


@_SETTINGS
@given(body=_generate)
def test_fuzz_generate(server, body):  # noqa: F811
    r = httpx.post(server + "/generate", json=body, timeout=60)
    assert r.status_code < 500, r.text
    if r.status_code >= 400:
        assert r.json()["error"]["message"]


@_SETTINGS
@given(body=_chat)
def test_fuzz_chat(server, body):  # noqa: F811
    r = httpx.post(server + "/v1/chat/completions", json={"model": "tiny", **body}, timeout=60)
    assert r.status_code < 500, r.text
    ok = httpx.post(server + "/v1/chat/completions", timeout=60,
                    json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1})
    assert ok.status_code == 200
