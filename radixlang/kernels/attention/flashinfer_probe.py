"""Whether FlashInfer can run its kernels on this machine, without compiling anything.

``import flashinfer`` succeeds without a CUDA toolkit, but its kernels are JIT-compiled on first use:
without nvcc (and ninja) the first forward fails, inside CUDA-graph capture at start. FlashInfer can
run when its kernels are prebuilt (the ``flashinfer-jit-cache`` AOT package, an AOT folder inside the
package, or modules its JIT already left in its cache folder) or when its JIT finds nvcc and ninja,
looked up the way FlashInfer looks them up (``flashinfer/jit/cpp_ext.py``: ``FLASHINFER_NVCC``, else
``CUDA_HOME``, ``CUDA_PATH``, the folder above ``nvcc`` on PATH, ``/usr/local/cuda``).
"""
from __future__ import annotations

import importlib.util
import os
import shutil
from pathlib import Path
from typing import Mapping, NamedTuple

# FlashInfer's (and torch's) fallback toolkit folder when nothing names one
DEFAULT_CUDA_HOME = "/usr/local/cuda"


class FlashInferStatus(NamedTuple):
    usable: bool
    reason: str  # why, in words for the start log


def find_nvcc(environ: Mapping[str, str] | None = None, default_home: str | None = None) -> str | None:
    """The nvcc FlashInfer's JIT would run, or None when there is none."""
    env = os.environ if environ is None else environ
    default_home = default_home or DEFAULT_CUDA_HOME
    candidates = [env.get("FLASHINFER_NVCC")]
    home = env.get("CUDA_HOME") or env.get("CUDA_PATH")
    if home:
        candidates.append(os.path.join(home, "bin", "nvcc"))
    candidates.append(shutil.which("nvcc", path=env.get("PATH")))
    candidates.append(os.path.join(default_home, "bin", "nvcc"))
    for path in candidates:
        if path and os.path.isfile(path) and os.access(path, os.X_OK):
            return path
    return None


def prebuilt_kernels(package_dir: str | None, environ: Mapping[str, str] | None = None) -> str | None:
    """Where FlashInfer keeps prebuilt attention kernels, or None: the AOT package, the package's AOT
    folder, or a JIT cache holding both a batch prefill and a batch decode module."""
    env = os.environ if environ is None else environ
    try:
        if importlib.util.find_spec("flashinfer_jit_cache") is not None:
            return "the flashinfer-jit-cache package"
    except (ImportError, ValueError):  # a stub or broken module in sys.modules
        pass
    if package_dir:
        aot = Path(package_dir) / "data" / "aot"
        if aot.is_dir() and any(aot.rglob("*.so")):
            return str(aot)
    cache = Path(env.get("FLASHINFER_WORKSPACE_BASE") or Path.home()) / ".cache" / "flashinfer"
    if cache.is_dir():
        names = [p.name for p in cache.glob("**/cached_ops/*/*.so")]
        if any("prefill" in n for n in names) and any("decode" in n for n in names):
            return str(cache)
    return None


def flashinfer_status(environ: Mapping[str, str] | None = None,
                      default_home: str | None = None) -> FlashInferStatus:
    """Whether the flashinfer backend will run here, and why (nothing is compiled or launched)."""
    try:
        import flashinfer
    except ImportError as e:
        return FlashInferStatus(False, f"flashinfer is not installed ({e})")
    env = os.environ if environ is None else environ
    default_home = default_home or DEFAULT_CUDA_HOME
    file = getattr(flashinfer, "__file__", None)
    prebuilt = prebuilt_kernels(os.path.dirname(file) if file else None, env)
    if prebuilt is not None:
        return FlashInferStatus(True, f"its kernels are prebuilt ({prebuilt})")
    nvcc = find_nvcc(env, default_home)
    if nvcc is None:
        return FlashInferStatus(False, "its kernels are not prebuilt and its JIT finds no nvcc (FLASHINFER_NVCC, "
                                       f"CUDA_HOME, CUDA_PATH, PATH, {default_home})")
    if shutil.which("ninja", path=env.get("PATH")) is None:
        return FlashInferStatus(False, f"its kernels are not prebuilt and its JIT needs ninja on PATH (nvcc: {nvcc})")
    return FlashInferStatus(True, f"its JIT compiles its kernels with {nvcc}")
