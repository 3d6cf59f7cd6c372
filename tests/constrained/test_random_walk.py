"""Random walks through real grammars on the SmolLM2 tokenizer: outputs must match / validate."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from radixlang.constrained import Grammar

REGEXES = [
    r"[a-z]{3,10}@[a-z]{2,6}\.(com|org|net)",
    r"\d{3}-\d{4}",
    r"(yes|no|maybe)",
    r"-?(0|[1-9][0-9]{0,5})(\.[0-9]{1,3})?",
    r"[A-Z][a-z]{1,8}( [A-Z][a-z]{1,8}){0,2}",
    r"(\+|-)?[0-9]{1,4}",
    r"(ab|cd)+e?",
    r"#[0-9a-fA-F]{6}",
    r"(héllo|wörld|日本語)( (héllo|wörld|日本語)){0,3}",
    r"[^\n]{5,20}\n",
    r"(0?[1-9]|1[0-2]):[0-5][0-9] (AM|PM)",
    r"\[(\d+,){0,3}\d+\]",
    r'"([^"\\]|\\.){0,12}"',
    r"[α-ω]{2,5}",
    r"https?://[a-z]+(\.[a-z]+)+(/[a-z0-9]*)*",
    r"a{2,3}b{0,2}c",
]

SCHEMAS = {
    "nested": {"type": "object", "properties": {"user": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 8}, "id": {"type": "integer"}}, "required": ["name", "id"]}},
        "required": ["user"]},
    "array_bounds": {"type": "object", "properties": {"xs": {"type": "array", "items": {"type": "integer"},
                                                             "minItems": 2, "maxItems": 4}}, "required": ["xs"]},
    "enum": {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}}, "required": ["color"]},
    "const": {"type": "object", "properties": {"v": {"const": 7}, "kind": {"const": "fixed"}},
              "required": ["v", "kind"]},
    "int_bounds": {"type": "object", "properties": {"age": {"type": "integer", "minimum": 18, "maximum": 99},
                                                    "n": {"type": "integer", "exclusiveMinimum": -3,
                                                          "exclusiveMaximum": 3}},
                   "required": ["age", "n"]},
    "number": {"type": "object", "properties": {"x": {"type": "number"}, "y": {"type": "number"}},
               "required": ["x", "y"]},
    "optional": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string", "maxLength": 4},
                                                  "c": {"type": "boolean"}}, "required": ["a"]},
    "any_of": {"type": "object", "properties": {"v": {"anyOf": [{"type": "integer"}, {"type": "boolean"},
                                                                {"type": "string", "maxLength": 3}]}},
               "required": ["v"]},
    "nullable": {"type": "object", "properties": {"note": {"type": ["string", "null"], "maxLength": 5}},
                 "required": ["note"]},
    "ref_defs": {"$defs": {"point": {"type": "object", "properties": {"x": {"type": "integer"},
                                                                      "y": {"type": "integer"}},
                                     "required": ["x", "y"]}},
                 "type": "object", "properties": {"a": {"$ref": "#/$defs/point"}, "b": {"$ref": "#/$defs/point"}},
                 "required": ["a", "b"]},
    "pattern": {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"}},
                "required": ["code"]},
    "str_len": {"type": "object", "properties": {"s": {"type": "string", "minLength": 3, "maxLength": 6}},
                "required": ["s"]},
    "escapes": {"type": "object", "properties": {"q": {"enum": ['say "hi"', "back\\slash", "tab\there"]},
                                                 "free": {"type": "string", "maxLength": 6}},
                "required": ["q", "free"]},
    "unicode": {"type": "object", "properties": {"名前": {"enum": ["café", "日本語", "naïve"]},
                                                 "text": {"type": "string", "maxLength": 5}},
                "required": ["名前", "text"]},
    "array_of_objects": {"type": "object", "properties": {"items": {"type": "array", "maxItems": 2, "items": {
        "type": "object", "properties": {"ok": {"type": "boolean"}, "tag": {"enum": ["x", "y"]}},
        "required": ["ok", "tag"]}}}, "required": ["items"]},
    "date": {"type": "object", "properties": {"day": {"type": "string", "format": "date"}}, "required": ["day"]},
    "closed_object": {"type": "object", "properties": {"k": {"type": "integer"}}, "additionalProperties": False},
}


@pytest.mark.parametrize("pattern", REGEXES)
def test_regex_walks_fully_match(pattern, smollm_compiler, walk):
    compiled = smollm_compiler.compile("regex", pattern)
    for text in walk(compiled):
        assert re.fullmatch(pattern, text), (pattern, text)


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_schema_walks_validate(name, smollm_compiler, walk):
    schema = SCHEMAS[name]
    compiled = smollm_compiler.compile("json", json.dumps(schema))
    for text in walk(compiled):
        doc = json.loads(text)
        jsonschema.validate(doc, schema, format_checker=jsonschema.FormatChecker())


def test_any_json_object_walks_parse(smollm_compiler, walk):
    compiled = smollm_compiler.compile("json", None)
    docs = [json.loads(text) for text in walk(compiled, seeds=tuple(range(6)))]
    assert all(isinstance(doc, dict) for doc in docs)
    assert any(doc for doc in docs)  # not only "{}"


def test_mask_rows_are_cached_per_state(smollm_compiler, smollm_info):
    compiled = smollm_compiler.compile("regex", r"(ab|cd)+e?")
    a, b = Grammar(compiled), Grammar(compiled)
    row_a = torch.zeros(smollm_info.num_words(), dtype=torch.int32)
    row_b = torch.zeros_like(row_a)
    a.allowed_token_mask(row_a)
    b.allowed_token_mask(row_b)
    assert torch.equal(row_a, row_b)
    assert compiled.mask_for_state(a.state) is compiled.mask_for_state(b.state)
