"""The xgrammar backend: regex, JSON schema, EBNF (GBNF, ``root ::= ...``) and structural tags."""

from __future__ import annotations

import json
from typing import Any

import torch
import xgrammar as xg

from radixlang.constrained.errors import UnsupportedGrammar, one_line
from radixlang.constrained.library_grammar import MatcherCompiled, MatcherGrammar, spellable_mask
from radixlang.constrained.schema_policy import check_whitespace_pattern, prepare_schema
from radixlang.constrained.structural_tag import parse_structural_tag
from radixlang.constrained.structural_tag_xgrammar import block_tag_format, forced_tag_format
from radixlang.constrained.tokenizer_info import TokenizerInfo

KINDS = ("regex", "json", "ebnf", "structural_tag")


class XGrammarGrammar(MatcherGrammar):
    def _new_matcher(self) -> Any:
        # stop tokens are handled by MatcherGrammar (EOS only where the grammar accepts)
        return xg.GrammarMatcher(self.compiled.handle, terminate_without_stop_token=True)

    def _fork(self) -> Any:
        return self.matcher.fork()

    def _fill(self, row: torch.Tensor) -> None:
        self.matcher.fill_next_token_bitmask(row.unsqueeze(0), 0)

    def _accept(self, token_id: int) -> bool:
        return bool(self.matcher.accept_token(token_id))

    def _accepting(self) -> bool:
        return bool(self.matcher.is_completed())

    def _forced_bytes(self) -> bytes:
        return self.matcher.find_jump_forward_string().encode("utf-8")


class XGrammarBackend:
    name = "xgrammar"
    kinds = KINDS

    def __init__(self, info: TokenizerInfo, *, whitespace_pattern: str | None = None, num_threads: int = 2) -> None:
        self.info = info
        vocab = [b if b else b"" for b in info.token_bytes]
        self._xg_info = xg.TokenizerInfo(vocab, xg.VocabType.RAW, vocab_size=info.vocab_size,
                                         stop_token_ids=list(info.eos_token_ids))
        self._compiler = xg.GrammarCompiler(self._xg_info, max_threads=num_threads, cache_enabled=False)
        self._base = spellable_mask(info)
        # None: xgrammar's any_whitespace=False, which writes ", " and ": " (its default separators); a
        # pattern maps onto one of xgrammar's whitespace modes or is refused (schema_policy)
        self.whitespace_pattern = whitespace_pattern
        self._json_kwargs = check_whitespace_pattern(self.name, whitespace_pattern) or {"any_whitespace": False}

    def build(self, kind: str, spec: str | None, schema: Any = None) -> MatcherCompiled:
        try:
            if kind == "regex":
                handle = self._compiler.compile_regex(spec)
            elif kind == "json":
                handle = (self._compiler.compile_builtin_json_grammar() if schema is None
                          else self._compiler.compile_json_schema(json.dumps(schema), strict_mode=True,
                                                                  **self._json_kwargs))
            elif kind == "ebnf":
                handle = self._compiler.compile_grammar(spec)
            else:
                handle = self._compiler.compile_structural_tag(self._structural_tag(spec))
        except UnsupportedGrammar:  # a structure's schema refused by the keyword policy: keeps its field
            raise
        except (RuntimeError, ValueError, TypeError) as e:
            message = one_line(str(e)) or type(e).__name__
            raise ValueError(f"invalid {kind} grammar for xgrammar: {message}") from None
        return self._compiled(kind, spec, handle)

    def load(self, kind: str, spec: str | None, serialized: str) -> MatcherCompiled:
        """The compiled grammar the compile worker sent (``CompiledGrammar.serialize_json``)."""
        return self._compiled(kind, spec, xg.CompiledGrammar.deserialize_json(serialized, self._xg_info))

    def _compiled(self, kind: str, spec: str | None, handle: Any) -> MatcherCompiled:
        return MatcherCompiled(backend=self.name, kind=kind, spec=spec, handle=handle, tokenizer_info=self.info,
                               grammar_cls=XGrammarGrammar, base_mask=self._base)

    def _structural_tag(self, spec: str | None) -> Any:
        tag = parse_structural_tag(spec)  # type: ignore[arg-type]
        schemas = [prepare_schema(s.schema, self.name, "structural_tag") for s in tag.structures]
        if tag.forced:
            answer = (None if tag.answer_schema is None
                      else prepare_schema(tag.answer_schema, self.name, "structural_tag"))
            return forced_tag_format(tag, schemas, answer)
        if tag.block:
            return block_tag_format(tag, schemas)
        items = [xg.StructuralTagItem(begin=s.begin, schema=json.dumps(schema), end=s.end)
                 for s, schema in zip(tag.structures, schemas)]
        return xg.StructuralTag.from_legacy_structural_tag(items, list(tag.triggers))
