"""tp=2 (two processes over gloo) against tp=1 on families beyond Llama, from checkpoints saved by
transformers (tests/tiny_model.py: 6 heads over 2 kv heads, so each rank holds 3 heads and 1 kv head):
Qwen3 (q/k norms), Gemma2 (soft-capping, (1 + w) norms, sliding and full layers), Gemma3 (q/k norms,
local rope base on sliding layers), Mistral and Qwen2 with sliding windows, Phi3 (fused checkpoint
tensors), the MoE families Mixtral, Qwen2-MoE (shared expert, a dense layer), Qwen3-MoE and GPT-OSS
(sinks), and DeepSeek-V2 / V3 (tiny_model.MLA_FAMILIES: multi-head latent attention split by heads, the
latent replicated; a dense first layer, shared and routed experts split by intermediate features). Same
greedy tokens, logprobs within fp32 tolerance, a cached prefix reused the same way; tp=1 itself is checked
against transformers in tests/runtime/models/test_model_families.py and tests/runtime/models/test_deepseek.py."""
from __future__ import annotations

import pytest

from radixlang import Engine
from tiny_model import FAMILIES, MLA_FAMILIES, save_tiny_hf_model
from tp_runs import SHARED, all_logprobs, run_shared_prefix

pytestmark = pytest.mark.e2e

# every family of tiny_model.FAMILIES but Llama (tests/e2e/test_tensor_parallel.py) and Qwen3's sliding
# variant (Qwen2's covers the window)
TP_FAMILIES = ("qwen3", "mistral_sliding", "qwen2_sliding", "gemma2", "gemma3", "phi3", "mixtral", "qwen2_moe",
               "qwen3_moe", "gpt_oss", "deepseek_v2", "deepseek_v3")


@pytest.mark.parametrize("name", TP_FAMILIES)
def test_tp2_matches_tp1(name, tmp_path):
    arch, overrides = {**FAMILIES, **MLA_FAMILIES}[name]
    folder = save_tiny_hf_model(str(tmp_path / name), arch, seed=5, **overrides)
    kw = dict(model_path=folder, max_total_tokens=1024, chunked_prefill_size=16)
    with Engine(**kw) as single:
        want = run_shared_prefix(single)
    with Engine(**kw, tp_size=2) as engine:
        model = engine.scheduler.runner.model
        assert model.num_heads == 3  # this rank's half of the 6 heads
        experts = [m for m in model.modules() if type(m).__name__ in ("Experts", "GptOssExperts")]
        assert bool(experts) == ("moe" in name or name in ("mixtral", "gpt_oss") or "deepseek" in name)
        for m in experts:  # half of each expert's intermediate features
            inter = m.inter if hasattr(m, "inter") else m.down_proj.shape[1]
            assert inter in (16, 96)
        if "deepseek" in name:  # MLA: this rank's 3 heads of q_b / kv_b, 3 x 24 o_proj inputs; the latent whole
            attn = model.layers[0].self_attn
            assert attn.kv_b_proj.weight.shape == (3 * (16 + 24), 32) and attn.o_proj.in_features == 3 * 24
            assert attn.kv_a_proj_with_mqa.out_features == 32 + 8
            # the shared expert (this rank's 16 features) folded into the experts' kernel as a 7th expert;
            # the first layer dense
            moe = model.layers[1].mlp
            assert moe.shared_experts is None and moe.experts.num_shared == 1 and moe.experts.packed.inter == 16
            assert moe.experts.packed.num_experts == 7 and model.layers[0].mlp.inter == 96
        got = run_shared_prefix(engine)
    assert got[2]["meta_info"]["cached_tokens"] >= len(SHARED)
    for g, w in zip(got, want, strict=True):
        assert g["output_ids"] == w["output_ids"], name
        assert g["meta_info"]["cached_tokens"] == w["meta_info"]["cached_tokens"]
        assert all_logprobs(g) == pytest.approx(all_logprobs(w), rel=1e-4, abs=1e-4), name
