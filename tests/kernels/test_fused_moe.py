"""The fused-MoE path of the CUDA runtime against the per-expert dispatch the CPU runs.

``align_pairs_by_expert`` (kernels/moe_align.py) is checked for its layout invariants on random routings;
``fused_experts`` over the torch oracle of the grouped GEMM, and ``dispatch_static``, against
``moe.dispatch``; the Triton grouped GEMM runs under TRITON_INTERPRET=1 in a subprocess (set before triton
is imported, as tests/kernels/test_attention_triton.py does) against the oracle and, through
``fused_experts``, against the per-expert path; on a GPU the same in half precision (marker ``cuda``).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from radixlang.kernels.fused_moe import default_block_m, fused_experts, grouped_gemm_reference
from radixlang.kernels.moe_align import align_pairs_by_expert, padded_rows
from radixlang.runtime.models.layers.moe import dispatch, dispatch_static


def make_case(n: int, k: int, num_experts: int, hidden: int, inter: int, *, seed: int = 0,
              dtype: torch.dtype = torch.float32, device: str = "cpu", skew: bool = True) -> dict:
    """Random experts and a routing; ``skew`` sends most pairs to expert 0 (long runs, empty experts)."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, num_experts, generator=gen)
    if skew:
        logits[:, 0] += 2.0
        logits[:, -1] -= 10.0  # never picked
    weights, ids = logits.softmax(-1).topk(k, dim=-1)
    w13 = torch.randn(num_experts, 2 * inter, hidden, generator=gen) / hidden ** 0.5
    w2 = torch.randn(num_experts, hidden, inter, generator=gen) / inter ** 0.5
    return {"x": torch.randn(n, hidden, generator=gen).to(dtype=dtype, device=device),
            "w13": w13.to(dtype=dtype, device=device), "w2": w2.to(dtype=dtype, device=device),
            "weights": weights.to(device), "ids": ids.to(device), "inter": inter}


def act_and_mul(inter: int):
    return lambda gate_up: F.silu(gate_up[:, :inter]) * gate_up[:, inter:]


def per_expert(case: dict) -> torch.Tensor:
    """moe.dispatch (the CPU path's expert-sorted loop) over the case's experts, in float32."""
    w13, w2, inter = case["w13"].float(), case["w2"].float(), case["inter"]

    def expert(e: int, xs: torch.Tensor) -> torch.Tensor:
        return F.linear(act_and_mul(inter)(F.linear(xs, w13[e])), w2[e])

    return dispatch(case["x"].float(), case["weights"], case["ids"], w13.shape[0], expert)


def run_fused(case: dict, gemm, block_m: int | None = None) -> torch.Tensor:
    return fused_experts(case["x"], case["w13"], case["w2"], case["weights"], case["ids"],
                         act_and_mul=act_and_mul(case["inter"]), gemm=gemm, block_m=block_m)


# (n tokens, top_k, experts, hidden, inter, block_m): decode-sized and prefill-sized, dims off the tiles
SHAPES = {"decode_bs1": (1, 2, 5, 40, 24, None), "decode_bs3": (3, 2, 8, 64, 32, None),
          "prefill_70": (70, 2, 5, 40, 24, None), "prefill_33_top3_block16": (33, 3, 6, 48, 20, 16),
          "top1_many_experts": (9, 1, 16, 32, 16, 16)}


@pytest.mark.parametrize("n,k,num_experts,block_m", [(1, 2, 5, 16), (7, 2, 5, 4), (40, 3, 6, 16), (200, 2, 8, 64),
                                                     (5, 1, 64, 16), (0, 2, 4, 16)])
def test_align_sorts_pairs_into_blocks_of_one_expert(n, k, num_experts, block_m):
    gen = torch.Generator().manual_seed(n)
    ids = torch.stack([torch.randperm(num_experts, generator=gen)[:k] for _ in range(n)]) if n else \
        torch.zeros(0, k, dtype=torch.long)
    blocks = align_pairs_by_expert(ids, num_experts, block_m)
    pairs = blocks.sorted_pair_ids.long()
    rows = pairs.numel()
    assert rows == padded_rows(n * k, num_experts, block_m) and rows % block_m == 0
    assert blocks.block_expert_ids.numel() == rows // block_m
    real = pairs[pairs < n * k]
    assert sorted(real.tolist()) == list(range(n * k))  # every pair once, the rest padding
    assert set(pairs[pairs >= n * k].tolist()) <= {n * k}
    flat = ids.reshape(-1)
    counts = torch.bincount(flat, minlength=num_experts)
    used = int(((counts + block_m - 1) // block_m * block_m).sum())
    assert int(blocks.num_rows_used) == used
    for b in range(rows // block_m):
        expert = int(blocks.block_expert_ids[b])
        members = [p for p in pairs[b * block_m:(b + 1) * block_m].tolist() if p < n * k]
        if b * block_m >= used:
            assert expert == num_experts and not members  # past the rows in use
        else:
            assert members and all(int(flat[p]) == expert for p in members)
            assert members == sorted(members)


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_fused_experts_over_the_oracle_and_the_static_form_match_the_per_expert_path(name):
    n, k, num_experts, hidden, inter, block_m = SHAPES[name]
    case = make_case(n, k, num_experts, hidden, inter, seed=len(name))
    ref = per_expert(case)
    assert (run_fused(case, grouped_gemm_reference, block_m) - ref).abs().max().item() < 1e-5
    w13, w2 = case["w13"], case["w2"]
    static = dispatch_static(case["x"], case["weights"], case["ids"], num_experts,
                             lambda e, xs: F.linear(act_and_mul(inter)(F.linear(xs, w13[e])), w2[e]))
    assert (static - ref).abs().max().item() < 1e-5


def test_default_blocks_follow_the_token_count():
    assert default_block_m(4, 8) == 16 and default_block_m(300, 8) == 64


def triton_results() -> dict:
    """Run in the TRITON_INTERPRET=1 subprocess: the Triton grouped GEMM against the oracle (with and without
    the routing-weight scale) and fused_experts through it against the per-expert path."""
    from radixlang.kernels.triton_ops.fused_moe import grouped_gemm
    results = {}
    for name, (n, k, num_experts, hidden, inter, block_m) in SHAPES.items():
        case = make_case(n, k, num_experts, hidden, inter, seed=len(name))
        blocks = align_pairs_by_expert(case["ids"], num_experts, block_m or default_block_m(n, num_experts))
        scale = case["weights"].reshape(-1).float()
        got = torch.empty(n * k, 2 * inter)
        want = torch.empty(n * k, 2 * inter)
        grouped_gemm(case["x"], case["w13"], got, blocks, a_row_div=k)
        grouped_gemm_reference(case["x"], case["w13"], want, blocks, a_row_div=k)
        h = act_and_mul(inter)(want)
        got2, want2 = torch.empty(n * k, hidden), torch.empty(n * k, hidden)
        grouped_gemm(h, case["w2"], got2, blocks, a_row_div=1, scale=scale)
        grouped_gemm_reference(h, case["w2"], want2, blocks, a_row_div=1, scale=scale)
        fused = run_fused(case, grouped_gemm, block_m)
        results[name] = {"gemm_err": max(float((got - want).abs().max()), float((got2 - want2).abs().max())),
                         "fused_err": float((fused - per_expert(case)).abs().max()),
                         "finite": bool(torch.isfinite(fused).all())}
    half = make_case(9, 2, 5, 40, 24, dtype=torch.float16)  # tl.dot on the target's default precision
    fused = run_fused(half, grouped_gemm)
    results["float16"] = {"dtype": str(fused.dtype), "fused_err": float((fused.float() - per_expert(half)).abs().max())}
    return results


_SCRIPT = """
import importlib.util, json, os, sys
os.environ["TRITON_INTERPRET"] = "1"
spec = importlib.util.spec_from_file_location("fused_moe_cases", {path!r})
mod = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mod)
print("RESULTS" + json.dumps(mod.triton_results()))
"""


@pytest.fixture(scope="module")
def interpreted_results() -> dict:
    env = dict(os.environ, TRITON_INTERPRET="1", HF_HUB_OFFLINE="1")
    proc = subprocess.run([sys.executable, "-c", _SCRIPT.format(path=str(Path(__file__).resolve()))],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULTS"))
    return json.loads(line[len("RESULTS"):])


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_triton_grouped_gemm_interpreted_matches_the_oracle_and_the_per_expert_path(interpreted_results, name):
    res = interpreted_results[name]
    assert res["finite"]
    assert res["gemm_err"] < 1e-4, res
    assert res["fused_err"] < 1e-4, res


def test_triton_grouped_gemm_interpreted_in_float16(interpreted_results):
    res = interpreted_results["float16"]
    assert res["dtype"] == "torch.float16" and res["fused_err"] < 1e-2, res


@pytest.mark.cuda
@pytest.mark.parametrize("dtype,tol", [("float32", 1e-4), ("float16", 2e-2), ("bfloat16", 5e-2)])
@pytest.mark.parametrize("name", sorted(SHAPES))
def test_triton_fused_experts_on_the_gpu_match_the_per_expert_path(name, dtype, tol):
    from radixlang.kernels.triton_ops.fused_moe import grouped_gemm
    n, k, num_experts, hidden, inter, block_m = SHAPES[name]
    case = make_case(n, k, num_experts, hidden, inter, seed=len(name), dtype=getattr(torch, dtype), device="cuda")
    got = run_fused(case, grouped_gemm, block_m)
    assert got.dtype == getattr(torch, dtype)
    assert (got.float() - per_expert(case)).abs().max().item() < tol
