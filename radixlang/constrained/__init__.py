"""Constrained decoding: regex / JSON schema / EBNF / structural tags -> per-token masks, with jump-forward.

Pieces: ``TokenizerInfo`` (bytes of every token), ``GrammarCompiler`` (one backend:
outlines-core, xgrammar or llguidance; LRU-cached compile to a shared compiled
grammar, sync or on worker threads with a time limit), the per-request state
(``GrammarState``: outlines' ``Grammar`` or library_grammar's ``MatcherGrammar``),
schema_policy (the JSON-Schema keywords each backend enforces; the rest is refused)
and, in radixlang/kernels/bitmask.py, the packed int32 bitmask helpers.

Scheduler recipe (one compiler per tokenizer, built at startup)::

    info = TokenizerInfo.from_tokenizer(tokenizer, vocab_size=model_vocab_size)
    compiler = GrammarCompiler(info, backend=args.grammar_backend, cache_size=64,
                               timeout_s=args.grammar_compile_timeout,
                               whitespace_pattern=args.constrained_json_whitespace_pattern)

    # admission: ("regex", p) | ("json", schema) | ("ebnf", g) | ("structural_tag", t); a kind, schema
    # keyword or format the backend does not enforce raises UnsupportedGrammar (ValueError, .param) here
    if params.grammar_key is not None:
        req.grammar_future = compiler.compile_async(*params.grammar_key)
    # keep the request in the waiting queue until req.grammar_future.done(); then
    try:
        req.grammar = req.grammar_future.result().new_grammar()  # one per request (n > 1: .copy())
    except ValueError as e:                     # bad grammar or GrammarCompileTimeout
        finish(req, abort, message=str(e))

    # constrain_after (reasoning-aware grammars): free text until the marker, then the grammar
    if params.constrain_after:
        req.grammar = ReasoningGrammar(req.grammar, compiler.free_text_masks(params.constrain_after))

    # every decode/extend step that samples
    bitmask = allocate_token_bitmask(bs, vocab_size, device)  # or reuse one buffer + fill_full()
    for row, req in enumerate(batch):
        if req.grammar is not None:
            req.grammar.allowed_token_mask(bitmask[row])      # rows of unconstrained reqs stay full
    apply_token_bitmask_inplace(logits, bitmask)              # before temperature/top-p/sampling
    tok = sample(logits)
    for req, t in zip(batch, tok):
        if req.grammar is None: continue
        req.grammar.accept_token(t)             # always True for a token sampled under the mask
        if req.grammar.is_terminated():         # EOS accepted in an accepting state
            finish(req, stop)
        elif not disable_jump_forward and (s := req.grammar.try_jump_forward()):
            ids = tokenizer.encode(s, add_special_tokens=False)
            if req.grammar.jump_forward_accept(ids):
                append ids to the output, detokenize them, and extend (prefill) them next step
            # else: state unchanged; keep decoding token by token under the mask

Notes: masks are built once per grammar state and cached in the CompiledGrammar
(a copy per step afterwards). Jump-forward text is cut at whole UTF-8
characters. The retokenized ids may differ from what the model would have
sampled; the grammar state depends only on the bytes, so any tokenization of
the forced text lands in the same state. Logprobs of jumped tokens are not
sampled: report them as the model's (an extend computes them) or as None.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from radixlang.constrained.compiler import BACKENDS, GrammarCompiler, GrammarCompileTimeout
    from radixlang.constrained.errors import UnsupportedGrammar
    from radixlang.constrained.grammar import CompiledGrammar, Grammar, pack_token_ids
    from radixlang.constrained.json_regex import any_json_object_regex, any_json_value_regex, json_schema_to_regex
    from radixlang.constrained.reasoning import FreeTextMasks, ReasoningGrammar
    from radixlang.constrained.state import GrammarState
    from radixlang.constrained.tokenizer_info import TokenizerInfo

# name -> its module, imported on first use: the compile worker process imports this package and,
# for outlines and llguidance, must not pay for torch (grammar.py and the masks import it)
_EXPORTS = {
    "BACKENDS": "compiler", "GrammarCompiler": "compiler", "GrammarCompileTimeout": "compiler",
    "UnsupportedGrammar": "errors", "CompiledGrammar": "grammar", "Grammar": "grammar", "pack_token_ids": "grammar",
    "FreeTextMasks": "reasoning", "ReasoningGrammar": "reasoning", "GrammarState": "state",
    "TokenizerInfo": "tokenizer_info", "any_json_object_regex": "json_regex", "any_json_value_regex": "json_regex",
    "json_schema_to_regex": "json_regex",
}

__all__ = [
    "BACKENDS", "CompiledGrammar", "FreeTextMasks", "Grammar", "GrammarCompileTimeout", "GrammarCompiler",
    "GrammarState", "ReasoningGrammar",
    "TokenizerInfo", "UnsupportedGrammar", "any_json_object_regex", "any_json_value_regex",
    "json_schema_to_regex", "pack_token_ids",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'radixlang.constrained' has no attribute {name!r}")
    return getattr(importlib.import_module(f"radixlang.constrained.{module}"), name)
