"""Attention kernel microbenchmark on a GPU: microseconds per layer call for each backend.

    python -m bench.kernels [--quick] [--backends torch,triton,flashinfer]

Decode: batch 1-256 x context 512-8k, Llama-8B-like heads (32 q / 8 kv, head_dim 128,
bf16), each request's KV contiguous in the pool. Reported: us per call and
achieved bandwidth (KV bytes read / time) as a fraction of the device's copy
bandwidth measured in the same run. Extend: a few prefill / prefix+extend
shapes with us per call and TFLOP/s. The per-step metadata/plan cost is
reported separately (it is paid once per step, not per layer). Without a CUDA
GPU it prints a skip message and exits 0. Results: bench/results/kernels.json.
"""
from __future__ import annotations

import argparse
import sys

import torch

HEADS, KV_HEADS, HEAD_DIM, DTYPE = 32, 8, 128, torch.bfloat16
MAX_POOL_TOKENS = 1 << 20


class _Layer:
    layer_id, num_heads, num_kv_heads, head_dim, scaling = 0, HEADS, KV_HEADS, HEAD_DIM, HEAD_DIM ** -0.5


def _time_us(fn, *, warmup: int, iters: int) -> float:
    for _ in range(warmup):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000.0 / iters


def device_copy_gbs(num_bytes: int = 1 << 30) -> float:
    src = torch.empty(num_bytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    us = _time_us(lambda: dst.copy_(src), warmup=3, iters=10)
    return 2 * num_bytes / (us * 1e-6) / 1e9  # read + write


def _batch(pool, reqs, backend, mode, prefix_lens, extend_lens):
    from radixlang.runtime.model_executor.forward_batch import ForwardBatch
    seq = [p + e for p, e in zip(prefix_lens, extend_lens)]
    starts = [0]
    for n in seq[:-1]:
        starts.append(starts[-1] + n)
    for i, (s0, n) in enumerate(zip(starts, seq)):  # contiguous slots 1.. per request
        reqs.req_to_token[i, :n] = torch.arange(1 + s0, 1 + s0 + n, dtype=torch.int32, device="cuda")
    out_loc = torch.cat([torch.arange(1 + s0 + p, 1 + s0 + p + e, device="cuda")
                         for s0, p, e in zip(starts, prefix_lens, extend_lens)])
    n = sum(extend_lens)
    return ForwardBatch(forward_mode=mode, batch_size=len(seq), input_ids=torch.zeros(n, dtype=torch.int64),
                        positions=torch.zeros(n, dtype=torch.int64),
                        req_pool_indices=torch.arange(len(seq), device="cuda"),
                        seq_lens=torch.tensor(seq, device="cuda"), seq_lens_cpu=seq,
                        extend_prefix_lens_cpu=list(prefix_lens), extend_seq_lens_cpu=list(extend_lens),
                        out_cache_loc=out_loc, req_to_token=reqs.req_to_token, token_to_kv_pool=pool,
                        attn_backend=backend)


def _run_case(backend, pool, reqs, mode, prefix_lens, extend_lens, iters):
    fb = _batch(pool, reqs, backend, mode, prefix_lens, extend_lens)
    n = sum(extend_lens)
    q = torch.randn(n, HEADS, HEAD_DIM, device="cuda", dtype=DTYPE)
    k = torch.randn(n, KV_HEADS, HEAD_DIM, device="cuda", dtype=DTYPE)
    v = torch.randn_like(k)
    plan_us = _time_us(lambda: backend.init_forward_metadata(fb), warmup=1, iters=3)
    backend.init_forward_metadata(fb)
    call_us = _time_us(lambda: backend.forward(q, k, v, _Layer(), fb), warmup=3, iters=iters)
    return plan_us, call_us


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--backends", default="torch,triton,flashinfer")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench.kernels: no CUDA GPU on this machine; the attention kernels are timed on a GPU only. Skipping.")
        return 0
    from bench.common import write_result
    from radixlang.kernels.attention import create_attention_backend
    from radixlang.kernels.attention.base import ForwardMode
    from radixlang.runtime.mem_cache.memory_pool import ReqToTokenPool, TokenToKVPool

    copy_gbs = device_copy_gbs()
    print(f"{torch.cuda.get_device_name()}: copy bandwidth {copy_gbs:.0f} GB/s")
    pool = TokenToKVPool(MAX_POOL_TOKENS, num_layers=1, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, dtype=DTYPE,
                         device="cuda")
    pool.get_key_buffer(0).normal_()
    pool.get_value_buffer(0).normal_()
    reqs = ReqToTokenPool(256, 8192 + 64, "cuda")
    backends = {}
    for name in args.backends.split(","):
        try:
            backends[name] = create_attention_backend(name, num_heads=HEADS, num_kv_heads=KV_HEADS,
                                                      head_dim=HEAD_DIM, device="cuda", dtype=DTYPE)
        except ImportError as e:
            print(f"skipping backend {name}: {e}")
    batch_sizes = (1, 32, 256) if args.quick else (1, 8, 32, 64, 128, 256)
    contexts = (512, 8192) if args.quick else (512, 2048, 8192)
    iters = 10 if args.quick else 30
    el = torch.empty(0, dtype=DTYPE).element_size()
    rows = []
    for bs in batch_sizes:
        for ctx in contexts:
            if bs * ctx > MAX_POOL_TOKENS:
                continue
            kv_bytes = bs * ctx * KV_HEADS * HEAD_DIM * 2 * el
            for name, backend in backends.items():
                plan_us, us = _run_case(backend, pool, reqs, ForwardMode.DECODE, [ctx - 1] * bs, [1] * bs, iters)
                frac = kv_bytes / (us * 1e-6) / 1e9 / copy_gbs
                rows.append({"kind": "decode", "backend": name, "bs": bs, "context": ctx, "us": round(us, 1),
                             "plan_us": round(plan_us, 1), "bandwidth_fraction": round(frac, 3)})
                print(f"decode  {name:10s} bs={bs:3d} ctx={ctx:5d}: {us:9.1f} us  "
                      f"{frac:6.1%} of copy bandwidth  (metadata {plan_us:.0f} us/step)")
    extend_shapes = [(1, 0, 4096), (4, 2048, 512), (32, 4096, 32)] if args.quick else \
        [(1, 0, 4096), (8, 0, 512), (4, 2048, 512), (16, 1024, 128), (32, 4096, 32)]
    for bs, prefix, ext in extend_shapes:
        flops = 4 * HEADS * HEAD_DIM * bs * (ext * prefix + ext * (ext + 1) / 2)
        for name, backend in backends.items():
            plan_us, us = _run_case(backend, pool, reqs, ForwardMode.EXTEND, [prefix] * bs, [ext] * bs, iters)
            tflops = flops / (us * 1e-6) / 1e12
            rows.append({"kind": "extend", "backend": name, "bs": bs, "prefix": prefix, "extend": ext,
                         "us": round(us, 1), "plan_us": round(plan_us, 1), "tflops": round(tflops, 2)})
            print(f"extend  {name:10s} bs={bs:3d} prefix={prefix:5d} new={ext:5d}: {us:9.1f} us  {tflops:6.1f} TFLOP/s")
    path = write_result("kernels", {"gpu": torch.cuda.get_device_name(), "copy_gbs": round(copy_gbs, 1),
                                    "shape": {"heads": HEADS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM,
                                              "dtype": str(DTYPE)}, "rows": rows})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
