"""Engine throughput against transformers `generate` on the same SmolLM2 weights and threads.

    python -m bench.engine_throughput [--quick]

Prints ratios measured in this run: batch-1 greedy decode tokens/s, 32 mixed-length
concurrent requests against transformers doing them one by one, prefill tokens/s on
a 1,000-token prompt, the machine's copy bandwidth, and the batch-1 decode step as a
multiple of the physical floor (weights bytes / bandwidth). Then the same three runs with
``quantization="int8"`` (weight-only) and ``dtype="bfloat16"``, both lossy, against the same fp32
baseline, with how many greedy tokens each keeps equal to fp32's.
"""
from __future__ import annotations

import argparse
import random

import torch

from bench.common import copy_bandwidth_gbs, hf_generate, load_hf, threads, timed, write_result
from radixlang import Engine
from radixlang.runtime.models.loader import resolve_model_dir


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(threads())
    folder = resolve_model_dir(None)
    new_tokens = 32 if args.quick else 64
    rng = random.Random(0)
    engine = Engine(max_total_tokens=32768, num_threads=threads())
    tok = engine.tokenizer
    hf = load_hf(folder)
    prompt = tok.encode("The history of the printing press begins", add_special_tokens=False)
    greedy = {"temperature": 0, "max_new_tokens": new_tokens, "ignore_eos": True}

    # batch-1 decode
    engine.generate(input_ids=prompt, sampling_params={**greedy, "max_new_tokens": 4})  # warm up
    out, t_ours = timed(engine.generate, input_ids=prompt, sampling_params=greedy)
    _, t_pre = timed(engine.generate, input_ids=prompt, sampling_params={**greedy, "max_new_tokens": 1})
    ours_b1 = (new_tokens - 1) / max(t_ours - t_pre, 1e-9)
    hf_generate(hf, prompt, 4)
    n_hf, t_hf = timed(hf_generate, hf, prompt, new_tokens)
    _, t_hf_pre = timed(hf_generate, hf, prompt, 1)
    hf_b1 = (n_hf - 1) / max(t_hf - t_hf_pre, 1e-9)
    step_s = 1.0 / ours_b1

    # 32 mixed-length concurrent requests vs transformers one by one (rate measured on a subset)
    prompts = [[rng.randrange(200, 40000) for _ in range(rng.randrange(16, 256))] for _ in range(32)]
    batch_params = {"temperature": 0, "max_new_tokens": new_tokens, "ignore_eos": True}
    _, t_batch = timed(engine.generate, input_ids=prompts, sampling_params=batch_params)
    ours_batch = 32 * new_tokens / t_batch
    subset = prompts[:4 if args.quick else 8]
    t_hf_seq = sum(timed(hf_generate, hf, p, new_tokens)[1] for p in subset)
    hf_seq = len(subset) * new_tokens / t_hf_seq

    # prefill of a 1,000-token prompt
    long_prompt = [rng.randrange(200, 40000) for _ in range(1000)]
    engine.flush_cache()
    _, t_fill = timed(engine.generate, input_ids=long_prompt, sampling_params={"max_new_tokens": 1})
    with torch.no_grad():
        _, t_hf_fill = timed(hf, torch.tensor([long_prompt]))

    bw = copy_bandwidth_gbs()
    weight_bytes = sum(p.numel() * p.element_size() for p in engine.scheduler.runner.model.parameters())
    floor_s = weight_bytes / (bw * 1e9 / 2)  # a step reads every weight once: read bandwidth ~ copy / 2
    rows = {
        "decode_batch1_tok_s": {"radixlang": ours_b1, "transformers": hf_b1, "ratio": ours_b1 / hf_b1},
        "batch32_tok_s": {"radixlang": ours_batch, "transformers_sequential": hf_seq, "ratio": ours_batch / hf_seq},
        "prefill_1000_tok_s": {"radixlang": 1000 / t_fill, "transformers": 1000 / t_hf_fill,
                               "ratio": t_hf_fill / t_fill},
        "copy_bandwidth_gb_s": bw,
        "weights_mb": weight_bytes / 1e6,
        "decode_step_ms": step_s * 1e3,
        "decode_step_over_floor": step_s / floor_s,
    }
    engine.shutdown()

    # the same runs in the lossy fast modes, against the same fp32 baseline: weight-only int8, and
    # bfloat16 weights/activations/KV (fast on CPUs with AVX512-BF16 or AMX; slow elsewhere)
    variants = {"int8": {"quantization": "int8"}, "bf16": {"dtype": "bfloat16"}}
    for name, extra in variants.items():
        eng = Engine(max_total_tokens=32768, num_threads=threads(), **extra)
        eng.generate(input_ids=prompt, sampling_params={**greedy, "max_new_tokens": 4})
        out_v, t_v = timed(eng.generate, input_ids=prompt, sampling_params=greedy)
        _, t_v_pre = timed(eng.generate, input_ids=prompt, sampling_params={**greedy, "max_new_tokens": 1})
        v_b1 = (new_tokens - 1) / max(t_v - t_v_pre, 1e-9)
        _, t_v_batch = timed(eng.generate, input_ids=prompts, sampling_params=batch_params)
        eng.flush_cache()
        _, t_v_fill = timed(eng.generate, input_ids=long_prompt, sampling_params={"max_new_tokens": 1})
        eng.shutdown()
        same = next((i for i, (a, b) in enumerate(zip(out["output_ids"], out_v["output_ids"])) if a != b),
                    new_tokens)
        rows[f"{name}_decode_batch1_tok_s"] = {"radixlang": v_b1, "transformers": hf_b1, "ratio": v_b1 / hf_b1,
                                               "greedy_tokens_equal_to_fp32": same}
        rows[f"{name}_batch32_tok_s"] = {"radixlang": 32 * new_tokens / t_v_batch, "transformers_sequential": hf_seq,
                                         "ratio": 32 * new_tokens / t_v_batch / hf_seq}
        rows[f"{name}_prefill_1000_tok_s"] = {"radixlang": 1000 / t_v_fill, "transformers": 1000 / t_hf_fill,
                                              "ratio": t_hf_fill / t_v_fill}
    print(f"{'metric':28s} {'radixlang':>12s} {'transformers':>13s} {'ratio':>7s}")
    for k in [f"{v}{m}" for v in ("", *(f"{n}_" for n in variants))
              for m in ("decode_batch1_tok_s", "batch32_tok_s", "prefill_1000_tok_s")]:
        r = rows[k]
        base = r.get("transformers", r.get("transformers_sequential"))
        print(f"{k:28s} {r['radixlang']:12.1f} {base:13.1f} {r['ratio']:6.2f}x")
    print(f"copy bandwidth {bw:.1f} GB/s; weights {weight_bytes / 1e6:.0f} MB; batch-1 step "
          f"{step_s * 1e3:.1f} ms = {step_s / floor_s:.2f}x the floor ({floor_s * 1e3:.1f} ms)")
    for name in variants:
        same = rows[f"{name}_decode_batch1_tok_s"]["greedy_tokens_equal_to_fp32"]
        print(f"{name}: the first {same} of {new_tokens} greedy tokens equal fp32's")
    print("wrote", write_result("engine_throughput", rows))


if __name__ == "__main__":
    main()
