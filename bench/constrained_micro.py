"""Constrained-decoding micro bench on the SmolLM2 tokenizer (49152 tokens).

For a 5-field JSON schema: compile time (first and cached) and the per-token cost
of filling the bitmask row and advancing the state along a fixed valid document,
plus applying the mask to a [1, vocab] logits row. The same numbers for xgrammar
and llguidance when they are importable.

    .venv/bin/python -m bench.constrained_micro [--reps 3]
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from bench.common import threads, write_result  # noqa: E402
from radixlang.constrained import Grammar, GrammarCompiler, TokenizerInfo  # noqa: E402
from radixlang.kernels.bitmask import allocate_token_bitmask, apply_token_bitmask_inplace  # noqa: E402

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 40},
    "age": {"type": "integer"},
    "email": {"type": "string"},
    "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
    "active": {"type": "boolean"}},
    "required": ["name", "age", "email", "tags", "active"]}
DOCUMENT = ('{"name": "Ada Lovelace", "age": 36, "email": "ada@analytical.engine", '
            '"tags": ["math", "poetry", "engines"], "active": true}')


def load_tokenizer() -> Any:
    from transformers import AutoTokenizer
    from radixlang.runtime.models.loader import resolve_model_dir
    return AutoTokenizer.from_pretrained(resolve_model_dir(None))


def bench_radixlang(tok: Any, ids: list[int], reps: int) -> dict[str, float]:
    info = TokenizerInfo.from_tokenizer(tok)
    compiler = GrammarCompiler(info, whitespace_pattern=r"[ ]?")
    spec = json.dumps(SCHEMA)
    t = time.perf_counter()
    compiled = compiler.compile("json", spec)
    first = time.perf_counter() - t
    t = time.perf_counter()
    compiler.compile("json", spec)
    cached = time.perf_counter() - t
    bitmask = allocate_token_bitmask(1, info.vocab_size)
    logits = torch.zeros(1, info.vocab_size)
    per_step = []
    for rep in range(reps + 1):  # rep 0 fills the per-state mask cache
        g = Grammar(compiled)
        t = time.perf_counter()
        for tok_id in ids:
            g.allowed_token_mask(bitmask[0])
            assert g.accept_token(tok_id), tok_id
        if rep == 0:
            cold = (time.perf_counter() - t) / len(ids)
        else:
            per_step.append((time.perf_counter() - t) / len(ids))
    t = time.perf_counter()
    for _ in range(100):
        apply_token_bitmask_inplace(logits, bitmask)
    apply_us = (time.perf_counter() - t) / 100 * 1e6
    compiler.shutdown()
    return {"compile_first_s": first, "compile_cached_s": cached, "mask_accept_us_cold": cold * 1e6,
            "mask_accept_us_warm": min(per_step) * 1e6, "apply_bitmask_us": apply_us}


def bench_xgrammar(tok: Any, ids: list[int], reps: int) -> dict[str, float] | None:
    try:
        import xgrammar as xgr
    except ImportError:
        return None
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=len(tok))
    compiler = xgr.GrammarCompiler(info)
    spec = json.dumps(SCHEMA)
    t = time.perf_counter()
    compiled = compiler.compile_json_schema(spec, any_whitespace=True)
    first = time.perf_counter() - t
    t = time.perf_counter()
    compiler.compile_json_schema(spec, any_whitespace=True)
    cached = time.perf_counter() - t
    bitmask = xgr.allocate_token_bitmask(1, len(tok))
    per_step = []
    for _ in range(reps):
        m = xgr.GrammarMatcher(compiled)
        t = time.perf_counter()
        for tok_id in ids:
            m.fill_next_token_bitmask(bitmask)
            assert m.accept_token(tok_id), tok_id
        per_step.append((time.perf_counter() - t) / len(ids))
    return {"compile_first_s": first, "compile_cached_s": cached, "mask_accept_us_warm": min(per_step) * 1e6}


def bench_llguidance(tok: Any, ids: list[int], reps: int) -> dict[str, float] | None:
    try:
        import llguidance
        import llguidance.hf
        import llguidance.torch as llt
    except ImportError:
        return None
    lltok = llguidance.hf.from_tokenizer(tok)
    grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(SCHEMA))
    t = time.perf_counter()
    matcher = llguidance.LLMatcher(lltok, grammar)
    first = time.perf_counter() - t
    bitmask = llt.allocate_token_bitmask(1, lltok.vocab_size)
    per_step = []
    for _ in range(reps):
        matcher = llguidance.LLMatcher(lltok, grammar)
        t = time.perf_counter()
        for tok_id in ids:
            llt.fill_next_token_bitmask(matcher, bitmask, 0)
            assert matcher.consume_token(tok_id), tok_id
        per_step.append((time.perf_counter() - t) / len(ids))
    return {"matcher_create_s": first, "mask_accept_us_warm": min(per_step) * 1e6}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(threads())
    tok = load_tokenizer()
    ids = tok.encode(DOCUMENT, add_special_tokens=False)
    results: dict[str, Any] = {"schema_fields": len(SCHEMA["properties"]), "document_tokens": len(ids),
                               "vocab_size": len(tok), "radixlang_outlines": bench_radixlang(tok, ids, args.reps)}
    for name, fn in (("xgrammar", bench_xgrammar), ("llguidance", bench_llguidance)):
        try:
            results[name] = fn(tok, ids, args.reps) or "not installed"
        except Exception as e:  # a competitor's API drift must not lose our numbers
            results[name] = f"failed: {type(e).__name__}: {e}"
    print(json.dumps(results, indent=2))
    print("wrote", write_result("constrained_micro", results))


if __name__ == "__main__":
    main()
