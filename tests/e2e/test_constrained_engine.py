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

from tests.constrained.schema_corpus import OPENAI_STYLE
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
            assert compiled.new_grammar().accept_text(out["text"]), (p["regex"], out["text"])
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


@pytest.fixture(scope="module", params=["outlines", "xgrammar", "llguidance"])
def backend_engine(request, tiny_model_dir):
    from radixlang import Engine
    engine = Engine(model_path=tiny_model_dir, load_format="dummy", max_total_tokens=8192,
                    grammar_backend=request.param)
    yield request.param, engine
    engine.shutdown()


GBNF = 'root ::= "id=" [1-9] [0-9]? ("," [1-9] [0-9]?){0,3}'
TAG = {"type": "structural_tag", "triggers": ["<f="],
       "structures": [{"begin": "<f=w>", "schema": OPENAI_STYLE["issue_id_bounds"], "end": "</f>"}]}


def test_every_backend_enforces_what_it_accepts(backend_engine):
    backend, engine = backend_engine
    schemas = [OPENAI_STYLE["issue_id_bounds"], SCHEMAS["array_bounds"], SCHEMAS["ref_defs"], SCHEMAS["enum"]]
    params = [{"json_schema": json.dumps(sc), "temperature": 1.0, "sampling_seed": s, "max_new_tokens": 384}
              for sc in schemas for s in SEEDS]
    params += [{"ebnf": GBNF, "temperature": 1.0, "sampling_seed": s, "max_new_tokens": 64} for s in SEEDS]
    params += [{"structural_tag": json.dumps(TAG), "temperature": 1.0, "sampling_seed": 1, "max_new_tokens": 32}]
    params += [{"json_schema": json.dumps(OPENAI_STYLE["tags_unique"]), "max_new_tokens": 8}]
    outs = _gen(engine, ["Give JSON:"] * len(params), params)
    for p, out in zip(params[:len(schemas) * len(SEEDS)], outs):
        assert out["meta_info"]["finish_reason"]["type"] == "stop", (backend, out)
        jsonschema.validate(json.loads(out["text"]), json.loads(p["json_schema"]))
    grammar_outs = outs[len(schemas) * len(SEEDS):-1]
    refused = outs[-1]["meta_info"]["finish_reason"]
    assert refused["type"] == "abort" and "uniqueItems" in refused["message"] and backend in refused["message"]
    if backend == "outlines":  # regex and json only: ebnf and structural tags are refused, naming both
        for out in grammar_outs:
            reason = out["meta_info"]["finish_reason"]
            assert reason["type"] == "abort" and "not supported by the outlines" in reason["message"], reason
        return
    for out in grammar_outs[:-1]:
        if out["meta_info"]["finish_reason"]["type"] == "stop":
            assert re.fullmatch(r"id=[1-9][0-9]?(,[1-9][0-9]?){0,3}", out["text"]), out["text"]
    tag_out = grammar_outs[-1]  # free text from a random model: whatever it wrote is a live prefix
    compiled = engine.scheduler.grammar_compiler.compile("structural_tag", json.dumps(TAG))
    assert compiled.new_grammar().accept_text(tag_out["text"]), tag_out["text"]
    engine.check_memory_leak()


def test_structural_tag_body_is_constrained_after_the_trigger(tiny_engine):
    # the prompt cannot force a random model to write the trigger; the grammar state can be checked by
    # handing it text: after "<f=w>" only a valid body and "</f>" are accepted
    compiled = tiny_engine.scheduler.grammar_compiler.compile("structural_tag", json.dumps(TAG))
    g = compiled.new_grammar()
    assert g.accept_text("free text <f=w>")
    assert not g.copy().accept_text('{"id": 10121}')
    assert g.accept_text('{"id": 9999}</f> more free text')


LONG_KEYS = {"type": "object", "properties": {
    "customer_full_legal_name": {"type": "string", "maxLength": 10},
    "primary_shipping_address_line": {"type": "string", "maxLength": 10},
    "account_creation_year": {"type": "integer", "minimum": 1900, "maximum": 2100},
    "is_premium_subscription_active": {"type": "boolean"}},
    "required": ["customer_full_legal_name", "primary_shipping_address_line", "account_creation_year",
                 "is_premium_subscription_active"]}


@pytest.fixture(scope="module")
def no_jump_engine(tiny_model_dir):
    from radixlang import Engine
    engine = Engine(model_path=tiny_model_dir, load_format="dummy", max_total_tokens=8192, disable_jump_forward=True)
    yield engine
    engine.shutdown()


def _steps(engine, prompts, params):
    before = engine.get_server_info()["forward_steps"]
    outs = _gen(engine, prompts, params)
    return outs, engine.get_server_info()["forward_steps"] - before


def test_jump_forward_cuts_steps_and_stays_valid(tiny_engine, no_jump_engine):
    params = [{"json_schema": json.dumps(LONG_KEYS), "temperature": 1.0, "sampling_seed": s, "max_new_tokens": 256}
              for s in (1, 2, 3)]
    results = {}
    for name, engine in (("on", tiny_engine), ("off", no_jump_engine)):
        outs, steps = _steps(engine, ["Give JSON:"] * 3, params)
        for out in outs:
            assert out["meta_info"]["finish_reason"]["type"] == "stop", out
            jsonschema.validate(json.loads(out["text"]), LONG_KEYS)
        results[name] = (outs, steps)
        engine.check_memory_leak()
    (on, steps_on), (off, steps_off) = results["on"], results["off"]
    assert all(o["meta_info"].get("jump_forward_tokens", 0) > 0 for o in on)
    assert all("jump_forward_tokens" not in o["meta_info"] for o in off)
    # the ~110 characters of keys and punctuation are forced: most tokens come without a step
    assert steps_on * 2 <= steps_off, (steps_on, steps_off)
    # a lone request: every step but the first (prefill) samples one token; jumped ones are extra
    (out,), steps = _steps(tiny_engine, ["Give JSON:"], params[:1])
    jumped = out["meta_info"]["jump_forward_tokens"]
    assert steps <= out["meta_info"]["completion_tokens"] - jumped + 1


def test_jump_forward_respects_max_new_tokens(tiny_engine):
    schema = json.dumps(LONG_KEYS)
    for n in (1, 3, 7):
        out = _gen(tiny_engine, ["Give JSON:"], [{"json_schema": schema, "max_new_tokens": n, "temperature": 0}])[0]
        assert out["meta_info"]["finish_reason"] == {"type": "length", "length": n}
        assert out["meta_info"]["completion_tokens"] == n
        compiled = tiny_engine.scheduler.grammar_compiler.compile("json", schema)
        assert compiled.new_grammar().accept_text(out["text"]), out["text"]


def test_jump_forward_streams_the_same_text(tiny_engine):
    p = {"json_schema": json.dumps(LONG_KEYS), "temperature": 1.0, "sampling_seed": 5, "max_new_tokens": 256}
    whole = _gen(tiny_engine, ["Give JSON:"], [p])[0]
    chunks = list(tiny_engine.generate("Give JSON:", p, stream=True))  # each chunk: the output so far
    assert len(chunks) > 3 and chunks[-1]["text"] == whole["text"]
    assert chunks[-1]["output_ids"] == whole["output_ids"]
    for a, b in zip(chunks, chunks[1:]):  # a re-tokenized token is never one that was already sent
        assert b["output_ids"][:len(a["output_ids"])] == a["output_ids"]
        assert b["text"].startswith(a["text"])
    assert whole["meta_info"]["jump_forward_tokens"] > 0


def test_logprob_requests_jump_forward_too(tiny_engine):
    p = {"json_schema": json.dumps(LONG_KEYS), "temperature": 1.0, "sampling_seed": 5, "max_new_tokens": 256}
    out = tiny_engine.generate("Give JSON:", p, return_logprob=True)
    plain = tiny_engine.generate("Give JSON:", p)
    meta = out["meta_info"]
    assert out["output_ids"] == plain["output_ids"]  # logprobs never change the tokens (issue #42)
    assert meta["jump_forward_tokens"] == plain["meta_info"]["jump_forward_tokens"] > 0
    assert len(meta["output_token_logprobs"]) == meta["completion_tokens"]
    assert all(lp[0] is not None for lp in meta["output_token_logprobs"])
    jsonschema.validate(json.loads(out["text"]), LONG_KEYS)
