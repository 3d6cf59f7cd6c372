"""--quantization int8: weight-only int8 linears, close to fp32 and actually in use."""
from __future__ import annotations

import pytest
import torch
from torch import nn
from weight_toys import tied_toy

from radixlang.runtime.server_args import ServerArgs
from radixlang.runtime.models.layers.linear import LinearMethod, process_weights_after_loading
from radixlang.runtime.models.layers.weight_methods import Int4Method, Int8Method, WeightMethods
from radixlang.runtime.models.quant import Int8WeightOnlyLinear


@pytest.mark.parametrize("bias", [False, True])
def test_int8_linear_matches_fp32(bias):
    torch.manual_seed(0)
    lin = nn.Linear(96, 200, bias=bias)
    q = Int8WeightOnlyLinear(lin.weight, lin.bias)
    assert q.qweight.dtype == torch.int8 and q.qweight.shape == (200, 96)
    # within one quantization step of the original, per output channel: half a step of rounding,
    # plus the bfloat16 scale's rounding (2^-9 relative) over up to 127 steps
    step = lin.weight.abs().amax(dim=1, keepdim=True) / 127
    err = (q.dequantized_weight() - lin.weight).abs()
    assert (err <= step).all()
    assert err.mean() < 0.35 * step.mean()
    for lead in ((3, 5), (70,)):  # few rows: the int8 kernel; many rows: the dequantized bfloat16 matmul
        x = torch.randn(*lead, 96)
        with torch.inference_mode():
            ref, out = lin(x), q(x)
        assert out.shape == ref.shape and out.dtype == torch.float32
        rel = (out - ref).norm() / ref.norm()
        assert 0 < rel < 0.02, rel  # lossy (bfloat16 activations, int8 weights), but close


def test_int8_method_quantizes_every_linear_and_ties_logits():
    m = tied_toy(WeightMethods.choose(quantization="int8", device="cpu", dtype=torch.float32, weight_packing=True,
                                      cpu_kernels=True))
    assert process_weights_after_loading(m) == {"int8": 3}
    assert isinstance(m.block[0].kernel, Int8WeightOnlyLinear) and isinstance(m.block[2].kernel, Int8WeightOnlyLinear)
    assert isinstance(m.lm_head.kernel, Int8WeightOnlyLinear) and m.lm_head.kernel.out_features == 50
    assert not any(p.dtype == torch.float32 for layer in (m.block[0], m.block[2], m.lm_head)
                   for p in layer.parameters(recurse=False))  # the float weights were released


def test_bad_quantization_is_refused():
    with pytest.raises(ValueError, match="quantization must be one of"):
        ServerArgs(quantization="int3")
    with pytest.raises(ValueError, match="CPU only"):
        WeightMethods.choose(quantization="int8", device="cuda", dtype=torch.float32, weight_packing=True,
                             cpu_kernels=True)


@pytest.mark.e2e
def test_engine_int8_scores_like_fp32(tiny_model_dir, tiny_engine):
    from radixlang import Engine
    prompt = list(range(5, 45))
    params = {"max_new_tokens": 0}
    ref = tiny_engine.generate(input_ids=prompt, sampling_params=params, return_logprob=True, logprob_start_len=0)
    with Engine(model_path=tiny_model_dir, load_format="dummy", max_total_tokens=2048, quantization="int8") as q8:
        runner = q8.scheduler.runner
        assert isinstance(runner.model.layers[0].mlp.gate_up_proj.kernel, Int8WeightOnlyLinear)
        out = q8.generate(input_ids=prompt, sampling_params=params, return_logprob=True, logprob_start_len=0)
        gen = q8.generate(input_ids=prompt, sampling_params={"max_new_tokens": 8, "temperature": 0})
        assert gen["meta_info"]["completion_tokens"] == 8
        q8.check_memory_leak()
    a = torch.tensor([lp for lp, _, _ in ref["meta_info"]["input_token_logprobs"][1:]])
    b = torch.tensor([lp for lp, _, _ in out["meta_info"]["input_token_logprobs"][1:]])
    assert len(a) == len(prompt) - 1
    diff = (a - b).abs()
    assert 0 < diff.max() < 0.1 * a.abs().mean(), (diff.max(), a.abs().mean())


def test_int4_linear_is_close_and_runs_on_the_q4_kernel():
    from radixlang.kernels.cpu import quant as qk
    from radixlang.runtime.models.gguf_quant import QuantLinear
    from radixlang.runtime.models.quant import int4_linear
    if not qk.available():
        pytest.skip("no C compiler for the quantized kernels")
    torch.manual_seed(0)
    lin = nn.Linear(96, 200, bias=True)
    q = int4_linear(lin.weight, lin.bias)
    assert isinstance(q, QuantLinear) and q.weight_q.layout == "q4" and q.weight_q.codes.shape == (200, 48)
    # each weight within half a step of its group's 16 levels (plus float rounding)
    g = lin.weight.detach().view(200, 3, 32)
    step = (g.amax(-1) - g.amin(-1)) / 15
    err = (q.dequantized_weight().view(200, 3, 32) - g).abs()
    assert (err <= step[..., None] / 2 + 1e-6).all()
    x = torch.randn(3, 96)
    with torch.inference_mode():
        ref, out = lin(x), q(x)
    rel = (out - ref).norm() / ref.norm()
    assert 0 < rel < 0.1, rel
    m = tied_toy(WeightMethods("int4", tied_head=True))  # 16 input features do not fill a group of 32
    process_weights_after_loading(m)
    assert isinstance(m.block[2].method, Int4Method) and isinstance(m.block[2].kernel, QuantLinear)
    assert type(m.block[0].method) is LinearMethod and m.lm_head is None


def test_int8_leaves_widths_its_kernel_cannot_take_in_float():
    """torch's int8 matmul crashed at 2+ rows on an input width that is not a multiple of 16 (MLA's small
    q_lora_rank in the tiny DeepSeek checkpoints): such a linear stays float."""
    from radixlang.runtime.models.layers.linear import Linear
    methods = WeightMethods("int8")
    model = nn.Sequential(Linear(24, 144, bias=True, method=methods.linear(24)),
                          Linear(144, 32, bias=True, method=methods.linear(144)))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p))
    process_weights_after_loading(model)
    assert type(model[0].method) is LinearMethod and isinstance(model[1].method, Int8Method)
    with torch.inference_mode():
        assert model(torch.randn(3, 24)).shape == (3, 32)
