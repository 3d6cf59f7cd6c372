"""Multi-LoRA throughput: a batch of 16 requests spread over 4 adapters against the same batch on a server
without adapters, on the embedded SmolLM2 (its Q4_1 GGUF blocks; the adapters in float32).

    python -m bench.lora [--quick] [--rank 16]

The 4 adapters are made here by PEFT over transformers' SmolLM2 (random A and B, every attention and MLP
projection, rank ``--rank``). Each configuration runs in its own child process, turns alternated, best
of ``--turns``: ``base`` (a server without --enable-lora: the fused CPU decode step), ``lora`` (the
same requests, 4 per adapter, on a server with the 4 adapters) and ``lora-idle`` (a LoRA server given
requests without adapters: what enabling LoRA costs requests that use none). Prints output tokens/s
and the ratio to ``base`` (goal: lora >= 0.7x).
"""
from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import random
import tempfile
import time

import torch

from bench.common import load_hf, threads, write_result

NUM_REQUESTS = 16
NUM_ADAPTERS = 4
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapters(folder: str, root: str, rank: int) -> list[str]:
    from peft import LoraConfig, get_peft_model
    paths = []
    for i in range(NUM_ADAPTERS):
        torch.manual_seed(i)
        model = get_peft_model(load_hf(folder), LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=TARGETS,
                                                           init_lora_weights=False))
        path = os.path.join(root, f"adapter{i}")
        model.save_pretrained(path)
        paths.append(f"adapter{i}={path}")
    return paths


def _serve(kind: str, lora_paths: list[str], prompts: list[list[int]], new_tokens: int, conn) -> None:
    """Child process: one timed batch on a fresh Engine (after a warm-up batch); sends output tokens/s."""
    from radixlang import Engine
    opts = {"lora_paths": lora_paths} if kind != "base" else {}
    adapters = ([f"adapter{i % NUM_ADAPTERS}" for i in range(len(prompts))] if kind == "lora"
                else [None] * len(prompts))
    params = {"temperature": 0, "max_new_tokens": new_tokens, "ignore_eos": True}
    with Engine(num_threads=threads(), disable_radix_cache=True, **opts) as engine:
        async def batch() -> int:
            outs = await asyncio.gather(*(engine.async_generate(input_ids=p, sampling_params=params, lora_path=a)
                                          for p, a in zip(prompts, adapters)))
            return sum(len(o["output_ids"]) for o in outs)
        asyncio.run(batch())  # warm-up: kernels, allocator
        start = time.perf_counter()
        tokens = asyncio.run(batch())
        conn.send(tokens / (time.perf_counter() - start))
    conn.close()


def _run(kind: str, lora_paths: list[str], prompts: list[list[int]], new_tokens: int) -> float:
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_serve, args=(kind, lora_paths, prompts, new_tokens, child))
    proc.start()
    child.close()  # the child's end: a child that dies before sending ends recv with EOFError
    try:
        result = parent.recv()
    except EOFError:
        raise RuntimeError(f"the {kind} run failed (exit code {proc.join() or proc.exitcode}); see its output above")
    proc.join()
    return result


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--turns", type=int, default=None)
    args = ap.parse_args()
    from radixlang.runtime.models.loader.model_loader import resolve_model_dir
    folder = resolve_model_dir(None)
    rng = random.Random(0)
    new_tokens = 32 if args.quick else 64
    prompts = [[rng.randrange(200, 40000) for _ in range(rng.randrange(64, 129))] for _ in range(NUM_REQUESTS)]
    turns = args.turns or (1 if args.quick else 3)
    with tempfile.TemporaryDirectory() as root:
        lora_paths = make_adapters(folder, root, args.rank)
        best: dict[str, float] = {}
        for _ in range(turns):
            for kind in ("base", "lora", "lora-idle"):
                best[kind] = max(best.get(kind, 0.0), _run(kind, lora_paths, prompts, new_tokens))
    print(f"{NUM_REQUESTS} requests x {new_tokens} tokens over {NUM_ADAPTERS} adapters of rank {args.rank}, "
          f"{threads()} threads, best of {turns}")
    for kind, tps in best.items():
        print(f"  {kind:10s} {tps:8.1f} output tok/s  {tps / best['base']:.2f}x base")
    write_result("lora", {"rank": args.rank, "requests": NUM_REQUESTS, "adapters": NUM_ADAPTERS,
                          "new_tokens": new_tokens, "turns": turns, "tok_s": best,
                          "ratio": {k: v / best["base"] for k, v in best.items()}})


if __name__ == "__main__":
    main()
