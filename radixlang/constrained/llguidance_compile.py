"""llguidance grammars as text: regex, JSON schema, EBNF (Lark, or GBNF converted) and structural tags.

The compile half of the llguidance backend, without torch, so that the compile worker process
(compile_worker.py) can run it: ``LLGuidanceCompiler.grammar`` turns a (kind, spec) into the
grammar text an ``llg.LLMatcher`` takes, validated against the tokenizer. llguidance_backend.py
wraps that text into per-request matchers.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import llguidance as llg
from llguidance.gbnf_to_lark import any_to_lark

from radixlang.constrained.errors import one_line
from radixlang.constrained.harmony_lark import harmony_tag_lark
from radixlang.constrained.schema_policy import prepare_schema
from radixlang.constrained.structural_tag import parse_structural_tag
from radixlang.constrained.structural_tag_lark import block_tag_lark, forced_tag_lark
from radixlang.constrained.tokenizer_info import TokenizerInfo

# compact separators, as the outlines backend writes JSON by default
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class _ByteTokenizer:
    """What llguidance's TokenizerWrapper reads: token bytes, specials, and a (byte by byte) encoder."""

    def __init__(self, info: TokenizerInfo) -> None:
        self.eos_token_id = info.eos_token_ids[0]
        self.bos_token_id = None
        # tokens without bytes are special: llguidance spells them 0xFF + a name and never matches them as text;
        # a grammar names one by id (<[id]>, structural_tag_lark.py)
        self.tokens = [b if b else b"\xff<|special_%d|>" % i for i, b in enumerate(info.token_bytes)]
        self.special_token_ids = [i for i, b in enumerate(info.token_bytes) if not b]
        self._single = info.single_byte_ids

    def __call__(self, data: bytes) -> list[int]:
        return [self._single[b] for b in data if self._single[b] >= 0]


class LLGuidanceCompiler:
    """llguidance's tokenizer for one TokenizerInfo, and grammar text for (kind, spec)."""

    name = "llguidance"

    def __init__(self, info: TokenizerInfo, *, whitespace_pattern: str | None = None) -> None:
        self.info = info
        self.tokenizer = llg.LLTokenizer(llg.TokenizerWrapper(_ByteTokenizer(info)), n_vocab=info.vocab_size,
                                         eos_token=list(info.eos_token_ids))
        self.whitespace_pattern = whitespace_pattern

    def json_options(self) -> dict[str, Any]:
        """llguidance's JSON options: compact separators, or whitespace_pattern between every JSON token."""
        if self.whitespace_pattern is None:
            return JSON_OPTIONS
        return {"whitespace_flexible": True, "whitespace_pattern": self.whitespace_pattern,
                "item_separator": ",", "key_separator": ":"}

    def grammar(self, kind: str, spec: str | None, schema: Any = None) -> str:
        """The grammar text of (kind, spec) (``schema``: a json spec already checked and prepared);
        ValueError naming the kind when llguidance refuses it."""
        if kind == "regex":
            grammar = llg.LLMatcher.grammar_from_regex(spec)
        elif kind == "json":
            grammar = llg.LLMatcher.grammar_from_json_schema(
                {"type": "object"} if schema is None else schema, overrides=self.json_options())
        elif kind == "ebnf":
            try:
                lark = any_to_lark(spec)  # GBNF (root ::= ...) is converted, Lark passes through
            except Exception as e:  # the converter raises bare exceptions for GBNF it can't read
                raise ValueError(f"invalid ebnf grammar for llguidance: {str(e)[:300]}") from None
            grammar = llg.LLMatcher.grammar_from_lark(lark)
        elif (tag := parse_structural_tag(spec)).forced or tag.block:  # type: ignore[arg-type]
            schemas = [prepare_schema(s.schema, self.name, "structural_tag") for s in tag.structures]
            if tag.forced:
                answer = (None if tag.answer_schema is None
                          else prepare_schema(tag.answer_schema, self.name, "structural_tag"))
                grammar = forced_tag_lark(replace(tag, answer_schema=answer), schemas, self.json_options())
            elif tag.harmony:
                grammar = harmony_tag_lark(tag, schemas, self.json_options(), special_ids=self.info.special_ids,
                                           eos_names=self.info.eos_names)
            else:
                grammar = block_tag_lark(tag, schemas, self.json_options(), special_ids=self.info.special_ids)
        else:
            schemas = [prepare_schema(s.schema, self.name, "structural_tag") for s in tag.structures]
            options = self.json_options()
            tags = [llg.StructTag(trigger=tag.trigger_of(s), begin=s.begin, end=s.end,
                                  grammar={**(schema if isinstance(schema, dict) else {}), "x-guidance": options})
                    for s, schema in zip(tag.structures, schemas) if schema is not False]
            if not tags:
                raise ValueError("invalid structural_tag grammar: every structure has the schema false")
            grammar = llg.StructTag.to_grammar(tags, assume_special=False)
        is_error, messages = llg.LLMatcher.validate_grammar_with_warnings(grammar, self.tokenizer)
        if is_error:
            message = one_line(messages[0]) if messages and messages[0].strip() else "invalid"
            raise ValueError(f"invalid {kind} grammar for llguidance: {message}")
        return grammar

    def matcher(self, grammar: str) -> Any:
        """A fresh llguidance matcher of validated grammar text (building one parses the whole grammar)."""
        matcher = llg.LLMatcher(self.tokenizer, grammar, log_level=0)
        if matcher.is_error():  # a panic inside llguidance comes with a backtrace: its first line says it
            raise ValueError(f"invalid grammar for llguidance: {one_line(matcher.get_error())}")
        return matcher
