"""Linears packed into oneDNN's blocked layout (the CPU default): same numbers as nn.Linear, really in use."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from radixlang.kernels import cpu as cpu_ops
from radixlang.runtime.models.layers.linear import LinearMethod, process_weights_after_loading
from radixlang.runtime.models.layers.weight_methods import PackedMethod, WeightMethods
from radixlang.runtime.models.packed import PackedLinear, packing_available
from weight_toys import tied_toy

pytestmark = pytest.mark.skipif(not packing_available(), reason="this PyTorch build has no oneDNN weight packing")


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.bfloat16, marks=pytest.mark.skipif(
    not packing_available(torch.bfloat16), reason="oneDNN cannot pack bfloat16 on this CPU (no AVX-512 BW/VL/DQ)"))])
def test_packed_linear_matches_linear(bias, dtype):
    torch.manual_seed(0)
    lin = nn.Linear(96, 200, bias=bias).to(dtype)
    packed = PackedLinear.from_linear(lin)
    assert packed.packed.layout == torch._mkldnn  # the weight really is in the blocked layout
    for lead in ((1,), (3,), (70,), (600,), (2, 5)):  # decode rows, a batch, prefills (600: sliced), 3-D
        x = torch.randn(*lead, 96).to(dtype)
        with torch.inference_mode():
            ref, out = lin(x), packed(x)
        assert out.shape == ref.shape and out.dtype == dtype
        rel = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
        assert rel < (1e-6 if dtype == torch.float32 else 1e-2), rel


@pytest.mark.skipif(not cpu_ops.available(), reason="no CPU kernels here")
@pytest.mark.parametrize("bias", [False, True])
def test_small_rows_run_on_the_kept_row_major_weight(bias, monkeypatch):
    torch.manual_seed(1)
    lin = nn.Linear(96, 203, bias=bias)
    packed = PackedLinear.from_linear(lin, keep_plain=True)
    assert packed.plain.data_ptr() == lin.weight.data_ptr()  # the same storage, not a copy
    calls = []
    real = cpu_ops.linear
    monkeypatch.setattr(cpu_ops, "linear", lambda *a, **kw: calls.append(a[0].shape[0]) or real(*a, **kw))
    for lead in ((1,), (2,), (1, 2), (3,), (4,), (2, 3), (5,), (40,)):
        x = torch.randn(*lead, 96)
        with torch.inference_mode():
            torch.testing.assert_close(packed(x), lin(x), rtol=1e-5, atol=1e-5)
    assert calls == [1, 2, 2, 3, 4]  # at most SMALL_ROWS (4) rows on the C kernel; more on the packed matmul
    if packing_available(torch.bfloat16):
        assert PackedLinear.from_linear(nn.Linear(8, 8).to(torch.bfloat16), keep_plain=True).plain is None


def test_packed_linear_refuses_other_dtypes():
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        PackedLinear(torch.zeros(4, 4, dtype=torch.float16), None)


def test_bf16_packs_only_where_the_cpu_can(monkeypatch):
    """An AVX2-only CPU cannot pack bfloat16: its linears keep the plain float method and still run."""
    from radixlang.runtime.models import packed as packed_mod
    monkeypatch.setattr(packed_mod, "_PACKABLE", (torch.float32,))
    choose = dict(quantization=None, device="cpu", weight_packing=True, cpu_kernels=True)
    m = tied_toy(WeightMethods.choose(dtype=torch.bfloat16, **choose), torch.bfloat16)
    assert process_weights_after_loading(m) == {"plain": 2} and type(m.block[0].method) is LinearMethod
    assert m.lm_head is None and m.block(torch.randn(3, 16, dtype=torch.bfloat16)).dtype == torch.bfloat16
    with pytest.raises(ValueError, match="cannot pack a torch.bfloat16"):
        PackedLinear(torch.zeros(4, 4, dtype=torch.bfloat16), None)
    m32 = tied_toy(WeightMethods.choose(dtype=torch.float32, **choose))
    assert process_weights_after_loading(m32) == {"packed": 3} and isinstance(m32.block[0].kernel, PackedLinear)


def test_packed_method_keeps_its_layers_and_ties_logits():
    torch.manual_seed(0)
    m = tied_toy(WeightMethods("packed", keep_plain=True, tied_head=True))
    layers = [m.block[0], m.block[2], m.lm_head]
    x = torch.randn(4, 16)
    with torch.inference_mode():
        w0, b0, w2, b2 = (t.detach().clone() for t in (m.block[0].weight, m.block[0].bias, m.block[2].weight,
                                                       m.block[2].bias))
        ref_hidden = nn.functional.linear(torch.relu(nn.functional.linear(x, w0, b0)), w2, b2)
        ref_logits = nn.functional.linear(ref_hidden, m.embed_tokens.weight)
    assert m.lm_head.weight is m.embed_tokens.weight  # the head loads nothing of its own
    assert process_weights_after_loading(m) == {"packed": 3}
    assert [m.block[0], m.block[2], m.lm_head] == layers  # no module replaced: each holds its kernel
    assert all(isinstance(x.method, PackedMethod) and isinstance(x.kernel, PackedLinear) for x in layers)
    assert m.lm_head.kernel.out_features == 50
    assert all(x.weight is None for x in layers)  # the float parameters were released into the kernels
    assert isinstance(m.embed_tokens, nn.Embedding) and m.embed_tokens.weight is not None  # the lookup's table
    if cpu_ops.available():  # small batches of logits read the embedding table itself
        assert m.lm_head.kernel.plain.data_ptr() == m.embed_tokens.weight.data_ptr()
    with torch.inference_mode():
        hidden = m.block(x)
        torch.testing.assert_close(hidden, ref_hidden, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(m.lm_head(hidden), ref_logits, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(m.lm_head(hidden[:1]), ref_logits[:1], rtol=1e-5, atol=1e-5)


@pytest.mark.e2e
def test_engine_packed_matches_plain(tiny_model_dir, tiny_engine):
    from radixlang import Engine
    runner = tiny_engine.scheduler.runner
    assert isinstance(runner.model.layers[0].self_attn.qkv_proj.kernel, PackedLinear)  # the default on the CPU
    prompts = [list(range(5, 45)), list(range(5, 30)) + [3, 4]]
    params = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
    packed = tiny_engine.generate(input_ids=prompts, sampling_params=params, return_logprob=True, logprob_start_len=0)
    with Engine(model_path=tiny_model_dir, load_format="dummy", max_total_tokens=2048,
                disable_weight_packing=True) as plain:
        qkv = plain.scheduler.runner.model.layers[0].self_attn.qkv_proj
        assert type(qkv.method) is LinearMethod and qkv.kernel is None
        ref = plain.generate(input_ids=prompts, sampling_params=params, return_logprob=True, logprob_start_len=0)
    for a, b in zip(packed, ref):
        assert a["output_ids"] == b["output_ids"]
        la = torch.tensor([lp for lp, _, _ in a["meta_info"]["input_token_logprobs"][1:]])
        lb = torch.tensor([lp for lp, _, _ in b["meta_info"]["input_token_logprobs"][1:]])
        torch.testing.assert_close(la, lb, rtol=1e-4, atol=1e-4)


def test_small_row_picks_keep_the_c_kernel_unless_another_is_clearly_faster():
    from radixlang.runtime.models.packed import CALIBRATE_MARGIN, pick_small_row_kernels
    close = CALIBRATE_MARGIN + 0.05  # faster than the C kernel, but within the margin
    picks = pick_small_row_kernels({1: {"c": 1.0, "aten": 0.5, "packed": 0.8},
                                    2: {"c": 1.0, "aten": close, "packed": 2.0},
                                    3: {"c": 1.0, "aten": 3.0, "packed": 0.6},
                                    4: {"c": 0.5, "aten": 1.0, "packed": 1.0}})
    assert picks[1:] == ["aten", "c", "packed", "c"]


@pytest.mark.skipif(not cpu_ops.available(), reason="no CPU kernels here")
@pytest.mark.parametrize("kernel", ["c", "aten", "packed"])
def test_each_small_row_kernel_matches_linear_and_is_the_one_that_runs(kernel, monkeypatch):
    torch.manual_seed(2)
    lin = nn.Linear(96, 130, bias=True)
    packed = PackedLinear.from_linear(lin, keep_plain=True)
    packed.small_kernels = [kernel] * len(packed.small_kernels)
    c_rows, packed_rows = [], []
    real_c, real_matmul = cpu_ops.linear, packed._matmul
    monkeypatch.setattr(cpu_ops, "linear", lambda *a, **kw: c_rows.append(a[0].shape[0]) or real_c(*a, **kw))
    monkeypatch.setattr(packed, "_matmul", lambda x: packed_rows.append(x.shape[0]) or real_matmul(x))
    for rows in (1, 2, 3, 4, 7):
        x = torch.randn(rows, 96)
        with torch.inference_mode():
            torch.testing.assert_close(packed(x), lin(x), rtol=1e-5, atol=1e-5)
    assert c_rows == ([1, 2, 3, 4] if kernel == "c" else [])
    assert packed_rows == ([1, 2, 3, 4, 7] if kernel == "packed" else [7])  # 7 > SMALL_ROWS: always packed


@pytest.mark.skipif(not cpu_ops.available(), reason="no CPU kernels here")
def test_calibration_sets_every_kept_layer_and_skips_small_models():
    from radixlang.runtime.models.packed import SMALL_ROW_KERNELS, calibrate_small_rows_
    torch.manual_seed(0)
    m = tied_toy(WeightMethods("packed", keep_plain=True, tied_head=True))
    process_weights_after_loading(m)  # a toy model: under CALIBRATE_MIN_BYTES, so no calibration
    layers = [x for x in m.modules() if isinstance(x, PackedLinear)]
    assert len(layers) == 3 and all(x.small_kernels[1:] == ["c"] * 4 for x in layers)
    assert calibrate_small_rows_(layers) is None
    picks = calibrate_small_rows_(layers, min_bytes=0, repeats=1)
    assert picks is not None and set(picks) <= set(SMALL_ROW_KERNELS)
    assert all(x.small_kernels is picks for x in layers)
    x = torch.randn(2, 16)
    with torch.inference_mode():  # whatever was picked computes the same layer
        first, second = m.block[0].kernel, m.block[2].kernel
        torch.testing.assert_close(m.block(x), nn.functional.linear(
            torch.relu(nn.functional.linear(x, first.plain, first.bias)), second.plain, second.bias),
            rtol=1e-5, atol=1e-5)
