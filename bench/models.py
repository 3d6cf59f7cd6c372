"""Each model family against transformers on the same random weights and threads.

    python -m bench.models [--quick] [--families qwen2,qwen3_moe,...]

Per family: a checkpoint saved by transformers' own class at a 0.5B-class shape (Qwen2.5-0.5B's
widths: hidden 896, 14 heads over 2 kv heads, MLP 4864; ``--quick``: 4 layers instead of 24), then
prefill tokens/s on a 512-token prompt and batch-1 greedy decode tokens/s; for the MoE families also
decode at batch 32 (32 equal-length prompts: transformers runs them as one padded-free batch). The
radixlang side is the Engine with its defaults (packed linears, CPU kernels); transformers runs in a
child process (see bench/engine_throughput.py for why), with the same thread count. Every timing is the
best of ``--repeats`` runs on both sides (default 3): on a shared machine the least disturbed run is the
measure, and one run alone swung the batch-32 ratios by 1.5x.
"""
from __future__ import annotations

import argparse
import multiprocessing
import random
import sys
import tempfile
from pathlib import Path

import torch

from bench.common import threads, timed, write_result

SHAPE = dict(hidden_size=896, intermediate_size=4864, num_attention_heads=14, num_key_value_heads=2, head_dim=64,
             vocab_size=49152, max_position_embeddings=4096, tie_word_embeddings=True)
MOE = dict(moe_intermediate_size=768, num_experts=16, num_experts_per_tok=4)
FAMILIES = {
    "llama": ("LlamaForCausalLM", {}),
    "qwen2": ("Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3ForCausalLM", {}),
    "mistral_sliding": ("MistralForCausalLM", dict(sliding_window=256)),
    "gemma2": ("Gemma2ForCausalLM", dict(sliding_window=256, query_pre_attn_scalar=64)),
    "gemma3": ("Gemma3ForCausalLM", dict(sliding_window=256, query_pre_attn_scalar=64)),
    "phi3": ("Phi3ForCausalLM", {}),
    "mixtral": ("MixtralForCausalLM", dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=1536)),
    "qwen2_moe": ("Qwen2MoeForCausalLM", dict(**MOE, shared_expert_intermediate_size=1536)),
    "qwen3_moe": ("Qwen3MoeForCausalLM", dict(**MOE, norm_topk_prob=True)),
}
PREFILL, NEW_TOKENS = 512, 32


def _save(folder: str, arch: str, overrides: dict, layers: int) -> str:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from tiny_model import save_tiny_hf_model
    return save_tiny_hf_model(folder, arch, **{**SHAPE, "num_hidden_layers": layers, **overrides})


def _best(repeats: int, fn, *args, **kwargs) -> float:
    """The shortest of ``repeats`` timed calls, in seconds."""
    return min(timed(fn, *args, **kwargs)[1] for _ in range(repeats))


def _hf_side(folder: str, long_prompt: list[int], prompt: list[int], batch: list[list[int]] | None,
             repeats: int, conn) -> None:
    from transformers import AutoModelForCausalLM
    torch.set_num_threads(threads())
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()

    def gen(ids: list[list[int]], n: int):
        with torch.no_grad():
            return hf.generate(torch.tensor(ids), attention_mask=torch.ones(len(ids), len(ids[0]), dtype=torch.long),
                               max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)

    gen([prompt], 2)
    with torch.no_grad():
        t_fill = _best(repeats, hf, torch.tensor([long_prompt]))
    t, t_pre = _best(repeats, gen, [prompt], NEW_TOKENS), _best(repeats, gen, [prompt], 1)
    out = {"prefill": PREFILL / t_fill, "b1": (NEW_TOKENS - 1) / max(t - t_pre, 1e-9)}
    if batch is not None:
        tb, tb_pre = _best(repeats, gen, batch, NEW_TOKENS), _best(repeats, gen, batch, 1)
        out["b32"] = len(batch) * (NEW_TOKENS - 1) / max(tb - tb_pre, 1e-9)
    conn.send(out)
    conn.close()


def _ours(folder: str, long_prompt: list[int], prompt: list[int], batch: list[list[int]] | None,
          repeats: int) -> dict:
    from radixlang import Engine
    greedy = {"temperature": 0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True}
    with Engine(model_path=folder, max_total_tokens=16384, num_threads=threads()) as eng:
        eng.generate(input_ids=prompt, sampling_params={**greedy, "max_new_tokens": 2})

        def run(ids, params: dict) -> float:  # an empty prefix cache each time: every prompt is computed
            eng.flush_cache()
            return timed(eng.generate, input_ids=ids, sampling_params=params)[1]

        t_fill = _best(repeats, run, long_prompt, {"max_new_tokens": 1})
        t, t_pre = _best(repeats, run, prompt, greedy), _best(repeats, run, prompt, {**greedy, "max_new_tokens": 1})
        out = {"prefill": PREFILL / t_fill, "b1": (NEW_TOKENS - 1) / max(t - t_pre, 1e-9)}
        if batch is not None:
            tb = _best(repeats, run, batch, greedy)
            tb_pre = _best(repeats, run, batch, {**greedy, "max_new_tokens": 1})
            out["b32"] = len(batch) * (NEW_TOKENS - 1) / max(tb - tb_pre, 1e-9)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="4 layers instead of 24")
    ap.add_argument("--families", default=",".join(FAMILIES))
    ap.add_argument("--repeats", type=int, default=3, help="each timing is the best of this many runs, both sides")
    args = ap.parse_args()
    layers = 4 if args.quick else 24
    rng = random.Random(0)
    long_prompt = [rng.randrange(200, 40000) for _ in range(PREFILL)]
    prompt = [rng.randrange(200, 40000) for _ in range(32)]
    batch = [[rng.randrange(200, 40000) for _ in range(32)] for _ in range(32)]
    ctx = multiprocessing.get_context("spawn")
    rows = {}
    print(f"{'family':16s} {'metric':12s} {'radixlang':>10s} {'transformers':>13s} {'ratio':>7s}")
    for name in args.families.split(","):
        arch, overrides = FAMILIES[name]
        moe = "experts" in "".join(overrides) or "moe" in name
        with tempfile.TemporaryDirectory() as tmp:
            folder = _save(tmp, arch, overrides, layers)
            ours = _ours(folder, long_prompt, prompt, batch if moe else None, args.repeats)
            recv, send = ctx.Pipe(duplex=False)
            child = ctx.Process(target=_hf_side, args=(folder, long_prompt, prompt, batch if moe else None,
                                                       args.repeats, send))
            child.start()
            hf = recv.recv()
            child.join()
        rows[name] = {k: {"radixlang": ours[k], "transformers": hf[k], "ratio": ours[k] / hf[k]} for k in ours}
        for k, r in rows[name].items():
            label = {"prefill": f"prefill_{PREFILL}", "b1": "decode_b1", "b32": "decode_b32"}[k]
            print(f"{name:16s} {label:12s} {r['radixlang']:10.1f} {r['transformers']:13.1f} {r['ratio']:6.2f}x",
                  flush=True)
    print("wrote", write_result("models_quick" if args.quick else "models", {"layers": layers, **rows}))


if __name__ == "__main__":
    main()
