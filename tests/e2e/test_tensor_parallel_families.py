"""tp=2 (two processes over gloo) against tp=1 on families beyond Llama, from checkpoints saved by
transformers (tests/tiny_model.py: 6 heads over 2 kv heads, so each rank holds 3 heads and 1 kv head):
Qwen3 (q/k norms), Gemma2 (soft-capping, (1 + w) norms, sliding and full layers), Gemma3 (q/k norms,
local rope base on sliding layers), Mistral and Qwen2 with sliding windows, Phi3 (fused checkpoint
tensors), and the MoE families Mixtral, Qwen2-MoE (shared expert, a dense layer), Qwen3-MoE and GPT-OSS
(sinks). Same greedy tokens, logprobs within fp32 tolerance, a cached prefix reused the same way; tp=1
itself is checked against transformers in tests/runtime/test_model_families.py."""
from __future__ import annotations

import pytest

from radixlang import Engine
from tiny_model import save_tiny_hf_model

pytestmark = pytest.mark.e2e

WINDOW = 5
LAYERS = ["sliding_attention", "full_attention", "sliding_attention"]
FAMILIES = {
    "qwen3": ("Qwen3ForCausalLM", {}),
    "mistral_sliding": ("MistralForCausalLM", dict(sliding_window=WINDOW)),
    "qwen2_sliding": ("Qwen2ForCausalLM", dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1)),
    "gemma2": ("Gemma2ForCausalLM", dict(sliding_window=WINDOW, attn_logit_softcapping=0.5,
                                         final_logit_softcapping=3.0, query_pre_attn_scalar=24, layer_types=LAYERS)),
    "gemma3": ("Gemma3ForCausalLM", dict(sliding_window=WINDOW, query_pre_attn_scalar=24, layer_types=LAYERS)),
    # the checkpoint's fused qkv and gate_up cut per part before the rank slice; longrope, partial rotary
    "phi3": ("Phi3ForCausalLM", dict(sliding_window=WINDOW, max_position_embeddings=64,
                                     original_max_position_embeddings=32,
                                     rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                                                      "partial_rotary_factor": 0.75,
                                                      "original_max_position_embeddings": 32,
                                                      "short_factor": [1.0 + 0.3 * i for i in range(6)],
                                                      "long_factor": [2.0 + i for i in range(6)]})),
    # MoE: each rank holds every expert over half its intermediate features; a dense layer and a shared
    # expert (Qwen2-MoE) split like a dense MLP
    "mixtral": ("MixtralForCausalLM", dict(num_local_experts=5, num_experts_per_tok=2, sliding_window=WINDOW)),
    "qwen2_moe": ("Qwen2MoeForCausalLM", dict(num_experts=6, num_experts_per_tok=2, moe_intermediate_size=32,
                                              shared_expert_intermediate_size=48, decoder_sparse_step=1,
                                              mlp_only_layers=[1], norm_topk_prob=False)),
    # sinks per head, biased attention, interleaved gate/up experts with biases, yarn
    "gpt_oss": ("GptOssForCausalLM", dict(num_local_experts=5, num_experts_per_tok=2, sliding_window=WINDOW,
                                          layer_types=LAYERS,
                                          rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0,
                                                           "original_max_position_embeddings": 512,
                                                           "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False})),
    "qwen3_moe": ("Qwen3MoeForCausalLM", dict(num_experts=6, num_experts_per_tok=3, moe_intermediate_size=32,
                                              norm_topk_prob=True, decoder_sparse_step=1)),
}
SHARED = [1, 400, 2000, 7, 31000, 12, 99, 5, 48000, 3, 17, 250, 4096, 88]
GREEDY = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}


def _run(engine: Engine) -> list[dict]:
    kw = dict(sampling_params=GREEDY, return_logprob=True, logprob_start_len=0, top_logprobs_num=2)
    first = engine.generate(input_ids=[SHARED + [5, 6], list(range(300, 321))], **kw)
    # its prefix comes from the radix cache (no prompt logprobs asked, so the cached prefix is not recomputed)
    second = engine.generate(input_ids=SHARED + [9, 8, 7], sampling_params=GREEDY, return_logprob=True,
                             top_logprobs_num=2)
    engine.check_memory_leak()
    return first + [second]


def _logprobs(out: dict) -> list[float]:
    meta = out["meta_info"]
    vals = [lp for lp, _, _ in meta["input_token_logprobs"] + meta["output_token_logprobs"] if lp is not None]
    return vals + [lp for row in meta["output_top_logprobs"] for lp, _, _ in row]


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_tp2_matches_tp1(name, tmp_path):
    arch, overrides = FAMILIES[name]
    folder = save_tiny_hf_model(str(tmp_path / name), arch, seed=5, **overrides)
    kw = dict(model_path=folder, max_total_tokens=1024, chunked_prefill_size=16)
    with Engine(**kw) as single:
        want = _run(single)
    with Engine(**kw, tp_size=2) as engine:
        model = engine.scheduler.runner.model
        assert model.num_heads == 3  # this rank's half of the 6 heads
        experts = [m for m in model.modules() if type(m).__name__ in ("Experts", "GptOssExperts")]
        assert bool(experts) == ("moe" in name or name in ("mixtral", "gpt_oss"))
        for m in experts:  # half of each expert's intermediate features
            inter = m.inter if hasattr(m, "inter") else m.down_proj.shape[1]
            assert inter in (16, 96)
        got = _run(engine)
    assert got[2]["meta_info"]["cached_tokens"] >= len(SHARED)
    for g, w in zip(got, want, strict=True):
        assert g["output_ids"] == w["output_ids"], name
        assert g["meta_info"]["cached_tokens"] == w["meta_info"]["cached_tokens"]
        assert _logprobs(g) == pytest.approx(_logprobs(w), rel=1e-4, abs=1e-4), name
