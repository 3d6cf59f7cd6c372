"""The llguidance backend: regex, JSON schema, EBNF (Lark, or GBNF converted by llguidance) and
structural tags.

The grammar text comes from llguidance_compile.py (in the compile worker process); here it
becomes one template matcher per compiled grammar, which each request's matcher is copied from.
"""

from __future__ import annotations

from typing import Any

import torch

from radixlang.constrained.library_grammar import MatcherCompiled, MatcherGrammar, spellable_mask
from radixlang.constrained.llguidance_compile import JSON_OPTIONS, LLGuidanceCompiler
from radixlang.constrained.tokenizer_info import TokenizerInfo

KINDS = ("regex", "json", "ebnf", "structural_tag")
__all__ = ["JSON_OPTIONS", "KINDS", "LLGuidanceBackend", "LLGuidanceGrammar"]


class LLGuidanceGrammar(MatcherGrammar):
    def _new_matcher(self) -> Any:
        # a copy of the template: building a matcher parses the whole grammar again
        return self.compiled.handle.template.deep_copy()

    def _fork(self) -> Any:
        return self.matcher.deep_copy()

    def _fill(self, row: torch.Tensor) -> None:
        self.matcher.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * row.element_size())

    def _accept(self, token_id: int) -> bool:
        if self.matcher.validate_tokens([token_id]) != 1:
            return False
        return bool(self.matcher.consume_token(token_id))

    def _accepting(self) -> bool:
        return bool(self.matcher.is_accepting())

    def _forced_bytes(self) -> bytes:
        return bytes(self.matcher.compute_ff_bytes())


class _Handle:
    def __init__(self, grammar: str, template: Any) -> None:
        self.grammar, self.template = grammar, template


class LLGuidanceBackend:
    name = "llguidance"
    kinds = KINDS

    def __init__(self, info: TokenizerInfo, *, whitespace_pattern: str | None = None) -> None:
        self.info = info
        self.compiler = LLGuidanceCompiler(info, whitespace_pattern=whitespace_pattern)
        # a grammar may name a special token (a call trigger): llguidance allows one only where it is named
        self._base = spellable_mask(info, named_special=True)
        self.whitespace_pattern = whitespace_pattern

    def json_options(self) -> dict[str, Any]:
        return self.compiler.json_options()

    def build(self, kind: str, spec: str | None, schema: Any = None) -> MatcherCompiled:
        """Compile in this process (the compile worker calls ``LLGuidanceCompiler.grammar`` instead)."""
        return self.load(kind, spec, self.compiler.grammar(kind, spec, schema))

    def load(self, kind: str, spec: str | None, grammar: str) -> MatcherCompiled:
        """The compiled grammar of validated grammar text (what the compile worker sends back)."""
        return MatcherCompiled(backend=self.name, kind=kind, spec=spec,
                               handle=_Handle(grammar, self.compiler.matcher(grammar)),
                               tokenizer_info=self.info, grammar_cls=LLGuidanceGrammar, base_mask=self._base)
