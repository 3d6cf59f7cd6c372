"""Greedy decoding with the embedded SmolLM2 matches transformers' generate token for token."""
from __future__ import annotations

import pytest
import torch

from radixlang import Engine
from tiny_model import smollm_hf_model

pytestmark = pytest.mark.e2e

PROMPTS = ["The capital of France is", "def fibonacci(n):\n", "Once upon a time, in a small village,"]


def test_greedy_matches_transformers():
    hf = smollm_hf_model()
    with Engine(max_total_tokens=4096) as engine:
        outs = engine.generate(PROMPTS, {"max_new_tokens": 32, "temperature": 0})
        engine.check_memory_leak()
        tok = engine.tokenizer
    for prompt, out in zip(PROMPTS, outs):
        ids = torch.tensor([tok.encode(prompt, add_special_tokens=False)])
        with torch.no_grad():
            ref = hf.generate(ids, max_new_tokens=32, do_sample=False)[0, ids.shape[1]:]
        ref = ref.tolist()
        if tok.eos_token_id in ref:  # transformers pads after EOS
            ref = ref[:ref.index(tok.eos_token_id) + 1]
        assert out["output_ids"] == ref, prompt
    assert sum(len(o["output_ids"]) for o in outs) >= 3 * 20  # real decoding, not early stops
