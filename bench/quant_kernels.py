"""Quantized linear kernels on the CPU: the float32-activation kernel against the int8-activation ones.

    python -m bench.quant_kernels [--threads 1] [--rows 1 4] [--repeats 5]

Random q4 weights (the embedded SmolLM2's Q4_1 layout, groups of 32) of its linear shapes: q/k/v and o
(576 x 576 each, fused qkv is 960 x 576), gate/up (1536 x 576), down (576 x 1536), the tied logits
(49152 x 576). All kernels run in one process, interleaved, best of --repeats; printed as microseconds
and as the speed-up over float32 activations (ratios are what compare on a shared machine). Needs a CPU
with AVX512-VNNI or AVX-VNNI for the int8 columns.
"""
from __future__ import annotations

import argparse
import time

import torch

from radixlang.kernels.cpu import quant as qk

SHAPES = [(576, 576), (1536, 576), (576, 1536), (49152, 576)]


def random_q4(n: int, k: int) -> qk.QuantWeight:
    g = torch.Generator().manual_seed(n + k)
    codes = torch.randint(0, 256, (n, k // 2), generator=g, dtype=torch.uint8)
    scales = torch.rand(n, k // 32, generator=g) * 0.02
    offsets = -torch.rand(n, k // 32, generator=g) * 0.1
    return qk.QuantWeight("q4", codes, scales, offsets, 32, n, k)


def best_us(fn, iters: int, repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(iters):
            fn()
        best = min(best, (time.perf_counter() - start) / iters)
    return best * 1e6


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    if not qk.available():
        print("quantized CPU kernels unavailable (no C compiler)")
        return 0
    torch.set_num_threads(args.threads)
    modes = list(qk.ACTIVATIONS) if qk.vnni() else ["float32"]
    print(f"VNNI: {qk.vnni()}; {args.threads} thread(s); speed-up over float32 activations, best of {args.repeats}")
    for n, k in SHAPES:
        w = random_q4(n, k)
        iters = max(3, int(1e7 / (n * k)))
        for m in args.rows:
            x = torch.randn(m, k)
            us = {}
            for mode in modes:  # each mode's best of the repeats, the modes interleaved by shape
                us[mode] = best_us(lambda mode=mode: qk.linear(x, w, activations=mode), iters, args.repeats)
            cols = "  ".join(f"{mode} {us['float32'] / t:4.2f}x" for mode, t in us.items() if mode != "float32")
            print(f"{n:>6} x {k:<5} rows {m:>2}: float32 {us['float32']:8.1f} us  {cols}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
