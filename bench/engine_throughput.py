"""Engine throughput against transformers `generate` on the same SmolLM2 weights and threads.

    python -m bench.engine_throughput [--quick]

Prints ratios measured in this run: batch-1 greedy decode tokens/s, 32 mixed-length
concurrent requests against transformers doing them one by one, prefill tokens/s on
a 1,000-token prompt, the machine's copy and read bandwidths, and the batch-1 decode step as a
multiple of the physical floor (weights bytes / read bandwidth, a sum over a large tensor). The
default Engine serves the embedded GGUF's own Q4_1 / Q8_0 blocks (``--quantization gguf``); then the
same three runs with ``dtype="float32"`` (the same file dequantized), ``quantization="int8"``
(weight-only, lossy) and ``dtype="bfloat16"`` (lossy), with how many greedy tokens each keeps equal to
the default's. For each: the step time, the bytes of weights a step reads, the read bandwidth that
implies and its ratio to the machine's.

transformers runs in a child process: a second live OpenMP thread team in one process (the
Engine's scheduler thread next to a main thread that ran transformers) makes libgomp stop
spinning between parallel regions, which slowed small matmuls up to 2x for whichever side ran
(measured); separate processes measure each system on its own.
"""
from __future__ import annotations

import argparse
import multiprocessing
import random

import torch

from bench.common import (copy_bandwidth_gbs, hf_generate, load_hf, model_weight_bytes, read_bandwidth_gbs, threads,
                          timed, write_result)
from radixlang import Engine
from radixlang.runtime.models.loader.model_loader import resolve_model_dir


def _transformers_baseline(folder: str, prompt: list[int], new_tokens: int, subset: list[list[int]],
                           long_prompt: list[int], conn) -> None:
    """Child process: the copy and read bandwidths and transformers' three measures, sent back on conn."""
    torch.set_num_threads(threads())
    bw, read_bw = copy_bandwidth_gbs(), read_bandwidth_gbs()
    hf = load_hf(folder)
    hf_generate(hf, prompt, 4)
    n_hf, t_hf = timed(hf_generate, hf, prompt, new_tokens)
    _, t_hf_pre = timed(hf_generate, hf, prompt, 1)
    t_hf_seq = sum(timed(hf_generate, hf, p, new_tokens)[1] for p in subset)
    with torch.no_grad():
        _, t_hf_fill = timed(hf, torch.tensor([long_prompt]))
    conn.send({"bw": bw, "read_bw": read_bw, "b1": (n_hf - 1) / max(t_hf - t_hf_pre, 1e-9),
               "seq": len(subset) * new_tokens / t_hf_seq, "fill_s": t_hf_fill})
    conn.close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    folder = resolve_model_dir(None)
    new_tokens = 32 if args.quick else 64
    rng = random.Random(0)
    greedy = {"temperature": 0, "max_new_tokens": new_tokens, "ignore_eos": True}
    prompts = [[rng.randrange(200, 40000) for _ in range(rng.randrange(16, 256))] for _ in range(32)]
    long_prompt = [rng.randrange(200, 40000) for _ in range(1000)]

    def measure(**extra) -> dict:
        """batch-1 decode, 32 mixed-length concurrent requests, a 1,000-token prefill; the engine's step."""
        eng = Engine(max_total_tokens=32768, num_threads=threads(), **extra)
        try:
            prompt = eng.tokenizer.encode("The history of the printing press begins", add_special_tokens=False)
            eng.generate(input_ids=prompt, sampling_params={**greedy, "max_new_tokens": 4})  # warm up
            out, t = timed(eng.generate, input_ids=prompt, sampling_params=greedy)
            _, t_pre = timed(eng.generate, input_ids=prompt, sampling_params={**greedy, "max_new_tokens": 1})
            _, t_batch = timed(eng.generate, input_ids=prompts, sampling_params=greedy)
            eng.flush_cache()
            _, t_fill = timed(eng.generate, input_ids=long_prompt, sampling_params={"max_new_tokens": 1})
            return {"prompt": prompt, "output_ids": out["output_ids"], "b1": (new_tokens - 1) / max(t - t_pre, 1e-9),
                    "batch": 32 * new_tokens / t_batch, "fill_s": t_fill,
                    "weight_bytes": model_weight_bytes(eng.scheduler.runner.model)}
        finally:
            eng.shutdown()

    ours = measure()
    prompt = ours["prompt"]
    # transformers, one request at a time (rate measured on a subset), in its own process
    subset = prompts[:4 if args.quick else 8]
    recv, send = multiprocessing.get_context("spawn").Pipe(duplex=False)
    child = multiprocessing.get_context("spawn").Process(
        target=_transformers_baseline, args=(folder, prompt, new_tokens, subset, long_prompt, send))
    child.start()
    hf = recv.recv()
    child.join()
    hf_b1, hf_seq, t_hf_fill, bw, read_bw = hf["b1"], hf["seq"], hf["fill_s"], hf["bw"], hf["read_bw"]

    step_s = 1.0 / ours["b1"]
    weight_bytes = ours["weight_bytes"]
    floor_s = weight_bytes / (read_bw * 1e9)  # a step reads every weight once
    rows = {
        "decode_batch1_tok_s": {"radixlang": ours["b1"], "transformers": hf_b1, "ratio": ours["b1"] / hf_b1},
        "batch32_tok_s": {"radixlang": ours["batch"], "transformers_sequential": hf_seq,
                          "ratio": ours["batch"] / hf_seq},
        "prefill_1000_tok_s": {"radixlang": 1000 / ours["fill_s"], "transformers": 1000 / t_hf_fill,
                               "ratio": t_hf_fill / ours["fill_s"]},
        "copy_bandwidth_gb_s": bw,
        "read_bandwidth_gb_s": read_bw,
        "weights_mb": weight_bytes / 1e6,
        "decode_step_ms": step_s * 1e3,
        "decode_step_over_floor": step_s / floor_s,
    }

    # the same runs in the lossy fast modes, against the same fp32 baseline: weight-only int8, and
    # bfloat16 weights/activations (fast on CPUs with AVX512-BF16 or AMX; slow elsewhere)
    variants = {"fp32": {"dtype": "float32"}, "int8": {"quantization": "int8"}, "bf16": {"dtype": "bfloat16"}}
    steps = {"gguf": (step_s, weight_bytes)}
    for name, extra in variants.items():
        v = measure(**extra)
        steps[name] = (1.0 / v["b1"], v["weight_bytes"])
        same = next((i for i, (a, b) in enumerate(zip(ours["output_ids"], v["output_ids"])) if a != b), new_tokens)
        rows[f"{name}_decode_batch1_tok_s"] = {"radixlang": v["b1"], "transformers": hf_b1, "ratio": v["b1"] / hf_b1,
                                               "greedy_tokens_equal_to_default": same}
        rows[f"{name}_batch32_tok_s"] = {"radixlang": v["batch"], "transformers_sequential": hf_seq,
                                         "ratio": v["batch"] / hf_seq}
        rows[f"{name}_prefill_1000_tok_s"] = {"radixlang": 1000 / v["fill_s"], "transformers": 1000 / t_hf_fill,
                                              "ratio": t_hf_fill / v["fill_s"]}
    print(f"{'metric':28s} {'radixlang':>12s} {'transformers':>13s} {'ratio':>7s}")
    for k in [f"{v}{m}" for v in ("", *(f"{n}_" for n in variants))
              for m in ("decode_batch1_tok_s", "batch32_tok_s", "prefill_1000_tok_s")]:
        r = rows[k]
        base = r.get("transformers", r.get("transformers_sequential"))
        print(f"{k:28s} {r['radixlang']:12.1f} {base:13.1f} {r['ratio']:6.2f}x")
    print(f"copy bandwidth {bw:.1f} GB/s (read + write), read bandwidth {read_bw:.1f} GB/s; weights "
          f"{weight_bytes / 1e6:.0f} MB; batch-1 step {step_s * 1e3:.1f} ms = {step_s / floor_s:.2f}x the floor "
          f"({floor_s * 1e3:.1f} ms)")
    for name in variants:
        same = rows[f"{name}_decode_batch1_tok_s"]["greedy_tokens_equal_to_default"]
        print(f"{name}: the first {same} of {new_tokens} greedy tokens equal the default (gguf) path's")
    print(f"{'decode step (batch 1)':22s} {'step ms':>8s} {'MB read':>8s} {'GB/s':>7s} {'of machine':>10s}")
    for name, (step, nbytes) in steps.items():
        gbs = nbytes / step / 1e9
        rows[f"{name}_step"] = {"step_ms": step * 1e3, "weight_mb": nbytes / 1e6, "read_gb_s": gbs,
                                "fraction_of_read_bandwidth": gbs / read_bw}
        print(f"{name:22s} {step * 1e3:8.2f} {nbytes / 1e6:8.1f} {gbs:7.1f} {gbs / read_bw:9.2f}x")
    print("wrote", write_result("engine_throughput", rows))


if __name__ == "__main__":
    main()
