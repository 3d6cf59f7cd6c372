"""The xgrammar backend: regex, JSON schema, EBNF (GBNF, ``root ::= ...``) and structural tags."""

from __future__ import annotations

import json
from typing import Any

import torch
import xgrammar as xg

from radixlang.constrained.library_grammar import MatcherCompiled, MatcherGrammar, spellable_mask
from radixlang.constrained.schema_policy import prepare_schema
from radixlang.constrained.structural_tag import parse_structural_tag
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
        # None: compact JSON with one optional space after ',' and ':' is not expressible; xgrammar's
        # any_whitespace=False writes ", " and ": " (its default separators), which is valid JSON
        self.whitespace_pattern = whitespace_pattern

    def build(self, kind: str, spec: str | None, schema: Any = None) -> MatcherCompiled:
        try:
            if kind == "regex":
                handle = self._compiler.compile_regex(spec)
            elif kind == "json":
                handle = (self._compiler.compile_builtin_json_grammar() if schema is None
                          else self._compiler.compile_json_schema(json.dumps(schema), any_whitespace=False,
                                                                  strict_mode=True))
            elif kind == "ebnf":
                handle = self._compiler.compile_grammar(spec)
            else:
                tag = parse_structural_tag(spec)
                schemas = [prepare_schema(s.schema, self.name, "structural_tag") for s in tag.structures]
                items = [xg.StructuralTagItem(begin=s.begin, schema=json.dumps(schema), end=s.end)
                         for s, schema in zip(tag.structures, schemas)]
                handle = self._compiler.compile_structural_tag(
                    xg.StructuralTag.from_legacy_structural_tag(items, list(tag.triggers)))
        except (RuntimeError, ValueError, TypeError) as e:
            message = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise ValueError(f"invalid {kind} grammar for xgrammar: {message[:300]}") from None
        return MatcherCompiled(backend=self.name, kind=kind, spec=spec, handle=handle, tokenizer_info=self.info,
                               grammar_cls=XGrammarGrammar, base_mask=self._base)
