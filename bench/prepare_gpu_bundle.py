"""Prepare, on a machine with PyPI, the one folder ``bench/gpu_check.sh`` carries to a GPU machine without network.

The GPU machine has Python 3.12, torch (CUDA), triton and transformers; everything else the check needs goes in
the folder (at most 64 MiB):

* ``wheels/``: cp312 manylinux wheels (or pure-Python ones) of the missing packages and their dependencies
  (pyzmq, fastapi, uvicorn, outlines-core, orjson, msgspec, apache-tvm-ffi<0.2 and FlashInfer's small
  Python dependencies); ``gpu_check.sh`` installs them with ``pip install --no-index --find-links``.
* ``flashinfer_site.zip``: a trimmed copy of the flashinfer-python wheel: its Python files and the sources its
  JIT compiles (``data/include``, ``data/csrc`` top-level files, the ``cutlass``, ``cccl`` and ``spdlog``
  headers), deflated; gpu_check.sh unpacks it into a folder on PYTHONPATH. FlashInfer's JIT needs nvcc (a CUDA
  toolkit) on the GPU machine: its wheel does not fit here.
* ``models/NAME/config.json``: the small dense shape (``dense_4l``: Llama, 4 layers, head dim 128) and the small
  MoE shape (``moe_4l``: Mixtral, 4 layers, 8 experts, top-2) of the accuracy phase, and the Llama-2-7B shape
  (``llama2_7b_32l``, the shape of the published throughput comparisons) of the speed phase; ``tokenizer/``:
  the embedded SmolLM2 tokenizer (49,152 tokens, within every vocabulary), once for all of them. No weights:
  the check draws them on the GPU (transformers + ``save_pretrained`` for the accuracy shapes, the engine's
  random weights for the 7B shape).

    python -m bench.prepare_gpu_bundle [--out gpu_bundle] [--flashinfer-wheel PATH]
"""
from __future__ import annotations

import argparse
import fnmatch
import json
import os
import shutil
import subprocess
import sys
import zipfile

LIMIT_BYTES = 64 << 20
FLASHINFER = "flashinfer-python==0.7.2.post1"
# what the GPU machine lacks, pinned to versions this repository is tested with; pip adds their dependencies
PACKAGES = ["pyzmq==27.3.0", "fastapi==0.165.0", "uvicorn==0.55.0", "outlines-core==0.2.14", "orjson==3.13.0",
            "msgspec==0.23.0", "apache-tvm-ffi==0.1.15.post2", "httpx",
            # imported by flashinfer's Python package (its other requirements are only needed for MoE/comm/cute)
            "nvidia-ml-py", "einops", "tabulate", "ninja", "click", "requests"]
PLATFORMS = ["manylinux2014_x86_64", "manylinux_2_17_x86_64", "manylinux_2_28_x86_64", "manylinux_2_34_x86_64"]
# kept from the flashinfer wheel: every .py outside the dropped trees, and these data trees for the JIT
KEEP_DATA = ("flashinfer/data/include/", "flashinfer/data/cutlass/include/",
             "flashinfer/data/cutlass/tools/util/include/",
             "flashinfer/data/cccl/", "flashinfer/data/spdlog/include/")
DROP = ("*/__pycache__/*",
        "flashinfer/data/cccl/*/test/*", "flashinfer/data/cccl/*/examples/*", "flashinfer/data/cccl/docs/*",
        "flashinfer/data/cccl/*/benchmarks/*", "flashinfer/data/cccl/python/*", "flashinfer/data/cccl/c2h/*",
        "flashinfer/data/cccl/ci/*", "flashinfer/data/cccl/*/docs/*", "flashinfer/data/cccl/cudax/*")
HEADER_EXT = (".h", ".hpp", ".cuh", ".inl", ".cu", ".cc", ".cpp", ".jinja", ".py", ".txt", ".json")

CONFIGS = {
    "dense_4l": dict(hidden_size=2048, intermediate_size=8192, num_attention_heads=16, num_key_value_heads=8,
                     vocab_size=49152, rope_theta=500000.0, max_position_embeddings=8192, num_hidden_layers=4),
    "moe_4l": dict(architectures=["MixtralForCausalLM"], model_type="mixtral", hidden_size=1024,
                   intermediate_size=2048, num_attention_heads=16, num_key_value_heads=8, num_local_experts=8,
                   num_experts_per_tok=2, sliding_window=None, vocab_size=49152, rope_theta=1000000.0,
                   max_position_embeddings=8192, num_hidden_layers=4),
    "llama2_7b_32l": dict(hidden_size=4096, intermediate_size=11008, num_attention_heads=32, num_key_value_heads=32,
                          vocab_size=32000, rope_theta=10000.0, max_position_embeddings=4096, num_hidden_layers=32),
}
_BASE = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "rms_norm_eps": 1e-5,
         "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "bfloat16",
         "hidden_act": "silu", "attention_bias": False, "mlp_bias": False}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


def download_wheels(dest: str) -> None:
    os.makedirs(dest, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--only-binary=:all:", "--python-version", "3.12",
           "--implementation", "cp", "-d", dest]
    for p in PLATFORMS:
        cmd += ["--platform", p]
    subprocess.run(cmd + PACKAGES, check=True)
    # torch, triton and transformers are there already; a wheel pulled in as a dependency of one of them
    # would only waste the folder's room
    for name in os.listdir(dest):
        if name.split("-")[0].lower() in {"torch", "triton", "transformers", "numpy", "nvidia_nccl_cu12"}:
            os.remove(os.path.join(dest, name))


def fetch_flashinfer(work: str) -> str:
    os.makedirs(work, exist_ok=True)
    have = [f for f in os.listdir(work) if f.startswith("flashinfer_python-") and f.endswith(".whl")]
    if not have:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", FLASHINFER, "-d", work], check=True)
        have = [f for f in os.listdir(work) if f.startswith("flashinfer_python-") and f.endswith(".whl")]
    return os.path.join(work, sorted(have)[-1])


def _keep(name: str) -> bool:
    if any(fnmatch.fnmatch(name, pat) for pat in DROP):
        return False
    if name.startswith("flashinfer/data/"):
        if name.startswith("flashinfer/data/csrc/"):  # top-level csrc sources only, no subfolders
            return name.count("/") == 3 and name.endswith(HEADER_EXT)
        return name.startswith(KEEP_DATA) and name.endswith(HEADER_EXT)
    return name.startswith("flashinfer/") and name.endswith((".py", ".json", ".jinja", ".txt"))


def trim_flashinfer(wheel: str, out_zip: str) -> int:
    """Copy the kept files of the wheel into ``out_zip`` (deflated: the headers are ~100 MB unpacked);
    gpu_check.sh unpacks it into a folder on PYTHONPATH. Returns the kept bytes, unpacked."""
    kept = 0
    with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(out_zip, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as dst:
        for info in src.infolist():
            name = info.filename
            meta = name.endswith((".dist-info/METADATA", ".dist-info/RECORD", ".dist-info/entry_points.txt"))
            if info.is_dir() or not (meta or _keep(name)):
                continue
            dst.writestr(info, src.read(info))
            kept += info.file_size
    return kept


def model_config(name: str) -> dict:
    """The full config.json of one of the carried shapes."""
    return {**_BASE, **CONFIGS[name]}


def write_models(dest: str, tokenizer_dir: str) -> None:
    """dest/models/NAME/config.json for each shape and dest/tokenizer/ (the tokenizer, once)."""
    for name in CONFIGS:
        folder = os.path.join(dest, "models", name)
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, "config.json"), "w") as f:
            json.dump(model_config(name), f, indent=1)
    os.makedirs(os.path.join(dest, "tokenizer"), exist_ok=True)
    for t in TOKENIZER_FILES:
        if os.path.exists(os.path.join(tokenizer_dir, t)):
            shutil.copy(os.path.join(tokenizer_dir, t), os.path.join(dest, "tokenizer", t))


def folder_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="gpu_bundle")
    ap.add_argument("--flashinfer-wheel", default=None,
                    help="a downloaded flashinfer-python wheel (else pip downloads it)")
    ap.add_argument("--work", default=os.path.join(os.path.expanduser("~"), ".cache", "radixlang", "gpu_bundle_work"))
    args = ap.parse_args(argv)
    from radixlang.runtime.models.loader.model_loader import resolve_model_dir

    if os.path.exists(args.out):
        shutil.rmtree(args.out)
    os.makedirs(args.out)
    download_wheels(os.path.join(args.out, "wheels"))
    wheel = args.flashinfer_wheel or fetch_flashinfer(args.work)
    kept = trim_flashinfer(wheel, os.path.join(args.out, "flashinfer_site.zip"))
    write_models(args.out, resolve_model_dir(None))
    with open(os.path.join(args.out, "MANIFEST.json"), "w") as f:
        json.dump({"flashinfer_wheel": os.path.basename(wheel), "flashinfer_kept_bytes": kept,
                   "wheels": sorted(os.listdir(os.path.join(args.out, "wheels"))),
                   "models": sorted(CONFIGS)}, f, indent=1)
    size = folder_bytes(args.out)
    print(f"{args.out}: {size / 2**20:.1f} MiB (limit {LIMIT_BYTES / 2**20:.0f} MiB); flashinfer kept "
          f"{kept / 2**20:.1f} MiB uncompressed; {len(os.listdir(os.path.join(args.out, 'wheels')))} wheels")
    if size >= LIMIT_BYTES:
        print(f"the folder is over the limit by {(size - LIMIT_BYTES) / 2**20:.1f} MiB", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
