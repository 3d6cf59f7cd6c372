"""The compiled MoE experts (csrc/moe.c, on the panels moe_pack makes) against a token-by-token float64
reference, and the shared expert folded into them (layers/moe.py) against the dense MLP it replaces."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from radixlang.kernels import cpu

pytestmark = pytest.mark.skipif(not cpu.available(), reason=f"CPU kernels unavailable: {cpu.unavailable_reason()}")


def _reference(x, weights, ids, w13, w2):
    """Each token through each of its experts, one at a time (float64)."""
    inter = w2.shape[2]
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            gate, up = (w13[e].double() @ x[t].double()).split(inter)
            out[t] += float(weights[t, j]) * (w2[e].double() @ (F.silu(gate) * up))
    return out


def _experts(x, weights, ids, w13, w2):
    return cpu.moe_experts(x, weights, ids, cpu.moe_pack(w13, w2))


def _case(n, k, experts, hidden, inter, *, seed=0, skew=0.0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, hidden, generator=g)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=g) / hidden ** 0.5
    w2 = torch.randn(experts, hidden, inter, generator=g) / inter ** 0.5
    logits = torch.randn(n, experts, generator=g) + skew * torch.arange(experts)  # skew: a few experts take most
    weights, ids = logits.softmax(-1).topk(k, dim=-1)
    return x, weights.contiguous(), ids.contiguous(), w13, w2


@pytest.mark.parametrize("n,k,experts,hidden,inter,skew", [
    (1, 2, 8, 96, 64, 0.0),  # one token: most experts idle
    (5, 2, 8, 100, 36, 0.0),  # widths no multiple of 16 or 32: zero-padded panels
    (32, 4, 16, 128, 96, 0.5),  # uneven: some experts 9+ rows (AVX2: several blocks), some none
    (7, 3, 4, 64, 1540, 0.0),  # intermediate wider than several work items
    (64, 8, 64, 32, 20, 1.0),  # many experts, hidden narrower than one vector
    (9, 2, 4, 37, 29, 0.0),  # no multiple of 4 anywhere: padded panels, a part-filled last vector
])
def test_moe_experts_match_token_by_token(n, k, experts, hidden, inter, skew):
    x, weights, ids, w13, w2 = _case(n, k, experts, hidden, inter, skew=skew)
    counts = torch.bincount(ids.view(-1), minlength=experts)
    if n >= 32:
        assert counts.max() > 4 and counts.min() == 0  # the shapes the test means to cover
    out = _experts(x, weights, ids, w13, w2)
    assert out.dtype == torch.float32 and out.shape == x.shape
    ref = _reference(x, weights, ids, w13, w2)
    assert (out.double() - ref).abs().max().item() < 1e-5 * max(1.0, ref.abs().max().item())


@pytest.mark.parametrize("hidden,inter", [(64, 48), (40, 36)])  # (40, 36): padded panels
def test_moe_experts_every_row_block(hidden, inter):
    """Experts of 1 to 13 rows (with AVX-512 one pass of 1-12 rows, a split 13: 7 + 6; with AVX2 passes of
    up to 4), 25 (9 + 9 + 7) and 133 rows (eleven blocks of 12 and a last one of 1), one choice per token."""
    counts = [*range(1, 14), 25, 133]
    g = torch.Generator().manual_seed(5)
    ids = torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts))
    ids = ids[torch.randperm(ids.numel(), generator=g)].view(-1, 1).contiguous()  # experts' rows interleaved
    n, experts = ids.shape[0], len(counts)
    x = torch.randn(n, hidden, generator=g)
    weights = torch.rand(n, 1, generator=g) + 0.5
    w13 = torch.randn(experts, 2 * inter, hidden, generator=g) / hidden ** 0.5
    w2 = torch.randn(experts, hidden, inter, generator=g) / inter ** 0.5
    out = _experts(x, weights, ids, w13, w2)
    ref = _reference(x, weights, ids, w13, w2)
    assert (out.double() - ref).abs().max().item() < 1e-5 * max(1.0, ref.abs().max().item())


def test_moe_experts_do_not_depend_on_the_other_tokens():
    """A token's output is the same alone and in a batch (each row's sums run in the same order)."""
    x, weights, ids, w13, w2 = _case(24, 4, 16, 64, 48, seed=3)
    packed = cpu.moe_pack(w13, w2)
    batch = cpu.moe_experts(x, weights, ids, packed)
    for t in (0, 11, 23):
        alone = cpu.moe_experts(x[t:t + 1], weights[t:t + 1], ids[t:t + 1], packed)
        assert torch.equal(alone[0], batch[t])


def test_moe_experts_in_token_chunks_match_one_call(monkeypatch):
    """Past MOE_SCRATCH_FLOATS of scratch a call runs in chunks of tokens: the same numbers."""
    x, weights, ids, w13, w2 = _case(50, 3, 8, 64, 48, seed=4)
    packed = cpu.moe_pack(w13, w2)
    whole = cpu.moe_experts(x, weights, ids, packed)
    monkeypatch.setattr(cpu, "MOE_SCRATCH_FLOATS", 7 * 3 * (64 + 48 + 64))  # chunks of 7 tokens
    assert torch.equal(cpu.moe_experts(x, weights, ids, packed), whole)


def test_moe_experts_of_no_tokens():
    _, _, _, w13, w2 = _case(1, 2, 4, 32, 32)
    out = cpu.moe_experts(torch.zeros(0, 32), torch.zeros(0, 2), torch.zeros(0, 2, dtype=torch.int64),
                          cpu.moe_pack(w13, w2))
    assert out.shape == (0, 32)


def test_moe_pack_lays_out_the_panels():
    """p13's panel b holds gate then up features 16 b .. 16 b + 15 per input feature (zeros past inter);
    p2's panel b the down features 32 b .. 32 b + 31 (zeros past hidden)."""
    _, _, _, w13, w2 = _case(1, 1, 3, 40, 20)
    p = cpu.moe_pack(w13, w2)
    assert p.p13.shape == (3, 2, 40, 32) and p.p2.shape == (3, 2, 20, 32)
    assert torch.equal(p.p13[2, 1, 7, :4], w13[2, 16:20, 7]) and torch.equal(p.p13[2, 1, 7, 16:20], w13[2, 36:40, 7])
    assert not p.p13[:, 1, :, 4:16].any() and not p.p13[:, 1, :, 20:].any()
    assert torch.equal(p.p2[1, 1, 5, :8], w2[1, 32:40, 5]) and not p.p2[:, 1, :, 8:].any()


@pytest.mark.parametrize("bad", ["ids_range", "ids_dtype", "w13_shape", "hidden", "weights_shape"])
def test_moe_experts_refuse_what_the_c_code_cannot_read(bad):
    x, weights, ids, w13, w2 = _case(4, 2, 8, 64, 32)
    if bad == "ids_range":
        ids = ids.clone()
        ids[0, 0] = 8
    elif bad == "ids_dtype":
        ids = ids.int()
    elif bad == "w13_shape":
        with pytest.raises(ValueError, match="w13"):
            cpu.moe_pack(w13[:, :-4].contiguous(), w2)
        with pytest.raises(ValueError, match="one w13 and one w2 per expert"):
            cpu.moe_pack(w13[:-1], w2)
        return
    elif bad == "hidden":
        x = x[:, :-4].contiguous()
    elif bad == "weights_shape":
        weights = weights[:, :1].contiguous()
    with pytest.raises(ValueError):
        _experts(x, weights, ids, w13, w2)


@pytest.mark.parametrize("shared_inter", [64, 48, 80])  # 2 parts; 1.5 (a padded part); 2.5
def test_shared_expert_folds_into_the_experts_call(shared_inter):
    """Qwen2-MoE's block packed (its shared expert cut into extra experts of the routed width) gives the
    unpacked block's output, at one token and at a prefill's count."""
    from types import SimpleNamespace

    from radixlang.runtime.models.layers.moe import SparseMoE
    from radixlang.runtime.models.llama import MLP
    config = SimpleNamespace(hidden_size=40, intermediate_size=shared_inter, hidden_act="silu")
    g = torch.Generator().manual_seed(7)
    block = SparseMoE(config, num_experts=6, top_k=2, inter=32, renormalize=False, act=F.silu, act_is_silu=True,
                      shared_expert=MLP(config))
    for p in block.parameters():
        p.data.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
    xs = [torch.randn(n, 40, generator=g) for n in (1, 70)]
    with torch.inference_mode():
        want = [block(x) for x in xs]
        block.pack_experts_()
        assert block.experts.num_shared == -(-shared_inter // 32) and block.shared_expert is None
        assert block.experts.w13 is None and "experts.w13" not in dict(block.named_parameters())
        for x, ref in zip(xs, want):
            assert (block(x) - ref).abs().max().item() < 1e-5


def test_pack_refuses_experts_the_kernel_cannot_run():
    from radixlang.runtime.models.layers.moe import Experts
    gelu = Experts(4, 32, 16, F.gelu, act_is_silu=False)
    with pytest.raises(ValueError, match="SwiGLU"):
        gelu.pack_()
    silu = Experts(4, 32, 16, F.silu, act_is_silu=True)
    silu.pack_()
    with pytest.raises(ValueError, match="already packed"):
        silu.pack_()
