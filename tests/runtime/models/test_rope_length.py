"""Rotary rules that depend on the sequence length, with a prompt longer than their switch point: dynamic NTK
(Llama, max_position_embeddings 16, factor 4) and longrope (Phi-3, original context 32). transformers rotates
such a prompt, prefilled at once, with the prompt length's rows at every position; the Engine must give its
prompt log-probabilities (within 1e-4) and greedy tokens alone, in prefill chunks, batched with a short
prompt, and around the radix cache: a long prompt must not reuse a short prompt's differently rotated KV
(nor the reverse), while a repeated long prompt does reuse its own."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

import test_model_families as families
from tiny_model import FAMILIES, save_tiny_hf_model

# the short prompt's generation stays inside Phi-3's original context: transformers' Phi-3 recomputes its
# whole cache when a generation crosses it, which the runtime does not (models/layers/rotary.py)
NEW = 5
RULES = {
    # (arch, config overrides, long prompt length, switch point)
    "dynamic": ("LlamaForCausalLM", dict(max_position_embeddings=16, rope_parameters={
        "rope_type": "dynamic", "rope_theta": 10000.0, "factor": 4.0}), 40, 16),
    # Phi-3's family config without its window: every key counts, the first ones included
    "longrope": (FAMILIES["phi3"][0], {**FAMILIES["phi3"][1], "sliding_window": None}, 40, 32),
}


@pytest.fixture(scope="module", params=sorted(RULES))
def rule(request, tmp_path_factory):
    arch, overrides, long_len, switch = RULES[request.param]
    folder = save_tiny_hf_model(str(tmp_path_factory.mktemp(request.param)), arch, seed=5, **overrides)
    hf = _hf(folder)
    with torch.no_grad():  # sharper attention than random weights give: the rotation then shows in the logits
        for name, p in hf.named_parameters():
            if name.endswith(("q_proj.weight", "qkv_proj.weight")):
                p.mul_(4.0)
    hf.save_pretrained(folder)
    long_prompt = [(37 * i + 11) % 40000 + 3 for i in range(long_len)]
    short_prompt = long_prompt[:switch - 4]  # the long prompt's head: the same tokens, other rows
    return request.param, folder, long_prompt, short_prompt


def _hf(folder: str):
    """A fresh transformers model: its dynamic rotary keeps the longest length it saw and does not go back
    to a shorter one above max_position_embeddings, so each reference starts from a new one."""
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def _hf_logprobs(folder: str, ids: list[int]) -> torch.Tensor:
    return families._hf_logprobs(_hf(folder), ids)


def _hf_greedy(folder: str, ids: list[int]) -> list[int]:
    with torch.no_grad():
        out = _hf(folder).generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                   max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False, pad_token_id=0)
    return out[0, len(ids):].tolist()


def _run(engine, ids: list[int], start: int = 0) -> dict:
    """Greedy tokens, and the prompt's logprobs from position ``start`` (a later start lets the
    radix cache serve the positions before it)."""
    return engine.generate(input_ids=ids, return_logprob=True, logprob_start_len=start,
                           sampling_params={"max_new_tokens": NEW, "temperature": 0, "ignore_eos": True})


def _check(out: dict, folder: str, ids: list[int], greedy: list[int], what: str) -> None:
    ours = torch.tensor([lp for lp, _, _ in out["meta_info"]["input_token_logprobs"] if lp is not None])
    ref = _hf_logprobs(folder, ids)[-len(ours):]
    assert len(ours) == len(ref) > 0, what
    assert (ours - ref).abs().max().item() < 1e-4, (what, (ours - ref).abs().max().item())
    assert out["output_ids"] == greedy, what


@pytest.mark.parametrize("chunk", [-1, 8], ids=["whole", "chunked"])
def test_long_prompt_matches_transformers_around_the_cache(rule, chunk):
    from radixlang import Engine
    name, folder, long_prompt, short_prompt = rule
    long_greedy, short_greedy = _hf_greedy(folder, long_prompt), _hf_greedy(folder, short_prompt)
    with Engine(model_path=folder, max_total_tokens=512, chunked_prefill_size=chunk) as engine:
        # the short prompt first: its KV (per-position rows) is cached where the long prompt would look
        _check(_run(engine, short_prompt), folder, short_prompt, short_greedy, f"{name} short")
        tail = len(long_prompt) - 3
        first = _run(engine, long_prompt, tail)  # the short prompt's KV is not reused
        assert first["meta_info"]["cached_tokens"] == 0, name
        _check(first, folder, long_prompt, long_greedy, f"{name} long after short")
        _check(_run(engine, long_prompt), folder, long_prompt, long_greedy, f"{name} long, every position")
        again = _run(engine, long_prompt, tail)  # its own KV, from its namespace
        assert again["meta_info"]["cached_tokens"] >= tail - 1, name
        _check(again, folder, long_prompt, long_greedy, f"{name} long cached")
        short_again = _run(engine, short_prompt, len(short_prompt) - 3)  # the shared tree serves it still
        assert short_again["meta_info"]["cached_tokens"] >= len(short_prompt) - 4, name
        _check(short_again, folder, short_prompt, short_greedy, f"{name} short cached")
        engine.flush_cache()
        both = engine.generate(input_ids=[long_prompt, short_prompt],
                               sampling_params={"max_new_tokens": NEW, "temperature": 0, "ignore_eos": True})
        assert [o["output_ids"] for o in both] == [long_greedy, short_greedy], name


@pytest.mark.e2e
def test_tensor_parallel_ranks_rotate_the_prompt_alike(rule):
    """Every rank takes the prompt lengths with the step: tp=2 gives transformers' numbers too."""
    from radixlang import Engine
    name, folder, long_prompt, _ = rule
    with Engine(model_path=folder, max_total_tokens=256, tp_size=2) as engine:
        _check(_run(engine, long_prompt), folder, long_prompt, _hf_greedy(folder, long_prompt), f"{name} tp=2")
