"""Constrained decoding through the scheduler: every sampled output matches its regex / validates.

A random-weight model at temperature 1.0 goes wherever the mask allows, so
these exercise the masks, the grammar transitions and termination in a real
batch, including batches mixing constrained, free and invalid requests.
"""
from __future__ import annotations

import json
import re

import jsonschema
import pytest

from radixlang.constrained import Grammar
from tests.constrained.test_random_walk import REGEXES, SCHEMAS

pytestmark = pytest.mark.e2e
SEEDS = (1, 2)


def _gen(engine, prompts, params):
    outs = engine.generate(prompts, params)
    return outs if isinstance(outs, list) else [outs]


def test_regex_outputs_fully_match(tiny_engine):
    params = [{"regex": p, "temperature": 1.0, "sampling_seed": s, "max_new_tokens": 256}
              for p in REGEXES for s in SEEDS]
    outs = _gen(tiny_engine, ["The answer:"] * len(params), params)
    stopped = 0
    for p, out in zip(params, outs):
        if out["meta_info"]["finish_reason"]["type"] == "stop":
            stopped += 1
            assert re.fullmatch(p["regex"], out["text"], re.ASCII), (p["regex"], out["text"])
        else:  # an unbounded pattern can run to max_new_tokens: what it wrote is still a live prefix
            assert out["meta_info"]["finish_reason"]["type"] == "length"
            compiled = tiny_engine.scheduler.grammar_compiler.compile("regex", p["regex"])
            assert Grammar(compiled).accept_text(out["text"]), (p["regex"], out["text"])
    assert stopped >= len(params) - 6  # only the few unbounded patterns may run long
    tiny_engine.check_memory_leak()


def test_json_schema_outputs_validate(tiny_engine):
    names = sorted(SCHEMAS)
    params = [{"json_schema": json.dumps(SCHEMAS[n]), "temperature": 1.0, "sampling_seed": s,
               "max_new_tokens": 384} for n in names for s in SEEDS]
    outs = _gen(tiny_engine, ["Give JSON:"] * len(params), params)
    for p, out in zip(params, outs):
        schema = json.loads(p["json_schema"])
        assert out["meta_info"]["finish_reason"]["type"] == "stop", (schema, out)
        jsonschema.validate(json.loads(out["text"]), schema)
    tiny_engine.check_memory_leak()


def test_any_json_object(tiny_engine):
    outs = _gen(tiny_engine, ["{"] * 2, [{"json_schema": "$$ANY$$", "temperature": 1.0, "sampling_seed": s,
                                          "max_new_tokens": 384} for s in SEEDS])
    for out in outs:
        if out["meta_info"]["finish_reason"]["type"] == "stop":
            assert isinstance(json.loads(out["text"]), dict)


def test_mixed_batch_free_constrained_and_invalid(tiny_engine):
    free = {"temperature": 0, "max_new_tokens": 8}
    alone = _gen(tiny_engine, ["hello world"], [free])[0]
    params = [free, {"regex": r"(yes|no)", "temperature": 1.0, "sampling_seed": 3},
              {"regex": "(unclosed", "max_new_tokens": 4}, {"json_schema": '{"type": "no-such-type"}'},
              {"regex": r"\d{4}", "temperature": 0}]
    outs = _gen(tiny_engine, ["hello world"] * len(params), params)
    assert outs[0]["text"] == alone["text"]  # a constrained neighbour changes nothing for a free request
    assert outs[1]["text"] in ("yes", "no")
    assert outs[2]["meta_info"]["finish_reason"]["type"] == "abort"
    assert "regex" in outs[2]["meta_info"]["finish_reason"]["message"]
    assert outs[3]["meta_info"]["finish_reason"]["type"] == "abort"
    assert "json" in outs[3]["meta_info"]["finish_reason"]["message"]
    assert re.fullmatch(r"\d{4}", outs[4]["text"])
    tiny_engine.check_memory_leak()


def test_malformed_schema_is_a_value_error(tiny_engine):
    with pytest.raises(ValueError, match="json_schema is not valid JSON"):
        tiny_engine.generate("x", {"json_schema": "{not json"})


def test_same_seed_same_constrained_sample_in_any_batch(tiny_engine):
    p = {"regex": r"[a-z]{3,8}", "temperature": 1.0, "sampling_seed": 11}
    alone = _gen(tiny_engine, ["x"], [p])[0]["text"]
    batched = _gen(tiny_engine, ["x", "y", "x"], [p, {"max_new_tokens": 5}, p])
    assert batched[0]["text"] == alone == batched[2]["text"]


def test_ebnf_is_refused_clearly(tiny_engine):
    out = _gen(tiny_engine, ["x"], [{"ebnf": 'root ::= "a"'}])[0]
    assert out["meta_info"]["finish_reason"]["type"] == "abort"
    assert "ebnf" in out["meta_info"]["finish_reason"]["message"]
