"""Linears packed into oneDNN's blocked layout (the CPU default): same numbers as nn.Linear, really in use."""
from __future__ import annotations

import pytest
import torch
from torch import nn
from tiny_model import tied_toy_model

from radixlang.kernels import cpu as cpu_ops
from radixlang.runtime.models.packed import PackedLinear, pack_model_, packing_available

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
    """An AVX2-only CPU cannot pack bfloat16: its linears stay plain nn.Linear and still run."""
    from radixlang.runtime.models import packed as packed_mod
    monkeypatch.setattr(packed_mod, "_PACKABLE", (torch.float32,))
    m = nn.Sequential(nn.Linear(16, 8).to(torch.bfloat16))
    assert pack_model_(m) == 0 and type(m[0]) is nn.Linear
    with pytest.raises(ValueError, match="cannot pack a torch.bfloat16"):
        PackedLinear(torch.zeros(4, 4, dtype=torch.bfloat16), None)
    m32 = nn.Sequential(nn.Linear(16, 8))
    assert pack_model_(m32) == 1 and isinstance(m32[0], PackedLinear)


def test_pack_model_replaces_linears_and_ties_logits():
    torch.manual_seed(0)
    m = tied_toy_model()
    x = torch.randn(4, 16)
    with torch.inference_mode():
        ref_hidden = m.block(x)
        ref_logits = nn.functional.linear(ref_hidden, m.embed_tokens.weight)
    assert pack_model_(m, keep_plain=True) == 3
    assert isinstance(m.block[0], PackedLinear) and isinstance(m.block[2], PackedLinear)
    assert isinstance(m.lm_head, PackedLinear) and m.lm_head.out_features == 50
    assert not any(type(x) is nn.Linear for x in m.modules())
    assert isinstance(m.embed_tokens, nn.Embedding)  # the lookup keeps the plain table
    if cpu_ops.available():  # small batches of logits read the embedding table itself
        assert m.lm_head.plain.data_ptr() == m.embed_tokens.weight.data_ptr()
    with torch.inference_mode():
        hidden = m.block(x)
        torch.testing.assert_close(hidden, ref_hidden, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(m.lm_head(hidden), ref_logits, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(m.lm_head(hidden[:1]), ref_logits[:1], rtol=1e-5, atol=1e-5)


@pytest.mark.e2e
def test_engine_packed_matches_plain(tiny_model_dir, tiny_engine):
    from radixlang import Engine
    runner = tiny_engine.scheduler.runner
    assert isinstance(runner.model.layers[0].self_attn.qkv_proj, PackedLinear)  # the default on the CPU
    prompts = [list(range(5, 45)), list(range(5, 30)) + [3, 4]]
    params = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
    packed = tiny_engine.generate(input_ids=prompts, sampling_params=params, return_logprob=True, logprob_start_len=0)
    with Engine(model_path=tiny_model_dir, load_format="dummy", max_total_tokens=2048,
                disable_weight_packing=True) as plain:
        assert type(plain.scheduler.runner.model.layers[0].self_attn.qkv_proj) is nn.Linear
        ref = plain.generate(input_ids=prompts, sampling_params=params, return_logprob=True, logprob_start_len=0)
    for a, b in zip(packed, ref):
        assert a["output_ids"] == b["output_ids"]
        la = torch.tensor([lp for lp, _, _ in a["meta_info"]["input_token_logprobs"][1:]])
        lb = torch.tensor([lp for lp, _, _ in b["meta_info"]["input_token_logprobs"][1:]])
        torch.testing.assert_close(la, lb, rtol=1e-4, atol=1e-4)
