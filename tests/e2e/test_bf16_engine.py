"""bfloat16 on the CPU (``dtype="bfloat16"``): weights and activations in bf16, KV and attention in float32."""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.e2e


def test_engine_bf16_scores_like_fp32(tiny_model_dir, tiny_engine):
    from radixlang import Engine
    from radixlang.runtime.models.packed import PackedLinear, packing_available
    prompt = list(range(5, 45))
    ref = tiny_engine.generate(input_ids=prompt, sampling_params={"max_new_tokens": 0}, return_logprob=True,
                               logprob_start_len=0)
    with Engine(model_path=tiny_model_dir, load_format="dummy", max_total_tokens=2048, dtype="bfloat16") as bf:
        runner = bf.scheduler.runner
        assert runner.model.embed_tokens.weight.dtype == torch.bfloat16
        layer = runner.model.layers[0].mlp.gate_up_proj
        # packed (oneDNN layout) in bf16 where this CPU can pack bf16 (AVX-512 BW/VL/DQ), else plain
        assert isinstance(layer.kernel, PackedLinear) == packing_available(torch.bfloat16)
        assert (layer.kernel.dtype if isinstance(layer.kernel, PackedLinear) else layer.weight.dtype) == torch.bfloat16
        assert runner.kv_pool.get_key_buffer(0).dtype == torch.float32  # CPU attention runs in float32
        out = bf.generate(input_ids=prompt, sampling_params={"max_new_tokens": 0}, return_logprob=True,
                          logprob_start_len=0)
        # a shared prefix, decode and a mixed batch all run in bf16 and keep the pool whole
        batch = bf.generate(input_ids=[prompt + [7, 8], prompt + [9]],
                            sampling_params={"max_new_tokens": 6, "temperature": 0, "ignore_eos": True})
        assert [o["meta_info"]["completion_tokens"] for o in batch] == [6, 6]
        assert batch[1]["meta_info"]["cached_tokens"] > 0
        bf.flush_cache()
        bf.check_memory_leak()
    a = torch.tensor([lp for lp, _, _ in ref["meta_info"]["input_token_logprobs"][1:]])
    b = torch.tensor([lp for lp, _, _ in out["meta_info"]["input_token_logprobs"][1:]])
    assert len(b) == len(prompt) - 1 and torch.isfinite(b).all()
    diff = (a - b).abs()
    assert 0 < diff.max() < 0.1 * a.abs().mean(), (diff.max(), a.abs().mean())
