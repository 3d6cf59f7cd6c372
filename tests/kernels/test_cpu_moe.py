"""The compiled MoE experts (csrc/moe.c) against a token-by-token PyTorch reference."""
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
    (5, 2, 8, 100, 36, 0.0),  # widths with a tail past the last 16 floats
    (32, 4, 16, 128, 96, 0.5),  # uneven: some experts 9+ rows (row blocks of 4 and a remainder), some none
    (7, 3, 4, 64, 1540, 0.0),  # intermediate wider than several work items
    (64, 8, 64, 32, 20, 1.0),  # many experts, hidden narrower than one vector
])
def test_moe_experts_match_token_by_token(n, k, experts, hidden, inter, skew):
    x, weights, ids, w13, w2 = _case(n, k, experts, hidden, inter, skew=skew)
    counts = torch.bincount(ids.view(-1), minlength=experts)
    if n >= 32:
        assert counts.max() > 4 and counts.min() == 0  # the shapes the test means to cover
    out = cpu.moe_experts(x, weights, ids, w13, w2)
    assert out.dtype == torch.float32 and out.shape == x.shape
    ref = _reference(x, weights, ids, w13, w2)
    assert (out.double() - ref).abs().max().item() < 1e-5 * max(1.0, ref.abs().max().item())


@pytest.mark.parametrize("hidden,inter", [(64, 48), (40, 36)])  # (40, 36): tails past the last 16 floats
def test_moe_experts_every_row_block(hidden, inter):
    """Experts of 1 to 13 rows (the 4-weight-row passes of 1-4 rows, the 2-weight-row passes of 5-12, a split
    13), 25 (9 + 9 + 7) and 133 rows (eleven blocks of 12 and a last one of 1), one choice per token."""
    counts = [*range(1, 14), 25, 133]
    g = torch.Generator().manual_seed(5)
    ids = torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts))
    ids = ids[torch.randperm(ids.numel(), generator=g)].view(-1, 1).contiguous()  # experts' rows interleaved
    n, experts = ids.shape[0], len(counts)
    x = torch.randn(n, hidden, generator=g)
    weights = torch.rand(n, 1, generator=g) + 0.5
    w13 = torch.randn(experts, 2 * inter, hidden, generator=g) / hidden ** 0.5
    w2 = torch.randn(experts, hidden, inter, generator=g) / inter ** 0.5
    out = cpu.moe_experts(x, weights, ids, w13, w2)
    ref = _reference(x, weights, ids, w13, w2)
    assert (out.double() - ref).abs().max().item() < 1e-5 * max(1.0, ref.abs().max().item())


def test_moe_experts_do_not_depend_on_the_other_tokens():
    """A token's output is the same alone and in a batch (each row's sums run in the same order)."""
    x, weights, ids, w13, w2 = _case(24, 4, 16, 64, 48, seed=3)
    batch = cpu.moe_experts(x, weights, ids, w13, w2)
    for t in (0, 11, 23):
        alone = cpu.moe_experts(x[t:t + 1], weights[t:t + 1], ids[t:t + 1], w13, w2)
        assert torch.equal(alone[0], batch[t])


@pytest.mark.parametrize("bad", ["ids_range", "ids_dtype", "w13_shape", "odd_inter", "weights_shape"])
def test_moe_experts_refuse_what_the_c_code_cannot_read(bad):
    x, weights, ids, w13, w2 = _case(4, 2, 8, 64, 32)
    if bad == "ids_range":
        ids = ids.clone()
        ids[0, 0] = 8
    elif bad == "ids_dtype":
        ids = ids.int()
    elif bad == "w13_shape":
        w13 = w13[:, :-4].contiguous()
    elif bad == "odd_inter":
        w13, w2 = torch.randn(8, 2 * 29, 64), torch.randn(8, 64, 29)  # shapes agree; 29 is no multiple of 4
    elif bad == "weights_shape":
        weights = weights[:, :1].contiguous()
    with pytest.raises(ValueError):
        cpu.moe_experts(x, weights, ids, w13, w2)
