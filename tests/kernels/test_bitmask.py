"""Token bitmask kernels: torch path vs a per-token oracle; Triton kernel under TRITON_INTERPRET=1."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from radixlang.kernels.bitmask import (allocate_token_bitmask, apply_token_bitmask_inplace,
                                       apply_token_bitmask_inplace_torch, fill_full, unpack_bitmask)


def random_bitmask(bs: int, vocab: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A random allowed matrix and its packed form, packed by a plain loop (the oracle)."""
    g = torch.Generator().manual_seed(seed)
    allowed = torch.rand(bs, vocab, generator=g) < 0.3
    words = [[0] * ((vocab + 31) // 32) for _ in range(bs)]
    for r in range(bs):
        for t in allowed[r].nonzero().flatten().tolist():
            words[r][t // 32] |= 1 << (t % 32)
    packed = torch.tensor([[w - (1 << 32) if w >= 1 << 31 else w for w in row] for row in words], dtype=torch.int32)
    return allowed, packed


@pytest.mark.parametrize("bs, vocab", [(1, 32), (3, 100), (4, 1000), (2, 4097)])
def test_torch_path_matches_oracle(bs, vocab):
    allowed, packed = random_bitmask(bs, vocab, seed=vocab)
    assert torch.equal(unpack_bitmask(packed, vocab), allowed)
    logits = torch.randn(bs, vocab)
    expected = torch.where(allowed, logits, torch.full_like(logits, float("-inf")))
    apply_token_bitmask_inplace(logits, packed)
    assert torch.equal(logits, expected)


def test_indices_mask_only_those_rows():
    allowed, packed = random_bitmask(4, 70, seed=1)
    logits = torch.randn(4, 70)
    before = logits.clone()
    apply_token_bitmask_inplace(logits, packed, indices=[1, 3])
    for r in (0, 2):
        assert torch.equal(logits[r], before[r])
    for r in (1, 3):
        assert torch.equal(torch.isinf(logits[r]), ~allowed[r])


def test_allocate_and_fill_full():
    mask = allocate_token_bitmask(3, 65)
    assert mask.shape == (3, 3) and mask.dtype == torch.int32
    logits = torch.randn(3, 65)
    before = logits.clone()
    apply_token_bitmask_inplace(logits, mask)
    assert torch.equal(logits, before)
    mask.zero_()
    assert fill_full(mask) is mask and bool((mask == -1).all())


def test_half_precision_logits():
    allowed, packed = random_bitmask(2, 96, seed=5)
    logits = torch.randn(2, 96, dtype=torch.bfloat16)
    apply_token_bitmask_inplace_torch(logits, packed)
    assert torch.equal(torch.isinf(logits), ~allowed)


def test_bad_shapes_raise():
    with pytest.raises(ValueError, match="needs >= 4 words"):
        apply_token_bitmask_inplace(torch.randn(1, 100), torch.zeros(1, 3, dtype=torch.int32))
    with pytest.raises(ValueError, match="one row per logits row"):
        apply_token_bitmask_inplace(torch.randn(2, 32), torch.zeros(1, 1, dtype=torch.int32))
    with pytest.raises(ValueError, match="int32"):
        apply_token_bitmask_inplace(torch.randn(1, 32), torch.zeros(1, 1, dtype=torch.int64))


TRITON_SCRIPT = textwrap.dedent("""
    import torch
    from radixlang.kernels.bitmask import apply_token_bitmask_inplace_torch, apply_token_bitmask_inplace_triton
    g = torch.Generator().manual_seed(0)
    for bs, vocab, indices in [(3, 100, None), (2, 2500, None), (4, 1030, [0, 2])]:
        words = (vocab + 31) // 32
        mask = torch.randint(-2**31, 2**31 - 1, (bs, words), generator=g, dtype=torch.int64).to(torch.int32)
        mask[0, 0] = -1  # sign bit set
        logits = torch.randn(bs, vocab, generator=g)
        ref = logits.clone()
        apply_token_bitmask_inplace_torch(ref, mask, indices)
        apply_token_bitmask_inplace_triton(logits, mask, indices)
        assert torch.equal(logits, ref), (bs, vocab, indices)
    print("TRITON_OK")
""")


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")
def test_triton_kernel_matches_torch_in_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "-c", TRITON_SCRIPT], env=env, capture_output=True, text=True,
                          timeout=300, cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "TRITON_OK" in proc.stdout


@pytest.mark.cuda
def test_triton_kernel_on_cuda():
    allowed, packed = random_bitmask(5, 50000, seed=3)
    logits = torch.randn(5, 50000, device="cuda")
    expected = torch.where(allowed.cuda(), logits, torch.full_like(logits, float("-inf")))
    apply_token_bitmask_inplace(logits, packed.cuda())
    assert torch.equal(logits, expected)
