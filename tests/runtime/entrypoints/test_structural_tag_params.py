"""structural_tag as a sampling param and as an OpenAI response_format; --grammar-backend choices."""

from __future__ import annotations

import json

import pytest

from radixlang.runtime.entrypoints.openai.protocol import ChatRequest, to_sampling
from radixlang.runtime.errors import RequestError
from radixlang.runtime.sampling.sampling_params import SamplingParams
from radixlang.runtime.server_args import ServerArgs

TAG = {"type": "structural_tag", "triggers": ["<f="],
       "structures": [{"begin": "<f=a>", "schema": {"type": "object"}, "end": "</f>"}]}


def test_sampling_params_carry_a_structural_tag():
    p = SamplingParams.from_dict({"structural_tag": TAG})
    assert p.grammar_key == ("structural_tag", json.dumps(TAG))
    with pytest.raises(RequestError) as e:
        SamplingParams.from_dict({"structural_tag": json.dumps(TAG), "regex": "a"})
    assert e.value.param == "regex" and "structural_tag" in str(e.value)


def test_chat_response_format_structural_tag_becomes_the_param():
    req = ChatRequest(messages=[{"role": "user", "content": "hi"}],
                      response_format={"type": "structural_tag", "structures": TAG["structures"],
                                       "triggers": TAG["triggers"]})
    params = to_sampling(req, None)
    assert json.loads(params["structural_tag"]) == TAG and "json_schema" not in params
    with pytest.raises(RequestError) as e:
        to_sampling(ChatRequest(messages=[{"role": "user", "content": "hi"}],
                                response_format={"type": "structural_tag"}), None)
    assert e.value.param == "response_format"


def test_grammar_backend_choices_are_real():
    for name in ("outlines", "xgrammar", "llguidance"):
        assert ServerArgs(grammar_backend=name).grammar_backend == name
    with pytest.raises(ValueError):
        ServerArgs(grammar_backend="no-such-backend")
