"""The GPU check's phases (run by bench/gpu_check.sh; each phase is its own process with a time cap).

    python -m bench.gpu_check --bundle gpu_bundle --out gpu_check_out            # every phase, in order
    python -m bench.gpu_check --phase accuracy --device cpu --out /tmp/x         # one phase (CPU: torch backend,
                                                                                 # a small config)
    python -m bench.gpu_check --dry-run --bundle gpu_bundle                      # imports, files, signatures

Phases, in order (caps in seconds, 8 minutes in all):
  flashinfer_warm (background, from the start): JIT-compiles FlashInfer's FA2/FA3 prefill and decode kernels
      for the shapes the later phases run, so they find them cached.
  pytest (90): ``pytest -m cuda``: each backend vs torch, graph vs eager decode, device vs host sampling.
  accuracy (120): a 4-layer Llama-3-8B-shape model (random weights drawn by transformers on the GPU and saved
      with save_pretrained) on each attention backend (torch, triton, flashinfer fa2, flashinfer fa3) against
      transformers by teacher-forced log-probabilities of the prompt tokens, with transformers' own bf16-vs-fp32
      error as the tolerance; the batch mixes requests with a cached prefix and without one. Then CUDA-graph
      decode against eager decode (same greedy tokens) on triton and flashinfer.
  decode (150): the 32-layer Llama-3-8B shape: decode tok/s at batch 1, 32 and 256 with and without CUDA graphs,
      prefill tok/s, transformers ``generate`` at the same batches, and the bandwidth floor (weight bytes read
      per step / measured device copy bandwidth).
  throughput (90): the Llama-2-7B shape, 64 requests of 128 input and 128 output tokens at once: output tok/s.
Each phase writes ``OUT/phase_NAME.json``; the driver writes ``OUT/gpu_check.json`` and prints a summary.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Any

from bench.gpu_phases import (MODELS, phase_accuracy, phase_decode, phase_flashinfer_warm, phase_pytest,
                              phase_throughput)

PHASES = [("pytest", 90), ("accuracy", 120), ("decode", 150), ("throughput", 90)]


# ---- dry run ---------------------------------------------------------------------------------------
def dry_run(bundle: str) -> dict:
    """Everything checkable without a GPU: the bundle's files, the imports the phases make, and the
    keyword arguments our FlashInfer backend passes against the carried FlashInfer's signatures."""
    import tempfile
    import zipfile

    problems: list[str] = []
    wheels = os.listdir(os.path.join(bundle, "wheels")) if os.path.isdir(os.path.join(bundle, "wheels")) else []
    for pkg in ("pyzmq", "fastapi", "uvicorn", "outlines_core", "orjson", "msgspec", "apache_tvm_ffi", "ninja",
                "nvidia_ml_py", "einops", "pytest"):
        if not any(w.lower().startswith(pkg + "-") for w in wheels):
            problems.append(f"no wheel for {pkg}")
    for name in MODELS.values():
        for f in ("config.json", "tokenizer.json"):
            if not os.path.exists(os.path.join(bundle, "models", name, f)):
                problems.append(f"missing models/{name}/{f}")
    zpath = os.path.join(bundle, "flashinfer_site.zip")
    signatures = {}
    if not os.path.exists(zpath):
        problems.append("missing flashinfer_site.zip")
    else:
        with zipfile.ZipFile(zpath) as zf:
            names = set(zf.namelist())
            for need in ("flashinfer/__init__.py", "flashinfer/prefill.py", "flashinfer/decode.py",
                         "flashinfer/data/include/flashinfer/attention/prefill.cuh"):
                if need not in names:
                    problems.append(f"flashinfer_site.zip lacks {need}")
            with tempfile.TemporaryDirectory() as tmp:
                zf.extractall(tmp)
                signatures = _check_plan_kwargs(tmp, problems)
    for mod in ("radixlang", "radixlang.runtime.entrypoints.engine", "radixlang.kernels.cuda_graph",
                "radixlang.kernels.attention.flashinfer_backend", "radixlang.kernels.attention.triton_backend",
                "transformers", "safetensors"):
        try:
            __import__(mod)
        except Exception as e:  # noqa: BLE001 (a failing row or phase is reported, not raised)
            problems.append(f"import {mod}: {type(e).__name__}: {e}")
    return {"ok": not problems, "problems": problems, "wheels": len(wheels), "plan_signatures": signatures}


def _check_plan_kwargs(site: str, problems: list[str]) -> dict:
    """Bind the plan() keywords flashinfer_plan_args builds to the carried FlashInfer's signatures (parsed
    from its sources, so it runs where flashinfer cannot be imported)."""
    import ast

    import torch

    from radixlang.kernels.attention.flashinfer_backend import flashinfer_plan_args
    from radixlang.kernels.attention.metadata import build_attention_metadata

    classes = {"decode": ("decode.py", "BatchDecodeWithPagedKVCacheWrapper"),
               "ragged": ("prefill.py", "BatchPrefillWithRaggedKVCacheWrapper"),
               "paged_prefix": ("prefill.py", "BatchPrefillWithPagedKVCacheWrapper")}
    md = build_attention_metadata(torch.arange(32, dtype=torch.int32).view(2, 16), torch.tensor([0, 1]), [6, 3],
                                  extend_prefix_lens=[4, 0], extend_seq_lens=[2, 3])
    plan = flashinfer_plan_args(md, 8, 2, 64, 1)
    extra = {"q_data_type", "kv_data_type", "sm_scale", "causal"}
    found = {}
    for key, (fname, cls) in classes.items():
        with open(os.path.join(site, "flashinfer", fname)) as f:
            tree = ast.parse(f.read())
        node = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls)
        fn = next(f for f in node.body if isinstance(f, ast.FunctionDef) and f.name == "plan")
        params = {a.arg for a in fn.args.args + fn.args.kwonlyargs}
        takes_kwargs = fn.args.kwarg is not None
        wanted = set(plan[key]) | (extra - ({"causal"} if key == "decode" else set()))
        unknown = sorted(w for w in wanted if w not in params)
        if unknown and not takes_kwargs:
            problems.append(f"{cls}.plan has no parameter(s) {unknown}")
        found[key] = {"unknown": unknown, "takes_kwargs": takes_kwargs}
        if key == "decode" and unknown:  # decode's plan takes **kwargs: check the shared implementation
            impl = [f for f in node.body if isinstance(f, ast.FunctionDef) and "plan" in f.name and f.name != "plan"]
            impl_params = {a.arg for f in impl for a in f.args.args + f.args.kwonlyargs}
            still = sorted(w for w in unknown if w not in impl_params)
            found[key]["unknown_in_impl"] = still
            if still:
                problems.append(f"{cls} plan implementation has no parameter(s) {still}")
    return found


# ---- driver ----------------------------------------------------------------------------------------
def run_phase(name: str, args) -> dict:
    fn = {"flashinfer_warm": phase_flashinfer_warm, "pytest": phase_pytest, "accuracy": phase_accuracy,
          "decode": phase_decode, "throughput": phase_throughput}[name]
    start = time.perf_counter()
    try:
        res = fn(args)
    except Exception as e:  # noqa: BLE001 (a failing row or phase is reported, not raised)
        import traceback
        res = {"ok": False, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}
    res["seconds"] = round(time.perf_counter() - start, 1)
    with open(os.path.join(args.out, f"phase_{name}.json"), "w") as f:
        json.dump(res, f, indent=1, default=str)
    return res


def drive(args) -> int:
    os.makedirs(args.out, exist_ok=True)
    base = [sys.executable, "-m", "bench.gpu_check", "--bundle", args.bundle, "--out", args.out, "--device",
            args.device]
    warm = None
    if args.device == "cuda":  # FlashInfer compiles in the background from the start
        with open(os.path.join(args.out, "warm.log"), "w") as log:  # the child keeps its own copy of the fd
            warm = subprocess.Popen(base + ["--phase", "flashinfer_warm"], stdout=log, stderr=subprocess.STDOUT)
    summary: dict[str, Any] = {}
    for name, cap in PHASES:
        if name == "pytest" and args.device != "cuda":
            continue
        start = time.perf_counter()
        try:
            cap = cap if args.device == "cuda" else cap * 5  # a CPU dry run: small configs, slow cores
            proc = subprocess.run(base + ["--phase", name], timeout=cap, capture_output=True, text=True, check=False)
            path = os.path.join(args.out, f"phase_{name}.json")
            res = _load(path) if os.path.exists(path) else {"ok": False, "error": proc.stderr[-2000:]}
        except subprocess.TimeoutExpired:
            res = {"ok": False, "error": f"over its {cap} s cap"}
        res.setdefault("seconds", round(time.perf_counter() - start, 1))
        summary[name] = res
        print(_line(name, res), flush=True)
    if warm is not None:
        try:
            warm.wait(timeout=5)
        except subprocess.TimeoutExpired:
            warm.kill()
        path = os.path.join(args.out, "phase_flashinfer_warm.json")
        summary["flashinfer_warm"] = _load(path) if os.path.exists(path) else {"ok": False, "error": "did not finish"}
        print(_line("flashinfer_warm", summary["flashinfer_warm"]), flush=True)
    with open(os.path.join(args.out, "gpu_check.json"), "w") as f:
        json.dump(summary, f, indent=1, default=str)
    print(f"figures: {os.path.join(args.out, 'gpu_check.json')}")
    return 0 if all(r.get("ok") for r in summary.values()) else 1


def _load(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


def _line(name: str, res: dict) -> str:
    status = "PASS" if res.get("ok") else "FAIL"
    detail = ""
    if name == "pytest":
        detail = res.get("summary", "")
    elif name == "accuracy" and "backends" in res:
        detail = "; ".join(f"{k} {'ok' if v.get('ok') else 'FAIL'} mean {v.get('mean_err', float('nan')):.2e}"
                           for k, v in res["backends"].items())
        detail += f" (hf bf16 mean {res['hf_bf16_vs_fp32']['mean']:.2e})"
        if "graph_vs_eager" in res:
            same = res["graph_vs_eager"].items()
            detail += "; graphs==eager " + ", ".join(f"{k}:{v.get('same_tokens')}" for k, v in same)
    elif name == "decode" and "engine" in res:
        detail = f"engine {res['engine']}; transformers {res['transformers']}; ratios {res.get('ratios')}"
    elif name == "throughput" and "output_tok_s" in res:
        detail = f"{res['requests']} x {res['input_len']}/{res['output_len']}: {res['output_tok_s']:.0f} output tok/s"
    if not res.get("ok") and res.get("error"):
        detail += " " + str(res["error"])[:300]
    return f"[{status}] {name} ({res.get('seconds', '?')} s) {detail}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="radixlang's GPU check (see bench/gpu_check.sh)")
    ap.add_argument("--bundle", default="gpu_bundle")
    ap.add_argument("--out", default="gpu_check_out")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--phase", default=None, choices=[p for p, _ in PHASES] + ["flashinfer_warm"])
    ap.add_argument("--dry-run", action="store_true")
    args = ap.parse_args(argv)
    if args.dry_run:
        res = dry_run(args.bundle)
        print(json.dumps(res, indent=1))
        return 0 if res["ok"] else 1
    if args.phase:
        os.makedirs(args.out, exist_ok=True)
        res = run_phase(args.phase, args)
        return 0 if res.get("ok") else 1
    return drive(args)


if __name__ == "__main__":
    sys.exit(main())
