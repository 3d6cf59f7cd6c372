"""The int8-activation quantized linears (csrc/quant_vnni.c) against the dequantized float32 weight.

Tolerance: a row of x is quantized per group of A = 32 values (16 where the width is not a multiple of 32)
to int8 codes of step xs = max|x_group| / 127, each value rounded to the nearest step, so each value is off
by at most xs / 2 after one pass, and by at most xs / 2 / 128^(passes - 1) after two or three (each further
pass codes what is left in steps 128 times finer). The integer dot products are exact, so an output is off
from the float64 matmul of the dequantized weight by at most
    bound = sum over groups g of  max|x_g| / 254 / 128^(passes - 1) * sum_{j in g} |w_j|
plus float32 rounding (checked with rtol 1e-5 of sum |x| |w|, as the float32 kernel's own test does).
"""
from __future__ import annotations

import pytest
import torch

from radixlang.kernels.cpu import quant as qk

from test_quant_kernels import _q4, _q8

pytestmark = pytest.mark.skipif(not qk.available() or qk.vnni() is None,
                                reason="no VNNI on this CPU (or no compiler): the float32 kernel runs instead")

PASSES = {"int8": 1, "int8x2": 2, "int8x3": 3}


def _bound(x: torch.Tensor, ref: torch.Tensor, passes: int) -> torch.Tensor:
    m, k = x.shape
    a = 32 if k % 32 == 0 else 16
    step = x.double().abs().view(m, k // a, a).amax(-1) / 254 / 128 ** (passes - 1)  # [m, k / a]
    return step @ ref.double().abs().view(-1, k // a, a).sum(-1).t()  # [m, n]


def _no_offsets(made: tuple[qk.QuantWeight, torch.Tensor]) -> tuple[qk.QuantWeight, torch.Tensor]:
    """The same codes and scales with every offset 0 (Q8_0, Q6_K): the kernel skips the offset term."""
    w, ref = made
    n, k, g = w.out_features, w.in_features, w.group
    zero = qk.QuantWeight(w.layout, w.codes, w.scales, torch.zeros_like(w.offsets), g, n, k)
    assert w.has_offsets and not zero.has_offsets
    return zero, ref - w.offsets.repeat_interleave(g, dim=1)


MAKERS = {"q4": lambda n, k, s: _q4(n, k, s), "q8-g16": lambda n, k, s: _q8(n, k, 16, s),
          "q8-g32": lambda n, k, s: _q8(n, k, 32, s), "q8-g64": lambda n, k, s: _q8(n, k, 64, s),
          "q8-g32-no-offsets": lambda n, k, s: _no_offsets(_q8(n, k, 32, s)),
          "q8-g16-no-offsets": lambda n, k, s: _no_offsets(_q8(n, k, 16, s)),
          "q4-no-offsets": lambda n, k, s: _no_offsets(_q4(n, k, s))}


@pytest.mark.parametrize("layout", list(MAKERS))
@pytest.mark.parametrize("activations", list(PASSES))
def test_int8_activations_match_the_dequantized_weight_within_the_rounding_bound(layout, activations):
    g = torch.Generator().manual_seed(len(layout) + PASSES[activations])
    # 96, 160, 80, 592: not multiples of 64 (a partial last chunk)
    widths = {"q4": [96, 160, 576, 1536], "q8-g16": [48, 80, 96, 592], "q8-g32": [96, 160, 576],
              "q8-g64": [128, 576]}[layout.removesuffix("-no-offsets")]
    for k in widths:
        n = int(torch.randint(1, 150, (1,), generator=g))
        w, ref = MAKERS[layout](n, k, k)
        for m in range(1, 17):
            # uneven magnitudes across the row, and one outlier column, as a model's activations have
            x = torch.randn(m, k, generator=g) * torch.rand(1, k, generator=g) * 3
            x[:, int(torch.randint(0, k, (1,), generator=g))] *= 40
            bias = torch.randn(n, generator=g)
            got = qk.linear(x, w, bias, activations=activations).double()
            want = x.double() @ ref.double().t() + bias.double()
            scale = x.double().abs() @ ref.double().abs().t()
            err = (got - want).abs()
            assert (err <= _bound(x, ref, PASSES[activations]) + 1e-5 * scale + 1e-5).all(), (k, m, err.max())
            if activations == "int8":  # it is the int8 kernel that ran: it differs from the float32 one
                assert not torch.allclose(got, qk.linear(x, w, bias, activations="float32").double(), rtol=1e-6)


def test_each_pass_is_about_128_times_closer():
    w, ref = _q4(256, 576, seed=3)
    x = torch.randn(4, 576) * torch.rand(1, 576) * 3
    want = x.double() @ ref.double().t()
    errs = [(qk.linear(x, w, activations=a).double() - want).abs().max().item() for a in PASSES]
    assert errs[1] < errs[0] / 30 and errs[2] < errs[1] / 30, errs
    assert errs[2] < 1e-4 * want.abs().max().item()


def test_default_takes_three_passes_for_few_rows_and_float32_past_them():
    w, _ = _q4(24, 96)  # 24 features: the per-feature kernel (no interleaved layout)
    assert w.interleave() is w
    for m in (1, qk.INT8_MAX_ROWS, qk.INT8_MAX_ROWS + 1):
        x = torch.randn(m, 96)
        want = "int8x3" if m <= qk.INT8_MAX_ROWS else "float32"
        assert torch.equal(qk.linear(x, w), qk.linear(x, w, activations=want))
    w = _q4(64, 96)[0].interleave()
    most = qk.INTERLEAVED_INT8_MAX_ROWS if w.layout == "q4x16" else qk.INT8_MAX_ROWS
    for m in (1, most, most + 1):
        x = torch.randn(m, 96)
        want = "int8x3" if m <= most else "float32"
        assert torch.equal(qk.linear(x, w), qk.linear(x, w, activations=want))
    assert qk.DEFAULT_ACTIVATIONS == "int8x3"


def test_bad_activation_choices_are_refused():
    w, _ = _q4(64, 64)
    with pytest.raises(ValueError, match="activations must be one of"):
        qk.linear(torch.randn(1, 64), w, activations="int4")
    odd, _ = _q8(16, 96, 48)  # a group of 48 straddles the 64-weight chunks
    assert not qk.int8_fits(odd)
    with pytest.raises(ValueError, match="no int8-activation kernel here"):
        qk.linear(torch.randn(1, 96), odd, activations="int8")
    torch.testing.assert_close(qk.linear(torch.randn(0, 96), odd), torch.empty(0, 16))


def test_zero_rows_and_zero_groups():
    w, ref = _q4(40, 128)
    x = torch.zeros(2, 128)
    x[1, 32:64] = torch.randn(32)  # row 0 all zero; row 1 has zero groups around a live one
    want = x.double() @ ref.double().t()
    torch.testing.assert_close(qk.linear(x, w, activations="int8x3").double(), want, rtol=1e-5, atol=1e-5)


X16 = pytest.mark.skipif(qk.vnni() != "avx512-vnni", reason="the 16-feature interleaved kernels are AVX512-VNNI only")
INTERLEAVED_MAKERS = {"q4": MAKERS["q4"], "q8-g16": MAKERS["q8-g16"], "q8-g32": MAKERS["q8-g32"]}


@X16
@pytest.mark.parametrize("layout", list(INTERLEAVED_MAKERS))
@pytest.mark.parametrize("offsets", [True, False])
def test_interleaved_kernels_match_the_plain_ones_and_the_bound(layout, offsets):
    g = torch.Generator().manual_seed(7)
    for n, k in [(16, 32), (48, 96), (960, 576), (576, 1536)]:
        w, ref = INTERLEAVED_MAKERS[layout](n, k, n + k)
        if not offsets:
            w, ref = _no_offsets((w, ref))
        il = w.interleave()
        assert il.layout == w.layout[:2] + "x16" and il.nbytes == w.nbytes  # one copy of the codes, reordered
        for m in (1, 2, 3, 5, 8, 9, 16):  # blocks of up to 8 rows: full, partial, and a one-row tail
            x = torch.randn(m, k, generator=g) * torch.rand(1, k, generator=g) * 3
            x[:, int(torch.randint(0, k, (1,), generator=g))] *= 40
            bias = torch.randn(n, generator=g)
            want = x.double() @ ref.double().t() + bias.double()
            scale = x.double().abs() @ ref.double().abs().t()
            for activations, passes in PASSES.items():
                got = qk.linear(x, il, bias, activations=activations).double()
                assert ((got - want).abs() <= _bound(x, ref, passes) + 1e-5 * scale + 1e-5).all(), (n, k, m)
                # a row's numbers do not depend on the rows beside it (a decode and a speculative verify of
                # the same position must pick the same token)
                alone = torch.cat([qk.linear(x[i:i + 1], il, bias, activations=activations) for i in (0, m - 1)])
                assert torch.equal(got[[0, m - 1]], alone.double()), (n, k, m, activations)
                other = qk.linear(x, w, bias, activations=activations).double()
                torch.testing.assert_close(got, other, rtol=1e-5, atol=1e-5 * scale.max().item())
            # float32 activations read the plain layout again: the float32 kernel's numbers
            torch.testing.assert_close(qk.linear(x, il, bias, activations="float32"),
                                       qk.linear(x, w, bias, activations="float32"))
        assert torch.equal(qk.dequantize(il), qk.dequantize(w))


@X16
def test_interleaved_layouts():
    w, ref = _q4(32, 64, seed=1)
    il = w.interleave()
    q = torch.round((ref - w.offsets.repeat_interleave(32, 1)) / w.scales.repeat_interleave(32, 1)).to(torch.uint8)
    codes = il.codes.view(2, 2, 4, 16, 4)  # [block, group, part, feature, j]
    for b, gr, part, r, j in [(0, 0, 0, 0, 0), (1, 1, 3, 15, 3), (0, 1, 2, 7, 1), (1, 0, 1, 3, 2)]:
        byte = int(codes[b, gr, part, r, j])
        feature, first = 16 * b + r, 32 * gr + 8 * part + j
        assert byte & 15 == q[feature, first] and byte >> 4 == q[feature, first + 4]
    assert torch.equal(il.scales.view(2, 2, 16)[1, 0], w.scales[16:32, 0])
    assert torch.equal(il.offsets.view(2, 2, 16)[0, 1], w.offsets[:16, 1])
    w8 = _q8(32, 64, 16, seed=2)[0]
    codes8 = w8.interleave().codes.view(2, 16, 16, 4)  # [block, step of 4 inputs, feature, j], q + 128
    for b, st, r, j in [(0, 0, 0, 0), (1, 15, 15, 3), (0, 7, 9, 2), (1, 3, 4, 1)]:
        assert int(codes8[b, st, r, j]) == int(w8.codes[16 * b + r, 4 * st + j]) + 128
    assert torch.equal(w8.interleave().scales.view(2, 4, 16)[1, 3], w8.scales[16:32, 3])
    for plain in (w, w8):
        back = plain.interleave().plain()
        assert all(torch.equal(getattr(back, f), getattr(plain, f)) for f in ("codes", "scales", "offsets"))
    assert _q4(24, 64)[0].interleave().layout == "q4"  # not a multiple of 16 features
    assert _q8(32, 128, 64)[0].interleave().layout == "q8"  # groups of 64: the per-feature kernel
    with pytest.raises(ValueError, match="cannot be stacked"):
        qk.QuantWeight.concat([w.interleave(), w.interleave()])


def _experts_reference(x, weights, ids, w13, w2):
    """Each token through each of its experts on the int8 kernels one at a time (the per-expert path's
    calls), SiLU in torch."""
    inter = w2[0].in_features
    out = torch.zeros(x.shape)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            gate, up = qk.linear(x[t:t + 1], w13[e]).split(inter, dim=-1)
            out[t] += float(weights[t, j]) * qk.linear(torch.nn.functional.silu(gate) * up, w2[e])[0]
    return out


@pytest.mark.parametrize("layout", ["q4", "q8-g32", "q8-g16-no-offsets", "q4x16", "q8x16-g32"])
def test_quant_moe_runs_the_experts_of_a_decode_step_in_one_call(layout):
    """The one-call layer (rl_quant_moe_i8) against each token through its experts one kernel call at a time:
    one token (fewer experts with rows than threads: each expert on every thread), and 6 tokens over 6
    experts, two rows each (the plain layouts' int8 limit; the experts shared among the threads); an expert
    past max_rows hands the step back (None)."""
    hidden, inter, experts = 64, 96, 6
    make = MAKERS[layout.replace("x16", "")]
    w13 = [make(2 * inter, hidden, 10 + e)[0] for e in range(experts)]
    w2 = [make(hidden, inter, 20 + e)[0] for e in range(experts)]
    if "x16" in layout:
        if qk.vnni() != "avx512-vnni":
            pytest.skip("the interleaved layouts are for AVX512-VNNI")
        w13, w2 = [w.interleave() for w in w13], [w.interleave() for w in w2]
        assert w13[0].layout.endswith("x16") and w2[0].layout.endswith("x16")
    moe = qk.QuantMoE.build(w13, w2)
    assert moe is not None
    g = torch.Generator().manual_seed(3)
    spread = torch.tensor([[t, (t + 3) % experts] for t in range(experts)])  # every expert twice
    for ids in (torch.tensor([[4]]), torch.tensor([[1, 5]]), spread):
        n, k = ids.shape
        x = torch.randn(n, hidden, generator=g)
        weights = torch.rand(n, k, generator=g) + 0.2
        got = moe(x, weights, ids)
        assert got is not None
        want = _experts_reference(x, weights, ids, w13, w2)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    ids = torch.zeros(moe.max_rows + 1, 1, dtype=torch.int64)  # one expert past the int8 kernels' rows
    assert moe(torch.randn(ids.shape[0], hidden), torch.ones(ids.shape), ids) is None


def test_quant_moe_is_not_built_for_mixed_layouts():
    a = [_q4(96, 64, s)[0] for s in range(2)]
    mixed = [_q4(64, 96, 5)[0], _q8(64, 96, 32, 6)[0]]
    assert qk.QuantMoE.build(a, mixed) is None
