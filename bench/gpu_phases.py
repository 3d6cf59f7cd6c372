"""The GPU check's phases (see bench/gpu_check.py for the order, caps and what each measures)."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from typing import Any

MODELS = {"accuracy": "llama3_8b_4l", "decode": "llama3_8b_32l", "throughput": "llama2_7b_32l"}
# a small config for --device cpu dry runs of the phases (same code paths, seconds on a CPU)
SMALL = dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
             num_hidden_layers=2)


# ---- models ----------------------------------------------------------------------------------------
def build_weights(bundle: str, name: str, out: str, device: str, *, small: bool = False, keep: bool = False):
    """Random weights drawn by transformers from the carried config, saved with save_pretrained (bf16 on CUDA,
    float32 on the CPU) beside the carried tokenizer. Returns (folder, the transformers model if keep)."""
    import shutil

    import torch
    from transformers import AutoConfig, LlamaForCausalLM

    src = os.path.join(bundle, "models", name)
    folder = os.path.join(out, "models", name + ("_small" if small else ""))
    config = AutoConfig.from_pretrained(src)
    if small:
        for k, v in SMALL.items():
            setattr(config, k, v)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(config).to(dtype)
    model.eval()
    if not os.path.exists(os.path.join(folder, "model.safetensors.index.json")) and \
            not os.path.exists(os.path.join(folder, "model.safetensors")):
        model.save_pretrained(folder, max_shard_size="4GB")
    for f in os.listdir(src):
        if f != "config.json":
            shutil.copy(os.path.join(src, f), os.path.join(folder, f))
    if not keep:
        del model
        if device == "cuda":
            torch.cuda.empty_cache()
        return folder, None
    return folder, model


def _engine(folder: str, device: str, **kw):
    from radixlang import Engine
    dtype = "bfloat16" if device == "cuda" else "float32"
    return Engine(model_path=folder, device=device, dtype=dtype, **kw)


# ---- phase: flashinfer warm-up ---------------------------------------------------------------------
def phase_flashinfer_warm(args) -> dict:
    """Compile (JIT) every FlashInfer kernel the later phases use by running each once on random pools."""
    import torch

    from radixlang.kernels.attention import create_attention_backend
    from radixlang.kernels.attention.base import ForwardMode
    from radixlang.runtime.mem_cache.memory_pool import ReqToTokenPool, TokenToKVPool
    from radixlang.runtime.model_executor.forward_batch import ForwardBatch

    class Layer:
        def __init__(self, heads, kv_heads, head_dim):
            self.layer_id, self.num_heads, self.num_kv_heads, self.head_dim = 0, heads, kv_heads, head_dim
            self.scaling = head_dim ** -0.5

    done = []
    shapes = [(32, 8, 128), (32, 32, 128), (4, 2, 64), (8, 2, 64), (2, 2, 64)]  # 8B, 7B, the CUDA tests
    for fi in ("fa2", "fa3"):
        for heads, kv_heads, head_dim in shapes:
            start = time.perf_counter()
            backend = create_attention_backend("flashinfer", num_heads=heads, num_kv_heads=kv_heads,
                                               head_dim=head_dim, device="cuda", dtype=torch.bfloat16,
                                               flashinfer_backend=fi)
            pool = TokenToKVPool(256, num_layers=1, num_kv_heads=kv_heads, head_dim=head_dim, dtype=torch.bfloat16,
                                 device="cuda")
            reqs = ReqToTokenPool(4, 128, "cuda")
            reqs.req_to_token[0, :40] = torch.arange(1, 41, dtype=torch.int32, device="cuda")
            reqs.req_to_token[1, :8] = torch.arange(41, 49, dtype=torch.int32, device="cuda")
            for mode, prefix, ext in ((ForwardMode.EXTEND, [30, 0], [10, 8]), (ForwardMode.DECODE, [39, 7], [1, 1])):
                n = sum(ext)
                seq = [p + e for p, e in zip(prefix, ext)]
                loc = torch.cat([reqs.req_to_token[i, p:p + e] for i, (p, e) in enumerate(zip(prefix, ext))])
                fb = ForwardBatch(forward_mode=mode, batch_size=2, input_ids=torch.zeros(n, dtype=torch.int64,
                                                                                         device="cuda"),
                                  positions=torch.zeros(n, dtype=torch.int64, device="cuda"),
                                  req_pool_indices=torch.tensor([0, 1], device="cuda"),
                                  seq_lens=torch.tensor(seq, device="cuda"), seq_lens_cpu=seq,
                                  extend_prefix_lens_cpu=prefix, extend_seq_lens_cpu=ext,
                                  out_cache_loc=loc.to(torch.int64), req_to_token=reqs.req_to_token,
                                  token_to_kv_pool=pool, attn_backend=backend)
                backend.init_forward_metadata(fb)
                q = torch.randn(n, heads, head_dim, device="cuda", dtype=torch.bfloat16)
                k = torch.randn(n, kv_heads, head_dim, device="cuda", dtype=torch.bfloat16)
                backend.forward(q, k, k.clone(), Layer(heads, kv_heads, head_dim), fb)
            torch.cuda.synchronize()
            done.append({"backend": fi, "shape": [heads, kv_heads, head_dim],
                         "seconds": round(time.perf_counter() - start, 1)})
    return {"ok": True, "compiled": done}


# ---- phase: pytest ---------------------------------------------------------------------------------
def phase_pytest(args) -> dict:
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "cuda", "-p", "no:cacheprovider", "tests/kernels",
           "tests/runtime", "-o", "addopts=", "--timeout", "80"]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    tail = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else proc.stderr[-400:]
    return {"ok": proc.returncode == 0, "summary": tail, "output_tail": proc.stdout[-3000:]}


# ---- phase: accuracy -------------------------------------------------------------------------------
def _teacher_forced_hf(model, prompts: list[list[int]], dtype) -> list[list[float]]:
    """logprob of every prompt token after the first, by transformers at ``dtype``."""
    import torch

    out = []
    for ids in prompts:
        x = torch.tensor([ids], device=model.device)
        with torch.inference_mode(), torch.autocast(x.device.type, enabled=False):
            logits = model.to(dtype)(x).logits[0].float()
        lp = torch.log_softmax(logits, -1)[:-1].gather(1, x[0, 1:, None]).squeeze(1)
        out.append(lp.tolist())
    return out


def _engine_teacher_forced(engine, prompts: list[list[int]], start: int) -> list[list[float]]:
    """The engine's logprobs of prompt tokens start + 1 .., the prompts submitted as one batch."""
    res = engine.generate(input_ids=prompts, sampling_params=[{"max_new_tokens": 1}] * len(prompts),
                          return_logprob=True, logprob_start_len=start)
    return [[lp[0] for lp in r["meta_info"]["input_token_logprobs"] if lp[0] is not None] for r in res]


def _errors(got: list[list[float]], ref: list[list[float]], starts: list[int]) -> tuple[float, float]:
    diffs = []
    for g, r, s in zip(got, ref, starts):
        r = r[s:]  # the engine scores tokens s + 1.. (token s is its first entry, without a logprob)
        g = g[-len(r):] if r else []
        diffs += [abs(a - b) for a, b in zip(g, r)]
    return (sum(diffs) / max(len(diffs), 1), max(diffs, default=0.0))


def phase_accuracy(args) -> dict:
    import random

    import torch

    device = args.device
    folder, hf = build_weights(args.bundle, MODELS["accuracy"], args.out, device, small=device == "cpu", keep=True)
    rng = random.Random(0)
    vocab = 49152  # the carried tokenizer's; the model's vocabulary is larger
    prefix = [rng.randrange(vocab) for _ in range(96)]
    # one batch: two prompts extend the cached 96-token prefix, three share nothing (no prefix: the case
    # FlashInfer once planned as one KV row); logprobs are compared from position 96 on
    prompts = [prefix + [rng.randrange(vocab) for _ in range(n)] for n in (40, 7)] + \
              [[rng.randrange(vocab) for _ in range(n)] for n in (220, 133, 109)]
    starts = [len(prefix)] * len(prompts)
    ref32 = _teacher_forced_hf(hf, prompts, torch.float32)
    ref16 = _teacher_forced_hf(hf, prompts, torch.bfloat16 if device == "cuda" else torch.float32)
    hf_mean, hf_max = _errors(ref16, ref32, starts)
    del hf
    if device == "cuda":
        torch.cuda.empty_cache()
    backends = [("torch", "auto"), ("triton", "auto"), ("flashinfer", "fa2"), ("flashinfer", "fa3")]
    if device == "cpu":
        backends = [("torch", "auto")]
    results: dict[str, Any] = {"hf_bf16_vs_fp32": {"mean": hf_mean, "max": hf_max}, "backends": {}}
    ok = True
    for name, fi in backends:
        label = name if name != "flashinfer" else f"flashinfer_{fi}"
        try:
            with _engine(folder, device, attention_backend=name, flashinfer_backend=fi, max_total_tokens=16384,
                         disable_cuda_graph=True) as eng:
                # warm the prefix into the cache, then the batch: two cached extends and three fresh prompts
                eng.generate(input_ids=prefix + [1], sampling_params={"max_new_tokens": 0})
                got = _engine_teacher_forced(eng, prompts, len(prefix))
                cached = eng.get_server_info()["cached_tokens"]
            mean, mx = _errors(got, ref32, starts)
            # tolerance: transformers' own bf16 error (2x, plus a floor for the float32 CPU run)
            passed = mean <= 2 * hf_mean + 1e-3 and mx <= 2 * hf_max + 1e-2 and cached >= 2 * len(prefix)
            results["backends"][label] = {"mean_err": mean, "max_err": mx, "cached_tokens": cached, "ok": passed}
            ok &= passed
        except Exception as e:  # noqa: BLE001 (a failing row or phase is reported, not raised)  # a backend that cannot run here fails its row, not the phase
            results["backends"][label] = {"ok": False, "error": f"{type(e).__name__}: {e}"[:500]}
            ok = False
    if device == "cuda":
        results["graph_vs_eager"] = {}
        for name in ("triton", "flashinfer"):
            try:
                ids = {}
                for graphs in (False, True):
                    with _engine(folder, device, attention_backend=name, max_total_tokens=16384,
                                 disable_cuda_graph=not graphs, cuda_graph_max_bs=16) as eng:
                        outs = eng.generate(input_ids=prompts, sampling_params={"temperature": 0, "max_new_tokens": 24,
                                                                                "ignore_eos": True})
                        ids[graphs] = [o["output_ids"] for o in outs]
                same = ids[True] == ids[False]
                results["graph_vs_eager"][name] = {"same_tokens": same}
                ok &= same
            except Exception as e:  # noqa: BLE001 (a failing row or phase is reported, not raised)
                results["graph_vs_eager"][name] = {"same_tokens": False, "error": f"{type(e).__name__}: {e}"[:500]}
                ok = False
    results["ok"] = ok
    return results


# ---- phase: decode and prefill speed ---------------------------------------------------------------
def _copy_bandwidth(device: str) -> float:
    import torch

    n = (2 << 30) if device == "cuda" else (256 << 20)
    a = torch.empty(n, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    b.copy_(a)
    _sync(device)
    start = time.perf_counter()
    for _ in range(5):
        b.copy_(a)
    _sync(device)
    return 2 * n * 5 / (time.perf_counter() - start)  # bytes read + written per second


def _sync(device: str) -> None:
    import torch
    if device == "cuda":
        torch.cuda.synchronize()


def _decode_tok_s(engine, bs: int, prompt_len: int, new_tokens: int) -> float:
    import random
    rng = random.Random(bs)
    prompts = [[rng.randrange(1000, 40000) for _ in range(prompt_len)] for _ in range(bs)]
    params = {"temperature": 0, "max_new_tokens": 1, "ignore_eos": True}
    engine.generate(input_ids=prompts, sampling_params=[params] * bs)  # prefill cached (and warm)
    t0 = time.perf_counter()
    engine.generate(input_ids=prompts, sampling_params=[{**params, "max_new_tokens": 1}] * bs)
    t_prefill_hit = time.perf_counter() - t0
    t0 = time.perf_counter()
    engine.generate(input_ids=prompts, sampling_params=[{**params, "max_new_tokens": new_tokens + 1}] * bs)
    dt = time.perf_counter() - t0 - t_prefill_hit
    return bs * new_tokens / max(dt, 1e-9)


def _hf_generate_tok_s(model, bs: int, prompt_len: int, new_tokens: int, device: str) -> float:
    import torch
    x = torch.randint(1000, 40000, (bs, prompt_len), device=device)
    kw = {"attention_mask": torch.ones_like(x), "pad_token_id": 0, "do_sample": False}
    with torch.inference_mode():
        model.generate(x, max_new_tokens=2, min_new_tokens=2, **kw)
        _sync(device)
        t0 = time.perf_counter()
        model.generate(x, max_new_tokens=1, min_new_tokens=1, **kw)
        _sync(device)
        t_first = time.perf_counter() - t0
        t0 = time.perf_counter()
        model.generate(x, max_new_tokens=new_tokens + 1, min_new_tokens=new_tokens + 1, **kw)
        _sync(device)
    return bs * new_tokens / max(time.perf_counter() - t0 - t_first, 1e-9)


def phase_decode(args) -> dict:
    import torch

    device = args.device
    small = device == "cpu"
    folder, hf = build_weights(args.bundle, MODELS["decode"], args.out, device, small=small, keep=True)
    batches = (1, 32, 256) if not small else (1, 4)
    new_tokens = 32 if not small else 4
    weight_bytes = sum(p.numel() * p.element_size() for p in hf.parameters())
    # a decode step reads every weight but the embedding table (only its rows for the batch's tokens)
    emb = hf.get_input_embeddings().weight
    read_bytes = weight_bytes - (emb.numel() * emb.element_size() if not hf.config.tie_word_embeddings else 0)
    bw = _copy_bandwidth(device)
    res: dict[str, Any] = {"weight_bytes": weight_bytes, "bytes_read_per_step": read_bytes,
                           "copy_bandwidth_GBps": bw / 1e9,
                           # one read of the weights per step (bw counts the bytes a copy moves)
                           "floor_tok_s_batch1": bw / read_bytes,
                           "transformers": {}, "engine": {}}
    for bs in batches:
        try:
            res["transformers"][bs] = _hf_generate_tok_s(hf, bs, 128, new_tokens, device)
        except Exception as e:  # noqa: BLE001 (a failing row or phase is reported, not raised)
            res["transformers"][bs] = f"{type(e).__name__}: {e}"[:300]
    del hf
    if device == "cuda":
        torch.cuda.empty_cache()
    backend = "flashinfer" if device == "cuda" else "torch"
    for graphs in ((False, True) if device == "cuda" else (False,)):
        key = "graphs" if graphs else "eager"
        with _engine(folder, device, attention_backend=backend, disable_cuda_graph=not graphs,
                     cuda_graph_max_bs=256, max_running_requests=256, max_total_tokens=256 * 256) as eng:
            res["engine"][key] = {bs: _decode_tok_s(eng, bs, 128, new_tokens) for bs in batches}
            if not graphs:
                import random
                rng = random.Random(1)
                n, plen = (8, 1024) if device == "cuda" else (2, 64)
                prompts = [[rng.randrange(1000, 40000) for _ in range(plen)] for _ in range(n)]
                eng.generate(input_ids=prompts[:1], sampling_params={"max_new_tokens": 1})
                eng.flush_cache()
                t0 = time.perf_counter()
                eng.generate(input_ids=prompts, sampling_params=[{"max_new_tokens": 1}] * n)
                res["engine"]["prefill_tok_s"] = n * plen / (time.perf_counter() - t0)
    hf_by_bs = res["transformers"]
    best = res["engine"].get("graphs", res["engine"]["eager"])
    res["ratios"] = {
        "batch1_vs_floor": best[batches[0]] / res["floor_tok_s_batch1"],
        **{f"batch{bs}_vs_transformers": best[bs] / hf_by_bs[bs] for bs in batches
           if isinstance(hf_by_bs.get(bs), float)},
    }
    if device == "cuda":
        res["batch1_itl_ms"] = 1000.0 / best[1]
        res["prefill_tflops"] = res["engine"]["prefill_tok_s"] * 2 * weight_bytes / 2 / 1e12
    res["ok"] = True
    if device == "cuda":  # 16 GB of safetensors: make room on the disk for the next phase's model
        import shutil
        shutil.rmtree(folder, ignore_errors=True)
    return res


# ---- phase: the Llama-2-7B serving shape -----------------------------------------------------------
def phase_throughput(args) -> dict:
    import random

    device = args.device
    small = device == "cpu"
    folder, _ = build_weights(args.bundle, MODELS["throughput"], args.out, device, small=small)
    n, plen, olen = (64, 128, 128) if not small else (4, 16, 8)
    rng = random.Random(2)
    prompts = [[rng.randrange(1000, 30000) for _ in range(plen)] for _ in range(n)]
    params = {"temperature": 0, "max_new_tokens": olen, "ignore_eos": True}
    backend = "flashinfer" if device == "cuda" else "torch"
    with _engine(folder, device, attention_backend=backend, cuda_graph_max_bs=64, max_total_tokens=64 * 512,
                 disable_radix_cache=True) as eng:
        eng.generate(input_ids=prompts[:2], sampling_params=[{**params, "max_new_tokens": 4}] * 2)
        t0 = time.perf_counter()
        outs = eng.generate(input_ids=prompts, sampling_params=[params] * n)
        dt = time.perf_counter() - t0
    out_tokens = sum(len(o["output_ids"]) for o in outs)
    return {"ok": out_tokens == n * olen, "requests": n, "input_len": plen, "output_len": olen,
            "output_tok_s": out_tokens / dt, "seconds": dt}
