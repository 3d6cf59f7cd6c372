"""Dynamic NTK rope against transformers' own: a prompt within max_position_embeddings, then greedy decoding
well past it (transformers re-derives the base from each decode step's position, as the per-position table
here does), on a Llama checkpoint saved by transformers with max_position_embeddings 16 and factor 2."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from radixlang.runtime.models.layers.rotary import rope_context_length
from radixlang.runtime.models.loader.model_loader import read_config
from tiny_model import save_tiny_hf_model

MAX_POS, FACTOR = 16, 2.0
PROMPT = [1, 400, 2000, 7, 31000, 12, 99, 5, 48000, 3, 17, 250]
NEW = 18  # positions 12 .. 29: the last 14 past max_position_embeddings


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return save_tiny_hf_model(str(tmp_path_factory.mktemp("dynamic")), "LlamaForCausalLM", seed=3,
                              max_position_embeddings=MAX_POS,
                              rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": FACTOR})


def test_context_reaches_factor_times_max_positions(folder):
    assert rope_context_length(read_config(folder)) == int(MAX_POS * FACTOR)


@pytest.mark.e2e
def test_greedy_decode_past_max_positions_matches_transformers(folder):
    from radixlang import Engine
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        out = hf.generate(torch.tensor([PROMPT]), attention_mask=torch.ones(1, len(PROMPT), dtype=torch.long),
                          max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False, pad_token_id=0,
                          output_logits=True, return_dict_in_generate=True)
    want = out.sequences[0, len(PROMPT):].tolist()
    want_lp = [step[0].float().log_softmax(-1)[tok].item() for step, tok in zip(out.logits, want)]
    with Engine(model_path=folder, max_total_tokens=256) as engine:
        assert engine.scheduler.runner.context_len == int(MAX_POS * FACTOR)
        model = engine.scheduler.runner.model  # its table: plain rope up to 16, a larger base after
        plain = torch.cos(torch.outer(torch.arange(2 * MAX_POS, dtype=torch.float64), 1.0 / 10000.0 ** (
            torch.arange(0, model.rotary_dim, 2, dtype=torch.float64) / model.rotary_dim))).repeat(1, 2)
        assert torch.allclose(model.cos_cache[:MAX_POS].double(), plain[:MAX_POS], atol=1e-6)
        assert not torch.allclose(model.cos_cache[MAX_POS + 1:].double(), plain[MAX_POS + 1:], atol=1e-3)
        got = engine.generate(input_ids=PROMPT, return_logprob=True,
                              sampling_params={"max_new_tokens": NEW, "temperature": 0, "ignore_eos": True})
        too_long = engine.generate(input_ids=list(range(3, 3 + int(MAX_POS * FACTOR))),  # past factor x 16
                                   sampling_params={"max_new_tokens": 1})
        assert too_long["meta_info"]["finish_reason"]["status_code"] == 400
        assert "the context length is 32" in too_long["meta_info"]["finish_reason"]["message"]
    assert got["output_ids"] == want
    lp = [v for v, _, _ in got["meta_info"]["output_token_logprobs"]]
    assert max(abs(a - b) for a, b in zip(lp, want_lp)) < 1e-4
