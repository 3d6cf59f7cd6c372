"""The quantized linear kernels (csrc/quant_ops.c): q4 and q8 layouts against the float32 weights they encode."""
from __future__ import annotations

import pytest
import torch

from radixlang.kernels.cpu import quant as qk

pytestmark = pytest.mark.skipif(not qk.available(), reason="no C compiler for the quantized kernels")


def _q4(n: int, k: int, seed: int = 0) -> tuple[qk.QuantWeight, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8).view(n, k // 32, 32)
    codes = (q[..., :16] | (q[..., 16:] << 4)).reshape(n, k // 2).contiguous()
    s = torch.rand(n, k // 32, generator=g) * 0.02
    o = -torch.rand(n, k // 32, generator=g) * 0.1
    ref = torch.addcmul(o[..., None], q.float(), s[..., None]).view(n, k)
    return qk.QuantWeight("q4", codes, s, o, 32, n, k), ref


def _q8(n: int, k: int, group: int, seed: int = 0) -> tuple[qk.QuantWeight, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
    s = torch.rand(n, k // group, generator=g) * 0.01
    o = torch.randn(n, k // group, generator=g) * 0.01
    ref = torch.addcmul(o[..., None], q.view(n, k // group, group).float(), s[..., None]).view(n, k)
    return qk.QuantWeight("q8", q, s, o, group, n, k), ref


@pytest.mark.parametrize("make", [lambda n, k: _q4(n, k), lambda n, k: _q8(n, k, 16), lambda n, k: _q8(n, k, 32)],
                         ids=["q4", "q8-g16", "q8-g32"])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 9])
def test_linear_matches_the_float_weight(make, rows):
    w, ref = make(200, 96)  # 200 outputs: the last 64-feature chunk is partial
    assert torch.equal(qk.dequantize(w), ref) or (qk.dequantize(w) - ref).abs().max() < 1e-6
    x = torch.randn(rows, 96)
    bias = torch.randn(200)
    want = x.double() @ ref.double().t() + bias.double()
    got = qk.linear(x, w, bias)
    assert got.shape == (rows, 200) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(qk.linear(x, w).double(), want - bias.double(), rtol=1e-5, atol=1e-4)


def test_concat_stacks_output_features():
    a, ra = _q4(64, 64, seed=1)
    b, rb = _q4(32, 64, seed=2)
    both = qk.QuantWeight.concat([a, b])
    assert (both.out_features, both.in_features) == (96, 64)
    torch.testing.assert_close(qk.dequantize(both), torch.cat([ra, rb]))
    with pytest.raises(ValueError, match="one layout"):
        qk.QuantWeight.concat([a, _q8(32, 64, 32)[0]])


def test_bad_shapes_are_refused():
    w, _ = _q4(64, 64)
    with pytest.raises(ValueError, match="x must be float32"):
        qk.linear(torch.randn(2, 32), w)
    with pytest.raises(ValueError, match="group 16 does not fit layout q4"):
        qk.QuantWeight("q4", w.codes, w.scales, w.offsets, 16, 64, 64)
    with pytest.raises(ValueError, match="codes must be contiguous"):
        qk.QuantWeight("q8", w.codes, w.scales, w.offsets, 32, 64, 64)
