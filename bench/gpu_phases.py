"""The GPU check's phases (bench/gpu_check.py runs each in a process group of its own, with a cap).

Every phase writes ``OUT/phase_NAME.json`` after each row it finishes (``Record``), so a phase killed at
its cap still leaves the figures it had. Imports of torch, transformers and radixlang happen inside the
phases: the driver stays stdlib-only.
"""
from __future__ import annotations

import json
import os
import random
import shutil
import time
from typing import Any

# the carried configs (bench/prepare_gpu_bundle.py CONFIGS): a small dense and a small MoE shape for accuracy,
# the Llama-2-7B shape for speed
MODELS = {"dense": "dense_4l", "moe": "moe_4l", "perf": "llama2_7b_32l"}
# --device cpu: the same code paths on small shapes (seconds on 2 cores, the Triton kernels interpreted)
# (a larger initializer range keeps attention and logits as far from uniform as the full shapes' 0.02 does)
SMALL = {"dense_4l": dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
                          num_hidden_layers=2, initializer_range=0.08),
         "moe_4l": dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
                        num_hidden_layers=2, num_local_experts=4, initializer_range=0.1),
         "llama2_7b_32l": dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=4,
                               num_hidden_layers=2)}
TOKENIZER_VOCAB = 49152  # the carried SmolLM2 tokenizer's; prompts stay below every model's vocabulary


class Record(dict):
    """A phase's figures, rewritten to its JSON file at every ``save`` (a killed phase keeps what it had)."""

    def __init__(self, path: str) -> None:
        super().__init__()
        self.path = path
        self.start = time.perf_counter()

    def save(self) -> None:
        self["seconds"] = round(time.perf_counter() - self.start, 1)
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(self, f, indent=1, default=str)
        os.replace(tmp, self.path)


def error_text(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"[:500]


# ---- models ----------------------------------------------------------------------------------------
def model_folder(args, name: str) -> str:
    """OUT/models/NAME: the carried config (shrunk on the CPU) and the tokenizer; no weights yet."""
    small = args.device == "cpu"
    folder = os.path.join(args.out, "models", name + ("_small" if small else ""))
    if os.path.exists(os.path.join(folder, "config.json")):
        return folder
    os.makedirs(folder, exist_ok=True)
    src = os.path.join(args.bundle, "models", name)
    tok = os.path.join(args.bundle, "tokenizer")
    if os.path.exists(os.path.join(src, "config.json")):
        with open(os.path.join(src, "config.json")) as f:
            config = json.load(f)
    else:  # no bundle (a CPU run of the check): the configs it would carry, the embedded model's tokenizer
        from bench.prepare_gpu_bundle import model_config
        from radixlang.runtime.models.loader.model_loader import resolve_model_dir
        config = model_config(name)
        tok = resolve_model_dir(None)
    if small:
        config.update(SMALL[name])
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    from bench.prepare_gpu_bundle import TOKENIZER_FILES
    for t in TOKENIZER_FILES:
        if os.path.exists(os.path.join(tok, t)):
            shutil.copy(os.path.join(tok, t), os.path.join(folder, t))
    return folder


def hf_weights(args, name: str):
    """Random weights drawn by transformers on the device (bf16 on CUDA, float32 on the CPU), saved into the
    model folder with save_pretrained for the engine to load. Returns (folder, the transformers model)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    folder = model_folder(args, name)
    config = AutoConfig.from_pretrained(folder)
    torch.manual_seed(0)
    with torch.device(args.device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.eval()
    if args.device == "cuda":
        model = model.to(torch.bfloat16)
    if not any(f.endswith(".safetensors") for f in os.listdir(folder)):
        model.save_pretrained(folder)
    return folder, model


def device_random_weights(device: str):
    """loader.random_weights drawn on ``device``: the 7B shape's ~7e9 numbers take a minute on the host."""
    import torch

    from radixlang.runtime.models.loader import model_loader as loader

    def weights(config: Any, seed: int):
        with torch.device("meta"):
            model = loader.model_class(config)(config, device="meta")
        gen = torch.Generator(device=device).manual_seed(seed)
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                yield name, torch.ones(p.shape, device=device)
                continue
            t = torch.randn(p.shape, generator=gen, device=device, dtype=torch.bfloat16) * 0.02
            prefix = name.rpartition(".")[0]
            if prefix.endswith((".qkv_proj", ".gate_up_proj")):
                owner = model.get_submodule(prefix.rpartition(".")[0])
                yield from loader.unfused_pieces(name, t, getattr(owner, "q_size", 0),
                                                 getattr(owner, "kv_size", 0)) or []
            else:
                yield name, t
    return weights


def engine(args, folder: str, backend: str, **kw):
    from radixlang import Engine
    dtype = "bfloat16" if args.device == "cuda" else "float32"
    kw.setdefault("disable_cuda_graph", True)
    kw.setdefault("max_total_tokens", 16384)
    return Engine(model_path=folder, device=args.device, dtype=dtype, attention_backend=backend, **kw)


# ---- accuracy --------------------------------------------------------------------------------------
def accuracy_prompts(device: str) -> tuple[list[int], list[list[int]]]:
    """One batch: two prompts extend a cached prefix, three share nothing (no prefix: a case FlashInfer once
    planned as one KV row). Logprobs are compared from the prefix's end on."""
    rng = random.Random(0)
    n_prefix, extend, fresh = (96, (40, 7), (220, 133, 109)) if device == "cuda" else (24, (10, 5), (40, 30, 20))
    prefix = [rng.randrange(TOKENIZER_VOCAB) for _ in range(n_prefix)]
    prompts = [prefix + [rng.randrange(TOKENIZER_VOCAB) for _ in range(n)] for n in extend]
    prompts += [[rng.randrange(TOKENIZER_VOCAB) for _ in range(n)] for n in fresh]
    return prefix, prompts


def teacher_forced_hf(model, prompts: list[list[int]], dtype) -> list[list[float]]:
    """logprob of every prompt token after the first, by transformers at ``dtype``."""
    import torch

    out = []
    model = model.to(dtype)
    for ids in prompts:
        x = torch.tensor([ids], device=model.device)
        with torch.inference_mode():
            logits = model(x).logits[0].float()
        lp = torch.log_softmax(logits, -1)[:-1].gather(1, x[0, 1:, None]).squeeze(1)
        out.append(lp.tolist())
    return out


def reference(args, name: str) -> dict:
    """transformers' float32 log-probabilities of the accuracy batch and its own bf16-vs-fp32 error (the
    tolerance), computed once per shape and kept in OUT for the FlashInfer rows."""
    import torch

    path = os.path.join(args.out, f"reference_{name}.json")
    if os.path.exists(path):
        with open(path) as f:
            return json.load(f)
    folder, hf = hf_weights(args, name)
    prefix, prompts = accuracy_prompts(args.device)
    ref32 = teacher_forced_hf(hf, prompts, torch.float32)
    ref16 = teacher_forced_hf(hf, prompts, torch.bfloat16) if args.device == "cuda" else ref32
    start = len(prefix)
    hf_mean, hf_max = errors(ref16, ref32, start)
    del hf
    if args.device == "cuda":
        torch.cuda.empty_cache()
    ref = {"folder": folder, "prefix": prefix, "prompts": prompts, "ref32": ref32,
           "hf_bf16_vs_fp32": {"mean": hf_mean, "max": hf_max}}
    with open(path, "w") as f:
        json.dump(ref, f)
    return ref


def errors(got: list[list[float]], ref: list[list[float]], start: int) -> tuple[float, float]:
    diffs = []
    for g, r in zip(got, ref):
        r = r[start:]  # the engine scores tokens start + 1.. (token start is its first entry, without a logprob)
        g = g[-len(r):] if r else []
        diffs += [abs(a - b) for a, b in zip(g, r)]
    return (sum(diffs) / max(len(diffs), 1), max(diffs, default=0.0))


def run_batch(eng, ref: dict, *, greedy: bool) -> tuple[list[list[float]], int, list[list[int]] | None]:
    """The accuracy batch on an engine: the prefix cached first, then the batch teacher-forced (its logprobs
    and the cached tokens), then, with ``greedy``, 24 greedy tokens of every prompt (the decode steps; 6 on
    the CPU)."""
    prefix, prompts, start = ref["prefix"], ref["prompts"], len(ref["prefix"])
    eng.generate(input_ids=prefix + [1], sampling_params={"max_new_tokens": 0})
    res = eng.generate(input_ids=prompts, sampling_params=[{"max_new_tokens": 1}] * len(prompts),
                       return_logprob=True, logprob_start_len=start)
    cached = eng.get_server_info()["cached_tokens"]
    got = [[lp[0] for lp in r["meta_info"]["input_token_logprobs"] if lp[0] is not None] for r in res]
    ids = None
    if greedy:
        n = 24 if eng.server_args.device == "cuda" else 6  # the CPU runs the Triton kernels interpreted
        outs = eng.generate(input_ids=prompts, sampling_params={"temperature": 0, "max_new_tokens": n,
                                                                "ignore_eos": True})
        ids = [o["output_ids"] for o in outs]
    return got, cached, ids


def accuracy_row(args, ref: dict, backend: str, eager_ids: list | None = None, **kw) -> dict:
    """One backend (decode eager) against transformers; ``eager_ids`` (a list) receives its greedy tokens."""
    with engine(args, ref["folder"], backend, **kw) as eng:
        got, cached, ids = run_batch(eng, ref, greedy=eager_ids is not None)
    if eager_ids is not None and ids is not None:
        eager_ids.extend(ids)
    mean, mx = errors(got, ref["ref32"], len(ref["prefix"]))
    hf = ref["hf_bf16_vs_fp32"]
    # tolerance: transformers' own bf16 error (2x, plus a floor for the float32 CPU run)
    passed = mean <= 2 * hf["mean"] + 1e-3 and mx <= 2 * hf["max"] + 1e-2 and cached >= 2 * len(ref["prefix"])
    return {"mean_err": mean, "max_err": mx, "cached_tokens": cached, "ok": passed}


def graph_row(args, ref: dict, backend: str, eager_ids: list, **kw) -> dict:
    """The same run as the eager accuracy row's, decode in CUDA graphs: the same greedy tokens."""
    if not eager_ids:
        return {"ok": False, "error": "the eager row gave no tokens to compare with"}
    with engine(args, ref["folder"], backend, disable_cuda_graph=False, cuda_graph_max_bs=8, **kw) as eng:
        _, _, ids = run_batch(eng, ref, greedy=True)
    same = ids == eager_ids
    row: dict[str, Any] = {"ok": same, "same_tokens": same}
    if not same:  # (prompt, token) of the first difference
        row["first_difference"] = next(((i, j) for i, (a, b) in enumerate(zip(ids or [], eager_ids))
                                        for j in range(min(len(a), len(b))) if a[j] != b[j]), "lengths differ")
    if args.device != "cuda":
        row["note"] = "CPU: no CUDA graphs, both runs eager (the row's plumbing only)"
    return row


def phase_accuracy(args, rec: Record) -> None:
    """(a) triton and torch against transformers on the small dense and MoE shapes, then graphs == eager."""
    from radixlang.runtime.server_args import ServerArgs

    # what --attention-backend auto picks here (the start log of a server says why)
    rec["auto_attention_backend"] = ServerArgs(device=args.device).resolve().attention_backend
    if args.device == "cuda":
        from radixlang.kernels.attention.flashinfer_probe import flashinfer_status
        rec["flashinfer_status"] = flashinfer_status().reason
    rec["rows"] = {}
    rec["hf_bf16_vs_fp32"] = {}
    eager: dict[str, list] = {}
    for shape in ("dense", "moe"):
        ref = reference(args, MODELS[shape])
        rec["hf_bf16_vs_fp32"][shape] = ref["hf_bf16_vs_fp32"]
        for backend in ("triton", "torch"):
            key = f"{shape}/{backend}"
            try:
                ids = eager.setdefault(shape, []) if backend == "triton" else None
                rec["rows"][key] = accuracy_row(args, ref, backend, ids)
            except Exception as e:  # noqa: BLE001 (a failing row is reported, not raised)
                rec["rows"][key] = {"ok": False, "error": error_text(e)}
            rec.save()
    for shape in ("dense", "moe"):
        key = f"{shape}/triton graphs==eager"
        try:
            rec["rows"][key] = graph_row(args, reference(args, MODELS[shape]), "triton", eager.get(shape, []))
        except Exception as e:  # noqa: BLE001 (a failing row is reported, not raised)
            rec["rows"][key] = {"ok": False, "error": error_text(e)}
        rec.save()
    rec["ok"] = all(r.get("ok") for r in rec["rows"].values())


# ---- speed -----------------------------------------------------------------------------------------
def copy_bandwidth(device: str) -> float:
    """Bytes read + written per second by a device copy."""
    import torch

    n = (2 << 30) if device == "cuda" else (64 << 20)
    a = torch.empty(n, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    b.copy_(a)
    sync(device)
    start = time.perf_counter()
    for _ in range(5):
        b.copy_(a)
    sync(device)
    return 2 * n * 5 / (time.perf_counter() - start)


def sync(device: str) -> None:
    import torch
    if device == "cuda":
        torch.cuda.synchronize()


def decode_tok_s(eng, bs: int, prompt_len: int, new_tokens: int) -> float:
    """Decode tokens/s at batch ``bs``: the run's time less that of the same prompts' cached prefill."""
    rng = random.Random(bs)
    prompts = [[rng.randrange(1000, 30000) for _ in range(prompt_len)] for _ in range(bs)]
    params = {"temperature": 0, "max_new_tokens": 1, "ignore_eos": True}
    eng.generate(input_ids=prompts, sampling_params=[params] * bs)  # prefill cached (and warm)
    t0 = time.perf_counter()
    eng.generate(input_ids=prompts, sampling_params=[params] * bs)
    t_first = time.perf_counter() - t0
    t0 = time.perf_counter()
    eng.generate(input_ids=prompts, sampling_params=[{**params, "max_new_tokens": new_tokens + 1}] * bs)
    return bs * new_tokens / max(time.perf_counter() - t0 - t_first, 1e-9)


def throughput(eng, n: int, plen: int, olen: int) -> dict:
    rng = random.Random(2)
    prompts = [[rng.randrange(1000, 30000) for _ in range(plen)] for _ in range(n)]
    params = {"temperature": 0, "max_new_tokens": olen, "ignore_eos": True}
    eng.generate(input_ids=prompts[:2], sampling_params=[{**params, "max_new_tokens": 4}] * 2)
    eng.flush_cache()
    t0 = time.perf_counter()
    outs = eng.generate(input_ids=prompts, sampling_params=[params] * n)
    dt = time.perf_counter() - t0
    out_tokens = sum(len(o["output_ids"]) for o in outs)
    return {"ok": out_tokens == n * olen, "requests": n, "input_len": plen, "output_len": olen,
            "output_tok_s": out_tokens / dt, "seconds": round(dt, 2)}


def speed_rows(args, rec: Record, backend: str, key: str, bandwidth: float, **kw) -> None:
    """Decode tok/s at batch 1 and 64 and the 64 x 128-in / 128-out throughput, on the Llama-2-7B shape with
    random weights drawn on the device, decode in CUDA graphs."""
    import torch

    from radixlang.runtime.models.loader import model_loader as loader

    cuda = args.device == "cuda"
    loader.random_weights = device_random_weights(args.device)  # this phase's process only
    folder = model_folder(args, MODELS["perf"])
    batches, new_tokens, (n, plen, olen) = ((1, 64), 64, (64, 128, 128)) if cuda else ((1, 4), 4, (4, 16, 8))
    rows = rec.setdefault(key, {})
    with engine(args, folder, backend, load_format="dummy", disable_cuda_graph=not cuda, cuda_graph_max_bs=64,
                max_running_requests=64, max_total_tokens=64 * 320, **kw) as eng:
        model = eng.scheduler.runner.model
        rows["weight_bytes"] = sum(p.numel() * p.element_size() for p in model.parameters())
        # a batch-1 step reads every weight once but the embedding table (only the batch's rows of it); the
        # copy bandwidth counts each byte read and written, a step's weights are only read
        read = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if "embed_tokens" not in n)
        rows["floor_tok_s_batch1"] = bandwidth / read
        for bs in batches:
            rows[f"decode_tok_s_batch{bs}"] = decode_tok_s(eng, bs, 128 if cuda else 16, new_tokens)
            rec.save()
        rows["throughput"] = throughput(eng, n, plen, olen)
        rec.save()
    rows["batch1_vs_floor"] = rows["decode_tok_s_batch1"] / rows["floor_tok_s_batch1"]
    rows["ok"] = bool(rows["throughput"]["ok"])
    del model
    if cuda:
        torch.cuda.empty_cache()


def phase_speed(args, rec: Record) -> None:
    """(b) decode tok/s at batch 1 and 64, and the Llama-7B-shape 128-in / 128-out throughput, on triton."""
    bw = copy_bandwidth(args.device)
    rec["copy_bandwidth_GBps"] = bw / 1e9
    rec.save()
    speed_rows(args, rec, "triton", "triton", bw)
    rec["ok"] = bool(rec["triton"]["ok"])
