"""radixlang's server against llama-server on GGUF files at real model shapes (issue #44 item 2).

    python -m bench.llama_server --build                       # once: llama-server and llama-quantize
    python -m bench.shapes_vs_llama_server --shapes llama-3.2-1b --types Q4_K_M [--quick]

The files come from ``bench.real_shapes`` (random weights at published shapes, quantized by llama.cpp's
``llama-quantize``). For each file both servers are started and stay up together, with the same threads;
every workload runs its timed repeats in alternated turns (llama-server, radixlang, radixlang, llama-server,
...), so a change in the machine's load falls on both. Greedy, EOS ignored, token ids in (ids the SmolLM2
tokenizer spells, unreachable padding excluded), and every prompt distinct so no prefix cache helps:

- ``decode``: one request of 16 prompt tokens, 128 new tokens; output tok/s (best of the repeats), and that
  figure as a fraction of the bandwidth floor: the machine's measured read bandwidth over the bytes a
  decode step must read (every tensor of the file but the token embedding, which a step reads one row of;
  a tied embedding is read whole as the logits head).
- ``prefill_N`` (N = 512, 2048, 8192): one request of N prompt tokens and 1 new token; prompt tok/s from the
  time to that token.
- ``concurrent``: 32 requests of 256 prompt tokens x 128 new tokens sent at once; output tok/s.
- peak RSS of each server (the sum over its processes of each one's peak, from /proc), after the runs.

llama-server runs with ``--parallel 32`` slots over one unified KV cache (``--kv-unified``) so one
request can take the 8192-token context; radixlang's ``launch_server`` with its defaults. Results:
bench/results/shapes_vs_llama_server.json.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

from bench import soak
from bench.common import read_bandwidth_gbs, threads, write_result
from bench.llama_server import _free_port, stop
from bench.vs_llama_server import _post

PROMPT_LENS = (512, 2048, 8192)
CONCURRENT = (32, 256, 128)  # requests, prompt tokens, new tokens
TOKEN_RANGE = (300, 49000)  # ids SmolLM2's vocabulary spells (the shapes' padding lies above)


def _wait(url: str, proc: subprocess.Popen, timeout: float) -> float:
    """Seconds until ``url`` answered 200."""
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args[0]} exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=5) as r:
                if r.status == 200:
                    return time.monotonic() - start
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{url} did not answer within {timeout:.0f} s")


class Server:
    """A server process (and its children) and how to send it a greedy completion of token ids."""

    def __init__(self, name: str, argv: list[str], port: int, *, native: bool, health: str) -> None:
        self.name, self.native, self.url = name, native, f"http://127.0.0.1:{port}"
        self.proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                     start_new_session=True)
        try:
            self.startup_s = _wait(self.url + health, self.proc, 1800)
        except BaseException:
            self.close()
            raise

    def complete(self, ids: list[int], n: int) -> int:
        if self.native:
            out = _post(self.url + "/generate", {"input_ids": ids, "sampling_params": {
                "temperature": 0, "max_new_tokens": n, "ignore_eos": True}})
            return int(out["meta_info"]["completion_tokens"])
        out = _post(self.url + "/completion", {"prompt": ids, "n_predict": n, "temperature": 0.0, "top_k": 1,
                                               "cache_prompt": False, "ignore_eos": True, "stream": False})
        return int((out.get("timings") or {}).get("predicted_n", out.get("tokens_predicted", 0)))

    def peak_rss_mb(self) -> float:
        """The sum of each process's peak RSS (VmHWM) over the server's process tree."""
        return soak.rss_mb(self.proc.pid, "VmHWM") or 0.0

    def close(self) -> None:
        stop(self.proc)


def start_llama_server(path: Path, n_threads: int) -> Server:
    from bench.llama_server import build, command
    port = _free_port()
    ctx = max(PROMPT_LENS) + 256
    argv = command(str(build()), str(path), port=port, parallel=CONCURRENT[0], threads=n_threads,
                   ctx_per_slot=1) + ["--ctx-size", str(max(ctx, CONCURRENT[0] * sum(CONCURRENT[1:]))),
                                      "--kv-unified"]
    return Server("llama-server", argv, port, native=False, health="/health")


def start_radixlang(path: Path, n_threads: int) -> Server:
    port = _free_port()
    argv = [sys.executable, "-m", "radixlang.launch_server", "--model-path", str(path), "--port", str(port),
            "--num-threads", str(n_threads), "--context-length", str(max(PROMPT_LENS) + 256),
            "--log-level", "warning"]
    return Server("radixlang", argv, port, native=True, health="/health")


def step_bytes(path: Path) -> int:
    """Bytes a decode step reads from the file: every tensor but an untied token embedding."""
    from gguf import GGUFReader
    tensors = GGUFReader(str(path)).tensors
    tied = not any(t.name == "output.weight" for t in tensors)
    return sum(int(t.n_bytes) for t in tensors if t.name != "token_embd.weight" or tied)


def _prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(*TOKEN_RANGE) for _ in range(n)]


def _alternated(servers: list[Server], repeats: int, run: Callable[[Server], float]) -> dict[str, list[float]]:
    """Each server's figures over ``repeats`` turns, the order reversed every turn."""
    out: dict[str, list[float]] = {s.name: [] for s in servers}
    for r in range(repeats):
        for s in servers if r % 2 == 0 else servers[::-1]:
            out[s.name].append(run(s))
    return out


def bench_file(path: Path, repeats: int, n_threads: int, bandwidth: float) -> dict[str, Any]:
    rng = random.Random(0)
    servers = [start_llama_server(path, n_threads), start_radixlang(path, n_threads)]
    try:
        for s in servers:  # a warm-up each: first-call allocations and kernel builds out of the figures
            s.complete(_prompt(rng, 64), 8)
        res: dict[str, Any] = {"startup_s": {s.name: round(s.startup_s, 1) for s in servers}}

        def decode(s: Server) -> float:
            t = time.perf_counter()
            n = s.complete(_prompt(rng, 16), 128)
            return n / (time.perf_counter() - t)
        res["decode"] = _alternated(servers, repeats, decode)
        for n_prompt in PROMPT_LENS:
            def prefill(s: Server, n_prompt: int = n_prompt) -> float:
                t = time.perf_counter()
                s.complete(_prompt(rng, n_prompt), 1)
                return n_prompt / (time.perf_counter() - t)
            res[f"prefill_{n_prompt}"] = _alternated(servers, repeats, prefill)

        def concurrent(s: Server) -> float:
            count, n_in, n_out = CONCURRENT
            prompts = [_prompt(rng, n_in) for _ in range(count)]
            t = time.perf_counter()
            with ThreadPoolExecutor(count) as pool:
                made = sum(pool.map(lambda ids: s.complete(ids, n_out), prompts))
            return made / (time.perf_counter() - t)
        res["concurrent"] = _alternated(servers, max(1, repeats - 1), concurrent)
        res["peak_rss_mb"] = {s.name: round(s.peak_rss_mb()) for s in servers}
    finally:
        for s in servers:
            s.close()
    floor = bandwidth * 1e9 / step_bytes(path)
    res["bandwidth_floor_tok_s"] = round(floor, 2)
    res["decode_floor_fraction"] = {name: round(max(v) / floor, 3) for name, v in res["decode"].items()}
    return res


def ratios(res: dict[str, Any]) -> dict[str, float]:
    """radixlang / llama-server of each workload's best figure (peak RSS: radixlang's over llama-server's)."""
    out = {}
    for k, v in res.items():
        if isinstance(v, dict) and isinstance(v.get("radixlang"), list):
            out[k] = round(max(v["radixlang"]) / max(v["llama-server"]), 3)
    rss = res["peak_rss_mb"]
    out["peak_rss"] = round(rss["radixlang"] / rss["llama-server"], 3)
    out["startup"] = round(res["startup_s"]["radixlang"] / res["startup_s"]["llama-server"], 2)
    return out


def main(argv: list[str] | None = None) -> None:
    from bench.real_shapes import SHAPES, make
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", nargs="*", default=["gemma-3-270m", "llama-3.2-1b", "llama-3.2-3b"],
                    choices=list(SHAPES))
    ap.add_argument("--types", nargs="*", default=["Q4_K_M"])
    ap.add_argument("--quick", action="store_true", help="one timed turn each instead of three")
    args = ap.parse_args(argv)
    import torch
    n_threads = threads()
    torch.set_num_threads(n_threads)
    bandwidth = read_bandwidth_gbs(1 << 30)
    print(f"read bandwidth {bandwidth:.1f} GB/s on {n_threads} threads", flush=True)
    results: dict[str, Any] = {"threads": n_threads, "read_bandwidth_gbs": round(bandwidth, 2),
                               "cpu": _cpu_name(), "files": {}}
    for shape in args.shapes:
        for qtype in args.types:
            path = make(shape, qtype)
            if path is None:
                continue
            key = f"{shape}.{qtype}"
            res = bench_file(path, 1 if args.quick else 3, n_threads, bandwidth)
            res["ratios"] = ratios(res)
            results["files"][key] = res
            print(key, json.dumps(res), flush=True)
    print("wrote", write_result("shapes_vs_llama_server", results))


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            name = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
        flags = next(line for line in open("/proc/cpuinfo") if line.startswith("flags")).split()
        feats = [f for f in ("avx2", "avx512f", "avx512_vnni", "amx_tile") if f in flags]
        return f"{name} ({', '.join(feats)}, {os.cpu_count()} logical)"
    except (OSError, StopIteration):
        return "unknown"


if __name__ == "__main__":
    main()
