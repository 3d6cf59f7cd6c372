"""Constrained decoding on SmolLM2, end to end and per mask step, per grammar backend, in one run.

For each backend (outlines, xgrammar, llguidance):
1. decode tokens/s with a JSON schema vs unconstrained, batch 1 and 16 (goal: >= 0.95x at
   batch 16); constrained runs with jump-forward off so the ratio is the cost of masking alone,
   and each free request decodes as many tokens as its constrained twin, right after it;
2. grammar compile time over the schema corpus (tests/constrained): median first compile,
   median cached, and how many schemas the backend refuses;
3. mask + advance per token for a JSON schema and an EBNF grammar (bench.constrained_micro;
   goal: EBNF within 2x of JSON).
Then jump-forward on vs off for a schema with long keys on the default backend: wall time
and forward steps (goal: >= 1.5x fewer steps).

    .venv/bin/python -m bench.constrained [--quick] [--backends outlines,xgrammar]

Writes bench/results/constrained.json.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from bench import constrained_micro  # noqa: E402
from bench.common import threads, write_result  # noqa: E402
from radixlang import Engine  # noqa: E402
from radixlang.constrained import BACKENDS, GrammarCompiler, TokenizerInfo, UnsupportedGrammar  # noqa: E402
from radixlang.runtime.server_args import ServerArgs  # noqa: E402
from tests.constrained.schema_corpus import OPENAI_STYLE  # noqa: E402
from tests.constrained.test_random_walk import SCHEMAS as WALK_SCHEMAS  # noqa: E402

SCHEMAS = {**WALK_SCHEMAS, **OPENAI_STYLE}

# a free-text field long enough to measure decode (every backend takes it: xgrammar refuses minLength)
STORY = {"type": "object", "properties": {"story": {"type": "string"}}, "required": ["story"]}
LONG_KEYS = {"type": "object", "properties": {
    "customer_full_legal_name": {"type": "string", "maxLength": 24},
    "primary_shipping_address_line": {"type": "string", "maxLength": 32},
    "account_creation_calendar_year": {"type": "integer", "minimum": 1900, "maximum": 2100},
    "is_premium_subscription_active": {"type": "boolean"},
    "preferred_contact_channel": {"enum": ["email", "telephone", "postal_mail"]}},
    "required": ["customer_full_legal_name", "primary_shipping_address_line", "account_creation_calendar_year",
                 "is_premium_subscription_active", "preferred_contact_channel"]}
PROMPT = "Write a short story about a lighthouse keeper, as JSON with one field, story:\n"
CUSTOMER = "Make up a customer record as JSON:\n"


def _run(engine: Engine, prompts: list[str], params: list[dict]) -> tuple[list[dict], float, int]:
    steps = engine.get_server_info()["forward_steps"]
    t = time.perf_counter()
    outs = engine.generate(prompts, params)
    wall = time.perf_counter() - t
    return outs, wall, engine.get_server_info()["forward_steps"] - steps


def decode_ratio(free: Engine, masked: Engine, batch: int, tokens: int, repeat: int = 1) -> dict[str, Any]:
    """Tokens/s of JSON-constrained vs free requests producing the same number of tokens each.

    The constrained requests run first (temperature 0.8, seeded); each free request then decodes
    exactly as many tokens as its constrained twin (ignore_eos), so both runs have the same shape.
    The pair runs ``repeat`` times, alternating; each side keeps its fastest run (on a shared
    machine the slow runs are other processes' load, not this code).
    """
    prompts = [PROMPT] * batch
    json_params = [{"temperature": 0.8, "max_new_tokens": tokens, "json_schema": json.dumps(STORY),
                    "sampling_seed": i} for i in range(batch)]
    _run(masked, prompts[:1], json_params[:1])  # warm: compile the grammar, fill the prefix cache
    row: dict[str, Any] = {"repeat": repeat, "runs": []}
    for _ in range(repeat):
        outs, wall, steps = _run(masked, prompts, json_params)
        lengths = [o["meta_info"]["completion_tokens"] for o in outs]
        pair: dict[str, Any] = {"json": {"tokens": sum(lengths), "wall_s": wall, "steps": steps,
                                         "valid": sum(1 for o in outs if _valid_json(o["text"])),
                                         "stopped": sum(1 for o in outs
                                                        if o["meta_info"]["finish_reason"]["type"] == "stop")}}
        free_params = [{"temperature": 0.8, "max_new_tokens": n, "ignore_eos": True, "sampling_seed": i}
                       for i, n in enumerate(lengths)]
        _run(free, prompts[:1], free_params[:1])
        outs, wall, steps = _run(free, prompts, free_params)
        pair["free"] = {"tokens": sum(o["meta_info"]["completion_tokens"] for o in outs), "wall_s": wall,
                        "steps": steps}
        for r in pair.values():
            r["tok_s"] = r["tokens"] / r["wall_s"]
        row["runs"].append(pair)
    for side in ("json", "free"):
        row[side] = max((p[side] for p in row["runs"]), key=lambda r: r["tok_s"])
    row["ratio"] = row["json"]["tok_s"] / row["free"]["tok_s"]
    return row


def compile_times(tokenizer: Any, backend: str) -> dict[str, Any]:
    compiler = GrammarCompiler(TokenizerInfo.from_tokenizer(tokenizer), backend=backend, cache_size=256, timeout_s=600)
    compiler.compile("regex", "warm")  # tokenizer tables, built once per server
    first, cached, failed, refused = [], [], {}, []
    for name, schema in sorted(SCHEMAS.items()):
        spec = json.dumps(schema)
        try:
            t = time.perf_counter()
            compiler.compile("json", spec)
            first.append(time.perf_counter() - t)
            t = time.perf_counter()
            compiler.compile("json", spec)
            cached.append(time.perf_counter() - t)
        except UnsupportedGrammar:
            refused.append(name)
        except Exception as e:  # keep the others' numbers
            failed[name] = f"{type(e).__name__}: {e}"
    compiler.shutdown()
    return {"schemas": len(SCHEMAS), "compiled": len(first), "refused": refused,
            "first_median_ms": statistics.median(first) * 1e3, "first_max_ms": max(first) * 1e3,
            "cached_median_us": statistics.median(cached) * 1e6, "failed": failed}


def jump_forward(on: Engine, off: Engine, batch: int) -> dict[str, Any]:
    params = [{"json_schema": json.dumps(LONG_KEYS), "temperature": 0.7, "sampling_seed": i, "max_new_tokens": 256}
              for i in range(batch)]
    row: dict[str, Any] = {}
    for name, engine in (("on", on), ("off", off)):
        _run(engine, [CUSTOMER], params[:1])  # warm
        outs, wall, steps = _run(engine, [CUSTOMER] * batch, params)
        valid = sum(1 for o in outs if _valid_json(o["text"]))
        row[name] = {"wall_s": wall, "steps": steps, "valid": f"{valid}/{batch}",
                     "completion_tokens": sum(o["meta_info"]["completion_tokens"] for o in outs),
                     "jumped_tokens": sum(o["meta_info"].get("jump_forward_tokens", 0) for o in outs)}
    row["fewer_steps"] = row["off"]["steps"] / max(row["on"]["steps"], 1)
    row["speedup_wall"] = row["off"]["wall_s"] / row["on"]["wall_s"]
    return row


def _valid_json(text: str) -> bool:
    try:
        json.loads(text)
        return True
    except ValueError:
        return False


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer tokens per request")
    ap.add_argument("--backends", default=",".join(BACKENDS), help="comma-separated grammar backends")
    ap.add_argument("--repeat", type=int, default=3, help="alternating json/free runs per batch size (best kept)")
    ap.add_argument("--skip-jump-forward", action="store_true", help="only the per-backend rows")
    args = ap.parse_args()
    backends = [b for b in args.backends.split(",") if b]
    tokens = 48 if args.quick else 128
    common = {"max_total_tokens": 8192, "num_threads": threads()}
    results: dict[str, Any] = {"model": "SmolLM2-135M-Instruct", "tokens_per_request": tokens,
                               "default_backend": ServerArgs().grammar_backend, "backends": {}}
    tok = constrained_micro.load_tokenizer()
    micro = constrained_micro.run(tok, 3)
    results["mask_step"] = micro
    for backend in backends:
        row = results["backends"][backend] = {"compile": compile_times(tok, backend)}
        c = row["compile"]
        print(f"{backend}: compile over {c['schemas']} schemas: {c['compiled']} compiled, "
              f"{len(c['refused'])} refused {c['refused']}, {len(c['failed'])} failed; first median "
              f"{c['first_median_ms']:.1f} ms (max {c['first_max_ms']:.0f} ms), cached median "
              f"{c['cached_median_us']:.1f} us")
        m = micro[backend]
        print(f"{backend}: mask+accept per token: json {m['json']['mask_accept_us']:.1f} us"
              + (f", ebnf {m['ebnf']['mask_accept_us']:.1f} us = {m['ebnf_over_json_mask_step']:.2f}x json "
                 f"(goal <= 2x)" if "ebnf_over_json_mask_step" in m else ", ebnf not supported"))
        free = Engine(**common, disable_jump_forward=True)
        masked = Engine(**common, disable_jump_forward=True, grammar_backend=backend)
        try:
            for batch in (1, 16):
                row[f"decode_b{batch}"] = d = decode_ratio(free, masked, batch, tokens, args.repeat)
                print(f"{backend}: decode batch {batch}: json/free tokens/s {d['ratio']:.2f}x"
                      f"{' (goal >= 0.95x)' if batch == 16 else ''}; json {d['json']['tok_s']:.1f} tok/s "
                      f"({d['json']['valid']}/{batch} valid), free {d['free']['tok_s']:.1f} tok/s")
        finally:
            masked.shutdown()
            free.shutdown()
    if args.skip_jump_forward:
        print("wrote", write_result("constrained", results))
        return
    on = Engine(**common)
    off = Engine(**common, disable_jump_forward=True)
    try:
        for batch in (1, 8):
            results[f"jump_forward_b{batch}"] = row = jump_forward(on, off, batch)
            print(f"jump-forward ({results['default_backend']}) batch {batch}: {row['fewer_steps']:.2f}x fewer "
                  f"steps (goal >= 1.5x), {row['speedup_wall']:.2f}x wall; on {row['on']} off {row['off']}")
    finally:
        on.shutdown()
        off.shutdown()
    print("wrote", write_result("constrained", results))


if __name__ == "__main__":
    main()
