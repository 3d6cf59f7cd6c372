"""A corpus of JSON schemas for the fidelity tests and the bench: the random-walk schemas plus
schemas written the way users of OpenAI's structured outputs write them."""

from __future__ import annotations

from typing import Any

OPENAI_STYLE: dict[str, Any] = {
    "calendar_event": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 12}, "date": {"type": "string", "format": "date"},
        "participants": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3}},
        "required": ["name", "date", "participants"], "additionalProperties": False},
    "math_reasoning": {"type": "object", "properties": {
        "steps": {"type": "array", "maxItems": 2, "items": {"type": "object", "properties": {
            "explanation": {"type": "string", "maxLength": 10}, "output": {"type": "string", "maxLength": 6}},
            "required": ["explanation", "output"], "additionalProperties": False}},
        "final_answer": {"type": "string", "maxLength": 6}},
        "required": ["steps", "final_answer"], "additionalProperties": False},
    "entity_extraction": {"type": "object", "properties": {
        "people": {"type": "array", "maxItems": 2, "items": {"type": "string", "maxLength": 6}},
        "sentiment": {"type": "string", "enum": ["positive", "neutral", "negative"]},
        "location": {"anyOf": [{"type": "string", "maxLength": 8}, {"type": "null"}]}},
        "required": ["people", "sentiment", "location"], "additionalProperties": False},
    "issue_id_bounds": {"type": "object", "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 9999}},
                        "required": ["id"]},
    "user_profile": {"type": "object", "properties": {
        "user_id": {"type": "string", "format": "uuid"}, "email": {"type": "string", "format": "email"},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "signup": {"type": "string", "format": "date-time"}},
        "required": ["user_id", "email", "age", "signup"], "additionalProperties": False},
    "payment_one_of": {"type": "object", "properties": {"payment": {"oneOf": [
        {"type": "object", "properties": {"kind": {"const": "card"}, "last4": {"type": "string",
                                                                              "pattern": "^[0-9]{4}$"}},
         "required": ["kind", "last4"], "additionalProperties": False},
        {"type": "object", "properties": {"kind": {"const": "bank"}, "iban": {"type": "string", "maxLength": 8}},
         "required": ["kind", "iban"], "additionalProperties": False}]}},
        "required": ["payment"], "additionalProperties": False},
    "defs_refs": {"$defs": {"address": {"type": "object", "properties": {
        "street": {"type": "string", "maxLength": 10}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
        "required": ["street", "zip"], "additionalProperties": False}},
        "type": "object", "properties": {"home": {"$ref": "#/$defs/address"},
                                         "work": {"anyOf": [{"$ref": "#/$defs/address"}, {"type": "null"}]}},
        "required": ["home", "work"], "additionalProperties": False},
    "order": {"type": "object", "properties": {
        "items": {"type": "array", "minItems": 1, "maxItems": 2, "items": {"type": "object", "properties": {
            "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"},
            "quantity": {"type": "integer", "exclusiveMinimum": 0, "maximum": 20}},
            "required": ["sku", "quantity"], "additionalProperties": False}},
        "status": {"enum": ["pending", "shipped", "delivered"]}},
        "required": ["items", "status"], "additionalProperties": False},
    "all_of": {"allOf": [{"type": "object", "properties": {"a": {"type": "integer", "minimum": -5, "maximum": 5}},
                          "required": ["a"]},
                         {"type": "object", "properties": {"b": {"type": "boolean"}}, "required": ["b"]}]},
    "times": {"type": "object", "properties": {"at": {"type": "string", "format": "time"},
                                               "ip": {"type": "string", "format": "ipv4"}},
              "required": ["at", "ip"]},
    "price_bounds": {"type": "object", "properties": {"price": {"type": "number", "minimum": 0, "maximum": 100}},
                     "required": ["price"]},
    "tuple": {"type": "object", "properties": {"point": {"type": "array", "prefixItems": [
        {"type": "integer"}, {"type": "string", "maxLength": 3}], "items": False}}, "required": ["point"]},
    "tags_unique": {"type": "object", "properties": {"tags": {"type": "array", "items": {"enum": ["a", "b", "c"]},
                                                              "uniqueItems": True}}, "required": ["tags"]},
    "one_of_overlap": {"type": "object", "properties": {"v": {"oneOf": [{"type": "integer"}, {"type": "number"}]}},
                       "required": ["v"]},
    "multiple_of": {"type": "object", "properties": {"n": {"type": "integer", "multipleOf": 5}}, "required": ["n"]},
    "min_properties": {"type": "object", "additionalProperties": {"type": "integer"}, "minProperties": 1},
    "not_keyword": {"type": "object", "properties": {"s": {"type": "string", "not": {"const": "x"}}},
                    "required": ["s"]},
    "recursive_tree": {"$defs": {"node": {"type": "object", "properties": {
        "v": {"type": "integer"}, "kids": {"type": "array", "maxItems": 2, "items": {"$ref": "#/$defs/node"}}},
        "required": ["v", "kids"], "additionalProperties": False}}, "$ref": "#/$defs/node"},
}
