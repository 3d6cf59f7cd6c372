"""Shared helpers for the benchmarks: timing, the transformers baseline, result files."""
from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path

import torch

RESULTS = Path(__file__).parent / "results"


def threads() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def timed(fn, *args, **kwargs):
    t = time.perf_counter()
    out = fn(*args, **kwargs)
    return out, time.perf_counter() - t


def load_hf(folder: str):
    """transformers' model in float32 from a checkpoint folder, or, for a converted GGUF's folder (config and
    tokenizer only), from the GGUF file it names, through transformers' own GGUF loader."""
    from transformers import AutoModelForCausalLM

    from radixlang.runtime.models.loader.gguf_convert import gguf_of_folder
    gguf_path = gguf_of_folder(folder)
    if gguf_path is not None:
        return AutoModelForCausalLM.from_pretrained(os.path.dirname(gguf_path), gguf_file=os.path.basename(gguf_path),
                                                    dtype=torch.float32).eval()
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def hf_generate(model, ids: list[int], new_tokens: int) -> int:
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                             do_sample=False)
    return int(out.shape[1] - len(ids))


def model_weight_bytes(model) -> int:
    """Bytes of weights a decode step reads: every parameter, plus packed linears (runtime/models/packed.py)
    in place of the plain weights they replaced; with a packed copy of tied embeddings for the logits,
    that copy instead of the embedding table (a lookup reads one row of it). Quantized GGUF linears
    (runtime/models/gguf_quant.py) count their codes, scales and offsets, not the float32 copies they keep
    for prefills (a decode step never reads those)."""
    from radixlang.runtime.models.gguf_quant import QuantLinear
    from radixlang.runtime.models.layers.linear import Linear
    from radixlang.runtime.models.packed import PackedLinear
    quant = [m for m in model.modules() if isinstance(m, QuantLinear)]
    prefill_only = {id(m.dense) for m in quant if m.dense is not None}
    packed = [m for m in model.modules() if isinstance(m, PackedLinear) and id(m) not in prefill_only]
    skip = set()
    head = getattr(model, "lm_head", None)
    if isinstance(head, Linear) and head.kernel is not None:  # a Linear serves through its method's kernel
        head = head.kernel
    if isinstance(head, (PackedLinear, QuantLinear)) and getattr(model, "embed_tokens", None) is not None:
        skip.add(id(model.embed_tokens.weight))
    params = sum(p.numel() * p.element_size() for p in model.parameters() if id(p) not in skip)
    return params + sum(m.weight_bytes() for m in packed) + sum(m.weight_q.nbytes for m in quant)


def copy_bandwidth_gbs(num_bytes: int = 1 << 28, reps: int = 5) -> float:
    src = torch.empty(num_bytes // 4, dtype=torch.float32).fill_(1.0)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = min(timed(dst.copy_, src)[1] for _ in range(reps))
    return 2 * num_bytes / best / 1e9  # read + write


def read_bandwidth_gbs(num_bytes: int = 1 << 28, reps: int = 5) -> float:
    """How fast this machine's threads read memory: a sum over a tensor far larger than the caches
    (a decode step only reads its weights). Measured here: about the copy bandwidth's bytes per second,
    not half of it."""
    src = torch.empty(num_bytes // 4, dtype=torch.float32).fill_(1.0)
    src.sum()
    best = min(timed(src.sum)[1] for _ in range(reps))
    return num_bytes / best / 1e9


def write_result(name: str, data: dict) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    data = {"machine": {"cpu": platform.processor() or platform.machine(), "threads": threads(),
                        "torch": torch.__version__}, **data}
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(data, indent=2))
    return path
