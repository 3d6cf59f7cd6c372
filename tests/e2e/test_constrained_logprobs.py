"""Asking for logprobs never changes a constrained request's tokens (issue #42 item 1).

Jump-forward stays on for logprob requests: the forced tokens' logprobs come from the next
extend, masked like a sampled token's. Checked on the Engine (regex, JSON schema, EBNF,
greedy and seeded, finishing by the grammar and by max_new_tokens) and streamed.
"""
from __future__ import annotations

import json
import math

import pytest

pytestmark = pytest.mark.e2e

SCHEMA = {"type": "object", "properties": {
    "customer_full_legal_name": {"type": "string", "maxLength": 10},
    "account_creation_year": {"type": "integer", "minimum": 1900, "maximum": 2100},
    "is_premium_subscription_active": {"type": "boolean"}},
    "required": ["customer_full_legal_name", "account_creation_year", "is_premium_subscription_active"]}
SPECS = {"json_schema": {"json_schema": json.dumps(SCHEMA)},
         "regex": {"regex": r"(yes|no), the answer is [0-9]{2} exactly\."},
         "ebnf": {"ebnf": 'root ::= "greeting: hello " name " and goodbye"\nname ::= [a-z]{1,6}'}}
LOGPROB_ASKS = ({"return_logprob": True}, {"return_logprob": True, "top_logprobs_num": 3})


def _check_logprobs(out: dict, top: int) -> None:
    meta = out["meta_info"]
    entries = meta["output_token_logprobs"]
    assert [e[1] for e in entries] == out["output_ids"]
    assert all(e[0] is not None and math.isfinite(e[0]) and e[0] <= 1e-6 for e in entries), entries
    if top:
        rows = meta["output_top_logprobs"]
        assert len(rows) == len(entries)
        for (val, *_), row in zip(entries, rows):
            assert len(row) == top and val <= row[0][0] + 1e-5  # nothing beats the top choice


@pytest.mark.parametrize("kind", sorted(SPECS))
@pytest.mark.parametrize("sampling", [{"temperature": 0.0}, {"temperature": 1.0, "sampling_seed": 7}],
                         ids=["greedy", "seeded"])
def test_logprobs_keep_constrained_tokens(tiny_engine, kind, sampling):
    params = {**SPECS[kind], **sampling, "max_new_tokens": 96}
    plain = tiny_engine.generate("Give:", params)
    assert plain["meta_info"]["finish_reason"]["type"] == "stop", plain
    assert plain["meta_info"]["jump_forward_tokens"] > 0
    for ask in LOGPROB_ASKS:
        out = tiny_engine.generate("Give:", params, **ask)
        assert out["output_ids"] == plain["output_ids"], (ask, out["text"], plain["text"])
        assert out["meta_info"]["finish_reason"] == plain["meta_info"]["finish_reason"]
        assert out["meta_info"]["jump_forward_tokens"] == plain["meta_info"]["jump_forward_tokens"]
        _check_logprobs(out, ask.get("top_logprobs_num", 0))
    tiny_engine.check_memory_leak()


@pytest.mark.parametrize("n", [3, 9, 14])
def test_logprobs_keep_tokens_cut_by_max_new_tokens(tiny_engine, n):
    params = {**SPECS["regex"], "temperature": 0.0, "max_new_tokens": n}
    plain = tiny_engine.generate("Give:", params)
    out = tiny_engine.generate("Give:", params, return_logprob=True, top_logprobs_num=2)
    assert out["output_ids"] == plain["output_ids"]
    assert out["meta_info"]["finish_reason"] == plain["meta_info"]["finish_reason"]
    _check_logprobs(out, 2)
    tiny_engine.check_memory_leak()


def test_jumped_logprobs_are_the_models(tiny_engine):
    """A sampled token's logprob is at least the unconstrained model's (the mask only removes competitors);
    a jump-forwarded token's is the model's own: a logit row of the wrong position would break both."""
    params = {**SPECS["json_schema"], "temperature": 0.0, "max_new_tokens": 96}
    out = tiny_engine.generate("Give:", params, return_logprob=True)
    prompt = tiny_engine.tokenizer.encode("Give:")
    ids = prompt + out["output_ids"]
    scored = tiny_engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 0}, return_logprob=True,
                                  logprob_start_len=len(prompt) - 1)
    free = scored["meta_info"]["input_token_logprobs"][1:]
    assert [e[1] for e in free] == out["output_ids"]
    for (masked, tok, *_), (raw, *_) in zip(out["meta_info"]["output_token_logprobs"], free):
        assert masked >= raw - 1e-3, (tok, masked, raw)
    same = sum(abs(m[0] - r[0]) < 1e-3 for m, r in zip(out["meta_info"]["output_token_logprobs"], free))
    assert same >= out["meta_info"]["jump_forward_tokens"] > 0


def test_streamed_logprobs_stay_aligned_with_tokens(tiny_engine):
    params = {**SPECS["json_schema"], "temperature": 1.0, "sampling_seed": 3, "max_new_tokens": 96}
    whole = tiny_engine.generate("Give:", params)
    chunks = list(tiny_engine.generate("Give:", params, stream=True, return_logprob=True))
    assert chunks[-1]["output_ids"] == whole["output_ids"]
    for c in chunks:  # every chunk reports a logprob for each token it has sent
        assert [e[1] for e in c["meta_info"]["output_token_logprobs"]] == c["output_ids"]


def test_retracted_logprob_requests_keep_tokens_and_logprobs(tiny_engine, tiny_model_dir):
    """Out of KV, requests that owe jumped tokens' logprobs go back to the queue and recompute them."""
    from radixlang import Engine
    params = [{**SPECS["json_schema"], "temperature": 1.0, "sampling_seed": s, "max_new_tokens": 60} for s in range(8)]
    ref = tiny_engine.generate(["Give me the JSON now:"] * 8, params)
    with Engine(model_path=tiny_model_dir, load_format="dummy", max_total_tokens=140, chunked_prefill_size=16) as e:
        outs = e.generate(["Give me the JSON now:"] * 8, params, return_logprob=True)
        assert e.get_server_info()["num_retractions"] > 0
        e.check_memory_leak()
    for out, want in zip(outs, ref):
        assert out["output_ids"] == want["output_ids"]
        _check_logprobs(out, 0)
