"""Triton backend vs the torch reference, through a real paged TokenToKVPool.

On the CPU the kernels run under TRITON_INTERPRET=1, which must be set before
triton is first imported, so all CPU cases run in one subprocess that imports
this file's helpers (``attention_case``) and prints the results as JSON; the
pytest process itself never imports triton. On a GPU the same cases run
in-process (marker ``cuda``).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from radixlang.kernels.attention.base import ForwardMode
from radixlang.kernels.attention.torch_native import TorchNativeAttnBackend
from radixlang.runtime.model_executor.forward_batch import ForwardBatch
from radixlang.runtime.mem_cache.memory_pool import ReqToTokenPool, TokenToKVPool


class Layer:
    def __init__(self, heads: int, kv_heads: int, head_dim: int, layer_id: int = 0) -> None:
        self.layer_id, self.num_heads, self.num_kv_heads, self.head_dim = layer_id, heads, kv_heads, head_dim
        self.scaling = head_dim ** -0.5


def _make_state(prefix_lens, extend_lens, kv_heads, head_dim, dtype, device, seed):
    """Pools with every request's prefix written at scattered slots; returns the new tokens' k/v and slots."""
    gen = torch.Generator().manual_seed(seed)
    total = sum(prefix_lens) + sum(extend_lens)
    pool = TokenToKVPool(total + 16, num_layers=2, num_kv_heads=kv_heads, head_dim=head_dim, dtype=dtype,
                         device=device)
    reqs = ReqToTokenPool(len(prefix_lens) + 2, max(p + e for p, e in zip(prefix_lens, extend_lens)) + 4, device)
    rows = torch.randperm(len(prefix_lens) + 2, generator=gen)[:len(prefix_lens)]  # non-trivial req_pool_indices
    slots_all = pool.alloc(total)[torch.randperm(total, generator=gen)]
    new_k, new_v, out_loc, start = [], [], [], 0
    for row, p, e in zip(rows.tolist(), prefix_lens, extend_lens):
        slots = slots_all[start:start + p + e]
        start += p + e
        reqs.req_to_token[row, :p + e] = slots.to(torch.int32).to(device)
        k = torch.randn(p + e, kv_heads, head_dim, generator=gen).to(dtype=dtype, device=device)
        v = torch.randn(p + e, kv_heads, head_dim, generator=gen).to(dtype=dtype, device=device)
        for layer_id in range(2):
            pool.set_kv_buffer(layer_id, slots[:p].to(device), k[:p] * (layer_id + 1), v[:p])
        new_k.append(k[p:])
        new_v.append(v[p:])
        out_loc.append(slots[p:])
    return pool, reqs, rows.to(device), torch.cat(new_k), torch.cat(new_v), torch.cat(out_loc).to(device)


def attention_case(backend_name: str, *, mode: str, heads: int, kv_heads: int, head_dim: int,
                   prefix_lens: list[int], extend_lens: list[int], dtype: str = "float32",
                   device: str = "cpu", seed: int = 0, backend_kwargs: dict | None = None) -> dict:
    """Run one batch through `backend_name` and the torch reference on identical pools, for two layers."""
    from radixlang.kernels.attention import create_attention_backend
    torch_dtype = getattr(torch, dtype)
    fmode = ForwardMode.DECODE if mode == "decode" else ForwardMode.EXTEND
    results = {"max_err": 0.0, "kv_written_equal": True}
    outs = {}
    for name in ("torch", backend_name):
        pool, reqs, rows, k, v, out_loc = _make_state(prefix_lens, extend_lens, kv_heads, head_dim,
                                                      torch_dtype, device, seed)
        gen = torch.Generator().manual_seed(seed + 1)
        seq = [p + e for p, e in zip(prefix_lens, extend_lens)]
        backend = (TorchNativeAttnBackend(heads, kv_heads, head_dim, device, torch_dtype) if name == "torch" else
                   create_attention_backend(name, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
                                            device=device, dtype=torch_dtype, **(backend_kwargs or {})))
        n = sum(extend_lens)
        fb = ForwardBatch(forward_mode=fmode, batch_size=len(seq), input_ids=torch.zeros(n, dtype=torch.int64),
                          positions=torch.zeros(n, dtype=torch.int64), req_pool_indices=rows,
                          seq_lens=torch.tensor(seq, device=device), seq_lens_cpu=seq,
                          extend_prefix_lens_cpu=list(prefix_lens), extend_seq_lens_cpu=list(extend_lens),
                          out_cache_loc=out_loc, req_to_token=reqs.req_to_token, token_to_kv_pool=pool,
                          attn_backend=backend)
        backend.init_forward_metadata(fb)
        layer_outs = []
        for layer_id in range(2):
            q = torch.randn(n, heads, head_dim, generator=gen).to(dtype=torch_dtype, device=device)
            layer_outs.append(backend.forward(q, k * (layer_id + 1), v, Layer(heads, kv_heads, head_dim, layer_id),
                                              fb).float().cpu())
        outs[name] = (layer_outs, [pool.get_key_buffer(i).float().cpu() for i in range(2)])
    (ref, ref_k), (got, got_k) = outs["torch"], outs[backend_name]
    results["max_err"] = max(float((a - b).abs().max()) for a, b in zip(ref, got))
    results["finite"] = all(bool(torch.isfinite(g).all()) for g in got)
    results["kv_written_equal"] = all(torch.equal(a, b) for a, b in zip(ref_k, got_k))
    return results


def engine_case(model_dir: str) -> dict:
    """Greedy generation with prefix reuse through the Engine: triton vs torch logprobs."""
    from radixlang import Engine
    prompts = [["hello world this is a test", "abc"], ["hello world this is a test and more", "abc def"]]
    runs = {}
    for backend in ("torch", "triton"):
        with Engine(model_path=model_dir, load_format="dummy", max_total_tokens=2048,
                    attention_backend=backend) as engine:
            runs[backend] = [engine.generate(p, {"max_new_tokens": 6, "temperature": 0}, return_logprob=True)
                             for p in prompts]
    ref, got = [o for r in runs["torch"] for o in r], [o for r in runs["triton"] for o in r]
    err = max(abs(a[0] - b[0]) for x, y in zip(ref, got)
              for a, b in zip(x["meta_info"]["output_token_logprobs"], y["meta_info"]["output_token_logprobs"]))
    return {"same_ids": [x["output_ids"] for x in ref] == [y["output_ids"] for y in got],
            "cached_tokens": [y["meta_info"]["cached_tokens"] for y in got], "max_logprob_err": err}


CASES = {
    "extend_gqa4_mixed_prefix": dict(mode="extend", heads=8, kv_heads=2, head_dim=64,
                                     prefix_lens=[0, 5, 35], extend_lens=[7, 1, 37]),
    "extend_mha_prefill": dict(mode="extend", heads=2, kv_heads=2, head_dim=64,
                               prefix_lens=[0, 0], extend_lens=[3, 20]),
    "extend_head_dim_48_gqa4": dict(mode="extend", heads=4, kv_heads=1, head_dim=48, prefix_lens=[3, 0],
                                    extend_lens=[5, 2]),
    "decode_gqa4": dict(mode="decode", heads=8, kv_heads=2, head_dim=64, prefix_lens=[0, 9, 40],
                        extend_lens=[1, 1, 1]),
    "decode_mha_many_splits": dict(mode="decode", heads=2, kv_heads=2, head_dim=64, prefix_lens=[2, 70],
                                   extend_lens=[1, 1], backend_kwargs={"max_kv_splits": 8, "min_split_len": 4}),
    "decode_head_dim_48": dict(mode="decode", heads=4, kv_heads=1, head_dim=48, prefix_lens=[3, 17],
                               extend_lens=[1, 1], backend_kwargs={"max_kv_splits": 3, "min_split_len": 8}),
    # the grouped decode kernel: 8 query heads a KV head in one program; 20 (more than its 16 rows) in two
    "decode_gqa8": dict(mode="decode", heads=16, kv_heads=2, head_dim=32, prefix_lens=[6, 45],
                        extend_lens=[1, 1], backend_kwargs={"max_kv_splits": 4, "min_split_len": 8}),
    "decode_gqa20_two_head_blocks": dict(mode="decode", heads=40, kv_heads=2, head_dim=16, prefix_lens=[0, 21, 4],
                                         extend_lens=[1, 1, 1], backend_kwargs={"max_kv_splits": 2,
                                                                                "min_split_len": 8}),
}

_SCRIPT = """
import importlib.util, json, os, sys
os.environ["TRITON_INTERPRET"] = "1"
spec = importlib.util.spec_from_file_location("attn_cases", {path!r})
mod = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mod)
results = {{name: mod.attention_case("triton", **case) for name, case in mod.CASES.items()}}
from radixlang.kernels.triton_ops import decode_attention
grids = []
class Recorded:  # the decode stage-1 kernel's launch grids
    def __init__(self, kernel):
        self.kernel = kernel
    def __getitem__(self, grid):
        grids.append(list(grid))
        return self.kernel[grid]
decode_attention._decode_split_kernel = Recorded(decode_attention._decode_split_kernel)
for name in ("decode_gqa8", "decode_gqa20_two_head_blocks"):
    grids.clear()
    mod.attention_case("triton", **mod.CASES[name])
    results[name + "_grids"] = list(grids)
sys.path.insert(0, {tests!r})
from tiny_model import make_tiny_model_dir
import tempfile
results["engine"] = mod.engine_case(make_tiny_model_dir(tempfile.mkdtemp()))
print("RESULTS" + json.dumps(results))
"""


@pytest.fixture(scope="module")
def interpreted_results() -> dict:
    env = dict(os.environ, TRITON_INTERPRET="1", HF_HUB_OFFLINE="1")
    proc = subprocess.run([sys.executable, "-c", _SCRIPT.format(path=str(Path(__file__).resolve()),
                                                               tests=str(Path(__file__).resolve().parents[1]))],
                          capture_output=True, text=True, env=env, timeout=540)
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULTS"))
    return json.loads(line[len("RESULTS"):])


@pytest.mark.parametrize("name", sorted(CASES))
def test_triton_interpreted_matches_torch(interpreted_results, name):
    res = interpreted_results[name]
    assert res["finite"]
    assert res["kv_written_equal"]
    assert res["max_err"] < 1e-4, res


def test_decode_runs_one_program_per_kv_head_and_split(interpreted_results):
    # grouped decode: the 8 query heads of each of 2 KV heads share a program (which reads the KV once for
    # all of them), not one program per query head; 20 query heads a KV head take two programs of 16 rows
    assert interpreted_results["decode_gqa8_grids"] == [[2, 2, 4]] * 2  # (requests, kv heads, splits), 2 layers
    assert interpreted_results["decode_gqa20_two_head_blocks_grids"] == [[3, 4, 2]] * 2


def test_engine_with_triton_backend_matches_torch(interpreted_results):
    res = interpreted_results["engine"]
    assert res["same_ids"]
    assert res["cached_tokens"][2] > 0  # the second round reused the first round's prefix
    assert res["max_logprob_err"] < 1e-3, res


@pytest.mark.cuda
@pytest.mark.parametrize("dtype,tol", [("float16", 2e-2), ("bfloat16", 5e-2)])
@pytest.mark.parametrize("name", sorted(CASES))
def test_triton_gpu_matches_torch(name, dtype, tol):
    res = attention_case("triton", device="cuda", dtype=dtype, **CASES[name])
    assert res["finite"] and res["kv_written_equal"]
    assert res["max_err"] < tol, res
