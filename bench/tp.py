"""Tensor parallelism: tp=1 against tp=N on the same model and machine.

    python -m bench.tp [--tp-size 3] [--quick] [--model-path PATH --load-format dummy]

Measures, for tp=1 and then tp=N (N processes, gloo on the CPU, nccl on CUDA): batch-1 greedy
decode tokens/s, 16 concurrent requests' decode tokens/s, and prefill tokens/s on a 1,000-token
prompt; checks the greedy tokens agree; writes bench/results/tp.json. On the CPU the ranks of one
machine share its cores (each gets cores / N threads), so tp=N only pays off where the cores are
many and the all-reduce is cheap, or where the model does not fit one device.
The embedded SmolLM2 has 9 heads and 3 kv heads: N must be 3 or 9 for it.
"""
from __future__ import annotations

import argparse
import os
import random

from bench.common import timed, write_result
from radixlang import Engine


def measure(engine: Engine, new_tokens: int, prefill_len: int) -> dict:
    rng = random.Random(0)
    greedy = {"temperature": 0, "max_new_tokens": new_tokens, "ignore_eos": True}
    prompt = [rng.randrange(200, 40000) for _ in range(16)]
    engine.generate(input_ids=prompt, sampling_params={**greedy, "max_new_tokens": 4})  # warm up
    out, t_all = timed(engine.generate, input_ids=prompt, sampling_params=greedy)
    _, t_first = timed(engine.generate, input_ids=prompt, sampling_params={**greedy, "max_new_tokens": 1})
    batch = [[rng.randrange(200, 40000) for _ in range(rng.randrange(16, 64))] for _ in range(16)]
    _, t_batch = timed(engine.generate, input_ids=batch, sampling_params=greedy)
    long_prompt = [rng.randrange(200, 40000) for _ in range(prefill_len)]
    engine.flush_cache()
    _, t_fill = timed(engine.generate, input_ids=long_prompt, sampling_params={"max_new_tokens": 1})
    return {"decode_batch1_tok_s": (new_tokens - 1) / max(t_all - t_first, 1e-9),
            "batch16_tok_s": 16 * new_tokens / t_batch,
            f"prefill_{prefill_len}_tok_s": prefill_len / t_fill,
            "output_ids": out["output_ids"]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tp-size", type=int, default=3)
    ap.add_argument("--model-path", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    ap.add_argument("--load-format", default="auto")
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    new_tokens, prefill_len = (16, 500) if args.quick else (32, 1000)
    results = {}
    for tp in (1, args.tp_size):
        with Engine(model_path=args.model_path, load_format=args.load_format, max_total_tokens=8192,
                    tp_size=tp) as engine:
            results[f"tp{tp}"] = {"num_threads_per_rank": engine.server_args.num_threads,
                                  "device": engine.server_args.device,
                                  **measure(engine, new_tokens, prefill_len)}
    one, many = results["tp1"], results[f"tp{args.tp_size}"]
    same = one.pop("output_ids") == many.pop("output_ids")
    print(f"{'metric':24s} {'tp=1':>10s} {f'tp={args.tp_size}':>10s} {'ratio':>7s}")
    for key in (k for k in one if k.endswith("_tok_s")):
        print(f"{key:24s} {one[key]:10.1f} {many[key]:10.1f} {many[key] / one[key]:6.2f}x")
    print(f"greedy tokens equal: {same}; threads per rank: tp=1 {one['num_threads_per_rank']}, "
          f"tp={args.tp_size} {many['num_threads_per_rank']}")
    # other work on a shared machine moves absolute speeds: its load is kept beside them
    print("wrote", write_result("tp", {"tp_size": args.tp_size, "model": args.model_path or "SmolLM2-135M-Instruct",
                                       "greedy_tokens_equal": same, "load_average_1m": os.getloadavg()[0],
                                       **results}))


if __name__ == "__main__":
    main()
