"""The GPU check's driver (run by bench/gpu_check.sh): every phase in a process group of its own, each killed as
a group at its cap, the whole check inside one budget (default 5 minutes with the setup, so that it runs twice
within 15 minutes of GPU time, machine starts included).

    python -m bench.gpu_check --bundle gpu_bundle --out gpu_check_out       # every phase, in order
    python -m bench.gpu_check --device cpu --out /tmp/x                     # the same phases on small shapes
    python -m bench.gpu_check --phase accuracy --device cpu --out /tmp/x    # one phase
    python -m bench.gpu_check --dry-run --bundle gpu_bundle                 # imports, files, signatures

Phases, in the order of what matters if the check is cut short (caps in seconds):
  flashinfer_warm_fa2, flashinfer_warm_fa3 (background, from the start, until phase c): compile FlashInfer's
      kernels for the shapes its rows run.
  accuracy (120): the triton and torch attention backends against transformers by teacher-forced
      log-probabilities, on a small dense (Llama, 4 layers, head dim 128) and a small MoE (Mixtral, 4 layers,
      8 experts, top-2) shape, random weights drawn by transformers and saved with save_pretrained; one batch
      mixes prompts extending a cached prefix and prompts without one; tolerance 2x transformers' own
      bf16-vs-fp32 error. Then decode in CUDA graphs == eager decode (same greedy tokens), both shapes, triton.
  speed (100): the Llama-2-7B shape (random weights drawn on the GPU), triton, decode in CUDA graphs: decode
      tok/s at batch 1 and 64, the batch-1 bandwidth floor (weights read per step / measured copy
      bandwidth), and 64 requests of 128 input and 128 output tokens at once: output tok/s.
  flashinfer (what the budget leaves): for each of fa2 / fa3 whose kernels compiled in time, the accuracy
      row on the dense shape; graphs == eager; the speed rows where the 7B shape's kernels compiled too.
Each phase writes OUT/phase_NAME.json after every row; the driver merges them into OUT/gpu_check.json after
every phase and prints a PASS/FAIL line per phase.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from typing import Any

from bench.gpu_phases import MODELS, Record

# (name, cap in seconds); the FlashInfer rows get whatever the budget leaves
PHASES = [("accuracy", 120), ("speed", 100)]
FLASHINFER_MIN_S = 60  # the FlashInfer rows get at least this long: the compiles are cut short before them
BUDGET_S = {"cuda": 280, "cpu": 170}  # the driver's own budget; gpu_check.sh's setup comes on top


# ---- dry run ---------------------------------------------------------------------------------------
def dry_run(bundle: str) -> dict:
    """Everything checkable without a GPU: the bundle's files, the imports the phases make, and the
    keyword arguments our FlashInfer backend passes against the carried FlashInfer's signatures."""
    import tempfile
    import zipfile

    problems: list[str] = []
    wheels = os.listdir(os.path.join(bundle, "wheels")) if os.path.isdir(os.path.join(bundle, "wheels")) else []
    for pkg in ("pyzmq", "fastapi", "uvicorn", "outlines_core", "orjson", "msgspec", "apache_tvm_ffi", "ninja",
                "nvidia_ml_py", "einops"):
        if not any(w.lower().startswith(pkg + "-") for w in wheels):
            problems.append(f"no wheel for {pkg}")
    for name in MODELS.values():
        if not os.path.exists(os.path.join(bundle, "models", name, "config.json")):
            problems.append(f"missing models/{name}/config.json")
    if not os.path.exists(os.path.join(bundle, "tokenizer", "tokenizer.json")):
        problems.append("missing tokenizer/tokenizer.json")
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
    """In the phase's own process: run it, its figures saved to OUT/phase_NAME.json as it goes."""
    from bench.gpu_flashinfer import phase_flashinfer, phase_flashinfer_warm
    from bench.gpu_phases import phase_accuracy, phase_speed

    fn = {"accuracy": phase_accuracy, "speed": phase_speed, "flashinfer": phase_flashinfer,
          "flashinfer_warm": phase_flashinfer_warm}[name]
    label = f"{name}_{args.fi}" if name == "flashinfer_warm" else name
    rec = Record(os.path.join(args.out, f"phase_{label}.json"))
    rec.save()
    try:
        fn(args, rec)
    except Exception as e:  # noqa: BLE001 (a failing phase is reported, not raised)
        import traceback
        rec.update(ok=False, error=f"{type(e).__name__}: {e}"[:1000], traceback=traceback.format_exc()[-3000:])
    rec.save()
    return rec


class Group:
    """A phase's process, leader of its own session (setsid): at its cap the whole group is killed, the
    compilers and workers it started included (kill -- -pgid)."""

    def __init__(self, cmd: list[str], log_path: str) -> None:
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)

    def wait(self, timeout: float) -> bool:
        """Whether the process ended within ``timeout`` seconds."""
        try:
            self.proc.wait(timeout=max(timeout, 0.0))
        except subprocess.TimeoutExpired:
            return False
        self.log.close()
        return True

    def kill(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()
        self.log.close()


def drive(args) -> int:
    os.makedirs(args.out, exist_ok=True)
    deadline = time.monotonic() + (args.budget or BUDGET_S[args.device])
    base = [sys.executable, "-m", "bench.gpu_check", "--bundle", args.bundle, "--out", args.out, "--device",
            args.device]
    groups: list[Group] = []
    summary: dict[str, Any] = {}

    def stop(signum, frame) -> None:  # the shell's backstop: leave no phase running, keep what was measured
        for g in groups:
            g.kill()
        _write(args, summary)
        sys.exit(124)

    signal.signal(signal.SIGTERM, stop)
    warm = {}
    # FlashInfer compiles in the background from the start, fa2 and fa3 side by side (the CPU: they report so)
    for fi in ("fa2", "fa3"):
        warm[fi] = Group(base + ["--phase", "flashinfer_warm", "--fi", fi],
                         os.path.join(args.out, f"flashinfer_warm_{fi}.log"))
        groups.append(warm[fi])
    for name, cap in PHASES:
        summary[name] = _run_group(args, base, name, min(cap, deadline - time.monotonic() - FLASHINFER_MIN_S // 2),
                                   groups)
        print(_line(name, summary[name]), flush=True)
        _write(args, summary)
    left = deadline - time.monotonic()
    for fi, g in warm.items():  # compiled in time, or not at all
        if not g.wait(left - FLASHINFER_MIN_S):
            g.kill()
        summary[f"flashinfer_warm_{fi}"] = _load(args, f"flashinfer_warm_{fi}")
        left = deadline - time.monotonic()
    summary["flashinfer"] = _run_group(args, base, "flashinfer", deadline - time.monotonic(), groups)
    for key in [k for k in summary if k.startswith("flashinfer")]:
        print(_line(key, summary[key]), flush=True)
    _write(args, summary)
    print(f"figures: {os.path.join(args.out, 'gpu_check.json')}")
    return 0 if all(r.get("ok") for k, r in summary.items() if not k.startswith("flashinfer_warm")) else 1


def _run_group(args, base: list[str], name: str, cap: float, groups: list[Group]) -> dict:
    if cap < 5:
        return {"ok": False, "error": "no time left in the budget"}
    g = Group(base + ["--phase", name], os.path.join(args.out, f"{name}.log"))
    groups.append(g)
    start = time.monotonic()
    finished = g.wait(cap)
    if not finished:
        g.kill()
    res = _load(args, name)
    if not finished:
        res.update(ok=False, error=f"killed at its {cap:.0f} s cap (figures so far kept)")
    elif "ok" not in res:
        res.update(ok=False, error=f"exited with code {g.proc.returncode}; see {name}.log")
    res.setdefault("seconds", round(time.monotonic() - start, 1))
    return res


def _load(args, name: str) -> dict:
    path = os.path.join(args.out, f"phase_{name}.json")
    if not os.path.exists(path):
        return {"ok": False, "error": "no figures written"}
    with open(path) as f:
        return json.load(f)


def _write(args, summary: dict) -> None:
    with open(os.path.join(args.out, "gpu_check.json"), "w") as f:
        json.dump(summary, f, indent=1, default=str)


def _line(name: str, res: dict) -> str:
    status = "SKIP" if res.get("skipped") else "PASS" if res.get("ok") else "FAIL"
    parts = []
    for key, row in (res.get("rows") or {}).items():
        if "mean_err" in row:
            parts.append(f"{key} {'ok' if row.get('ok') else 'FAIL'} mean {row['mean_err']:.2e}")
        else:
            note = f" ({row['note']})" if "note" in row else ""
            parts.append(f"{key} {'ok' if row.get('ok') else 'FAIL'}{note}")
    for key in ("triton", "flashinfer_fa2", "flashinfer_fa3"):
        row = res.get(key)
        if isinstance(row, dict) and "decode_tok_s_batch1" in row:
            decode = ", ".join(f"b{k.rpartition('batch')[2]} {v:.0f}" for k, v in row.items()
                               if k.startswith("decode_tok_s_batch"))
            parts.append(f"{key}: decode tok/s {decode} (b1 {row.get('batch1_vs_floor', float('nan')):.2f} of the "
                         "bandwidth floor)")
        tp = row.get("throughput") if isinstance(row, dict) else None
        if tp:
            parts.append(f"{tp['requests']} x {tp['input_len']}/{tp['output_len']}: {tp['output_tok_s']:.0f} "
                         "output tok/s")
    if "compiled" in res and name.startswith("flashinfer_warm"):
        parts.append(f"compiled {[c['shape'] for c in res['compiled']]}")
    for key in ("skipped", "status", "error"):
        if res.get(key):
            parts.append(str(res[key])[:300])
    return f"[{status}] {name} ({res.get('seconds', '?')} s) " + "; ".join(parts)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="radixlang's GPU check (see bench/gpu_check.sh)")
    ap.add_argument("--bundle", default="gpu_bundle")
    ap.add_argument("--out", default="gpu_check_out")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--phase", default=None, choices=[p for p, _ in PHASES] + ["flashinfer", "flashinfer_warm"])
    ap.add_argument("--fi", default="fa2", choices=("fa2", "fa3"), help="the variant --phase flashinfer_warm compiles")
    ap.add_argument("--budget", type=float, default=None,
                    help=f"seconds for every phase together (default {BUDGET_S['cuda']} on CUDA, {BUDGET_S['cpu']} "
                         "on the CPU)")
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
