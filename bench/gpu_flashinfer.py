"""The GPU check's FlashInfer part: its kernels compiled in the background from the start (one process per
fa2 / fa3, each in its own process group), and its rows, run at the end only for the variants whose kernels
compiled in time (see bench/gpu_check.py)."""
from __future__ import annotations

import json
import os
import time

from bench.gpu_phases import MODELS, Record, accuracy_row, copy_bandwidth, error_text, graph_row, reference, speed_rows

# (heads, kv heads, head dim) of the shapes the rows run: the dense accuracy shape, then the Llama-2-7B shape
WARM_SHAPES = {"dense": (16, 8, 128), "perf": (32, 32, 128)}


def _layer(heads: int, kv_heads: int, head_dim: int):
    class Layer:
        layer_id, num_heads, num_kv_heads = 0, heads, kv_heads

    Layer.head_dim, Layer.scaling = head_dim, head_dim ** -0.5
    return Layer()


def compile_shape(fi: str, heads: int, kv_heads: int, head_dim: int) -> None:
    """Run FlashInfer's extend (ragged + paged prefix) and decode once on random pools: its JIT compiles and
    caches every module the engine will load for this shape."""
    import torch

    from radixlang.kernels.attention import create_attention_backend
    from radixlang.kernels.attention.base import ForwardMode
    from radixlang.runtime.mem_cache.memory_pool import ReqToTokenPool, TokenToKVPool
    from radixlang.runtime.model_executor.forward_batch import ForwardBatch

    dev = "cuda"
    backend = create_attention_backend("flashinfer", num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
                                       device=dev, dtype=torch.bfloat16, flashinfer_backend=fi)
    pool = TokenToKVPool(256, num_layers=1, num_kv_heads=kv_heads, head_dim=head_dim, dtype=torch.bfloat16,
                         device=dev)
    reqs = ReqToTokenPool(4, 128, dev)
    reqs.req_to_token[0, :40] = torch.arange(1, 41, dtype=torch.int32, device=dev)
    reqs.req_to_token[1, :8] = torch.arange(41, 49, dtype=torch.int32, device=dev)
    for mode, prefix, ext in ((ForwardMode.EXTEND, [30, 0], [10, 8]), (ForwardMode.DECODE, [39, 7], [1, 1])):
        n = sum(ext)
        seq = [p + e for p, e in zip(prefix, ext)]
        loc = torch.cat([reqs.req_to_token[i, p:p + e] for i, (p, e) in enumerate(zip(prefix, ext))])
        fb = ForwardBatch(forward_mode=mode, batch_size=2, input_ids=torch.zeros(n, dtype=torch.int64, device=dev),
                          positions=torch.zeros(n, dtype=torch.int64, device=dev),
                          req_pool_indices=torch.tensor([0, 1], device=dev), seq_lens=torch.tensor(seq, device=dev),
                          seq_lens_cpu=seq, extend_prefix_lens_cpu=prefix, extend_seq_lens_cpu=ext,
                          out_cache_loc=loc.to(torch.int64), req_to_token=reqs.req_to_token, token_to_kv_pool=pool,
                          attn_backend=backend)
        backend.init_forward_metadata(fb)
        q = torch.randn(n, heads, head_dim, device=dev, dtype=torch.bfloat16)
        k = torch.randn(n, kv_heads, head_dim, device=dev, dtype=torch.bfloat16)
        backend.forward(q, k, k.clone(), _layer(heads, kv_heads, head_dim), fb)
    torch.cuda.synchronize()


def phase_flashinfer_warm(args, rec: Record) -> None:
    """Compile one FlashInfer variant (``args.fi``) for every shape the rows run, in the rows' order."""
    if args.device != "cuda":
        rec.update(ok=False, skipped="FlashInfer needs CUDA")
        return
    from radixlang.kernels.attention.flashinfer_probe import flashinfer_status
    status = flashinfer_status()
    rec["status"] = status.reason
    if not status.usable:
        rec["ok"] = False
        return
    rec["compiled"] = []
    for key, shape in WARM_SHAPES.items():
        start = time.perf_counter()
        compile_shape(args.fi, *shape)
        rec["compiled"].append({"shape": key, "dims": list(shape), "seconds": round(time.perf_counter() - start, 1)})
        rec.save()
    rec["ok"] = True


def _warm(args, fi: str) -> dict:
    path = os.path.join(args.out, f"phase_flashinfer_warm_{fi}.json")
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        return json.load(f)


def phase_flashinfer(args, rec: Record) -> None:
    """(c) FlashInfer rows for each variant whose kernels compiled in time: accuracy on the dense shape, then
    graphs == eager, then the speed rows on the 7B shape (where its kernels for that shape compiled)."""
    if args.device != "cuda":
        rec.update(ok=True, skipped="FlashInfer needs CUDA")
        return
    ready = {fi: _warm(args, fi) for fi in ("fa2", "fa3")}
    rec["compiled"] = {fi: [c["shape"] for c in w.get("compiled", [])] for fi, w in ready.items()}
    rows = rec.setdefault("rows", {})
    usable = [fi for fi in ("fa2", "fa3") if "dense" in rec["compiled"][fi]]
    if not usable:
        rec.update(ok=False, error="no FlashInfer variant compiled in time: " +
                   "; ".join(f"{fi}: {w.get('status') or w.get('error') or 'not finished'}" for fi, w in ready.items()))
        return
    ref = reference(args, MODELS["dense"])
    eager: dict[str, list] = {}
    for fi in usable:
        try:
            rows[f"dense/flashinfer_{fi}"] = accuracy_row(args, ref, "flashinfer", eager.setdefault(fi, []),
                                                          flashinfer_backend=fi)
        except Exception as e:  # noqa: BLE001 (a failing row is reported, not raised)
            rows[f"dense/flashinfer_{fi}"] = {"ok": False, "error": error_text(e)}
        rec.save()
    fi = usable[-1]  # fa3 where it compiled (the Hopper default), else fa2
    try:
        rows[f"dense/flashinfer_{fi} graphs==eager"] = graph_row(args, ref, "flashinfer", eager.get(fi, []),
                                                                 flashinfer_backend=fi)
    except Exception as e:  # noqa: BLE001 (a failing row is reported, not raised)
        rows[f"dense/flashinfer_{fi} graphs==eager"] = {"ok": False, "error": error_text(e)}
    rec.save()
    rec["ok"] = all(r.get("ok") for r in rows.values())
    if "perf" in rec["compiled"][fi]:
        try:
            speed_rows(args, rec, "flashinfer", f"flashinfer_{fi}", copy_bandwidth(args.device),
                       flashinfer_backend=fi)
        except Exception as e:  # noqa: BLE001 (a failing row is reported, not raised)
            rec[f"flashinfer_{fi}"] = {"ok": False, "error": error_text(e)}
        rec["ok"] = rec["ok"] and bool(rec[f"flashinfer_{fi}"].get("ok"))
