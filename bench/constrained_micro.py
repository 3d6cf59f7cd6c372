"""Constrained-decoding micro bench on the SmolLM2 tokenizer (49152 tokens), per grammar backend.

Through radixlang's own GrammarCompiler / per-request state for each backend (outlines,
xgrammar, llguidance): compile time of a 5-field JSON schema (first and cached), and the
per-token cost of filling the bitmask row and advancing the state along a fixed valid
document, for the JSON schema and for an EBNF (GBNF) grammar of the same document shape
(goal: EBNF mask step within 2x of the JSON mask step); plus applying the mask to a
[1, vocab] logits row.

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
from radixlang.constrained import BACKENDS, GrammarCompiler, TokenizerInfo  # noqa: E402
from radixlang.kernels.bitmask import allocate_token_bitmask, apply_token_bitmask_inplace  # noqa: E402

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string"},
    "age": {"type": "integer"},
    "email": {"type": "string"},
    "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
    "active": {"type": "boolean"}},
    "required": ["name", "age", "email", "tags", "active"]}
# the same documents as a GBNF grammar (xgrammar takes it as is, llguidance converts it to Lark)
EBNF = (r'root ::= "{\"name\": " str ", \"age\": " int ", \"email\": " str '
        r'", \"tags\": [" tags "], \"active\": " bool "}"' "\n") + r'''
str ::= "\"" [^"\\]* "\""
int ::= "-"? [0-9]+
tags ::= (str (", " str)*)?
bool ::= "true" | "false"
'''
DOCUMENT = ('{"name": "Ada Lovelace", "age": 36, "email": "ada@analytical.engine", '
            '"tags": ["math", "poetry", "engines"], "active": true}')


def load_tokenizer() -> Any:
    from transformers import AutoTokenizer

    from radixlang.runtime.models.loader.model_loader import resolve_model_dir
    return AutoTokenizer.from_pretrained(resolve_model_dir(None))


def _step_cost(compiled: Any, ids: list[int], info: TokenizerInfo, reps: int) -> tuple[float, float]:
    """(first walk, best later walk) microseconds per token of mask fill + accept along ``ids``."""
    bitmask = allocate_token_bitmask(1, info.vocab_size)
    eos = info.eos_token_ids[0]
    times = []
    for _ in range(reps + 1):  # the first walk fills per-state caches (outlines)
        g = compiled.new_grammar()
        t = time.perf_counter()
        for tok_id in [*ids, eos]:
            g.allowed_token_mask(bitmask[0])
            assert g.accept_token(tok_id), tok_id
        times.append((time.perf_counter() - t) / (len(ids) + 1) * 1e6)
        assert g.is_terminated()
    return times[0], min(times[1:])


def bench_backend(backend: str, tok: Any, ids: list[int], reps: int) -> dict[str, Any]:
    info = TokenizerInfo.from_tokenizer(tok)
    compiler = GrammarCompiler(info, backend=backend, timeout_s=600)
    compiler.compile("regex", "warm")  # tokenizer tables (not part of a grammar's compile time)
    row: dict[str, Any] = {}
    for kind, spec in (("json", json.dumps(SCHEMA)), ("ebnf", EBNF)):
        if kind == "ebnf" and backend == "outlines":
            row["ebnf"] = "not supported"
            continue
        t = time.perf_counter()
        compiled = compiler.compile(kind, spec)
        first = time.perf_counter() - t
        t = time.perf_counter()
        compiler.compile(kind, spec)
        cached = time.perf_counter() - t
        cold, warm = _step_cost(compiled, ids, info, reps)
        row[kind] = {"compile_first_ms": first * 1e3, "compile_cached_us": cached * 1e6,
                     "mask_accept_us_first_walk": cold, "mask_accept_us": warm}
    if isinstance(row.get("ebnf"), dict):
        row["ebnf_over_json_mask_step"] = row["ebnf"]["mask_accept_us"] / row["json"]["mask_accept_us"]
    compiler.shutdown()
    return row


def apply_cost(vocab: int) -> float:
    bitmask = allocate_token_bitmask(1, vocab)
    bitmask[0, ::3] = 0
    logits = torch.zeros(1, vocab)
    t = time.perf_counter()
    for _ in range(100):
        apply_token_bitmask_inplace(logits, bitmask)
    return (time.perf_counter() - t) / 100 * 1e6


def run(tok: Any, reps: int) -> dict[str, Any]:
    ids = tok.encode(DOCUMENT, add_special_tokens=False)
    results: dict[str, Any] = {"schema_fields": len(SCHEMA["properties"]), "document_tokens": len(ids),
                               "vocab_size": len(tok), "apply_bitmask_us": apply_cost(len(tok))}
    for backend in BACKENDS:
        results[backend] = bench_backend(backend, tok, ids, reps)
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(threads())
    results = run(load_tokenizer(), args.reps)
    print(json.dumps(results, indent=2))
    for backend in BACKENDS:
        r = results[backend]
        line = f"{backend}: json mask+accept {r['json']['mask_accept_us']:.1f} us/token"
        if "ebnf_over_json_mask_step" in r:
            line += (f", ebnf {r['ebnf']['mask_accept_us']:.1f} us/token = "
                     f"{r['ebnf_over_json_mask_step']:.2f}x json (goal <= 2x)")
        print(line)
    print("wrote", write_result("constrained_micro", results))


if __name__ == "__main__":
    main()
