"""Online serving benchmark against a live server, in the spirit of SGLang's bench_serving.

Streams requests to POST /generate (SSE) from an async httpx client, with Poisson arrivals
(``--request-rate``, inf = all at once) or a fixed number in flight (``--max-concurrency``), and
reports request and token throughput, p50/p99 TTFT, inter-token latency (ITL) and end-to-end
latency, and the prompt-token cache hit rate read from /get_server_info. By default it starts a
server through ``radixlang.Runtime`` twice, with and without ``--disable-radix-cache``, runs the
same seeded workload on each and prints the ratios.

    python -m bench.serving --quick                    # embedded SmolLM2, shared-prefix, ~2-3 minutes
    python -m bench.serving --dataset random --request-rate 4
    python -m bench.serving --model-path CFG_DIR --load-format dummy --num-prompts 8
    python -m bench.serving --url http://127.0.0.1:30000   # one run against a running server
    python -m bench.serving --quick --llama-server         # and the same load on llama.cpp's llama-server

Writes bench/results/serving.json (or ``--out``) and a PNG next to it when matplotlib is installed.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import random
import time
from pathlib import Path
from typing import Any

import httpx

from bench.serving_data import BenchRequest, make_dataset
from bench.serving_report import plot, print_comparison, ratios, summarize

RESULTS = Path(__file__).parent / "results"
VARIANTS = {"radix_cache": {}, "no_radix_cache": {"disable_radix_cache": True}}


def _result(req: BenchRequest, error: str | None, start: float, ttft: float | None, itl: list[float],
            got: int, cached: int) -> dict[str, Any]:
    return {"ok": error is None, "error": error, "prompt_len": len(req.input_ids), "output_len": got,
            "expected_output_len": req.output_len, "ttft": ttft, "itl": itl,
            "e2e": time.perf_counter() - start, "cached_tokens": cached}


async def send_one(client: httpx.AsyncClient, req: BenchRequest) -> dict[str, Any]:
    """One streamed request; TTFT at the first chunk carrying a token, ITL per token after it."""
    body = {"input_ids": req.input_ids, "stream": True,
            "sampling_params": {"max_new_tokens": req.output_len, "temperature": 0.0, "ignore_eos": True}}
    start = time.perf_counter()
    ttft: float | None = None
    itl: list[float] = []
    got, cached, last, done = 0, 0, start, False
    try:
        async with client.stream("POST", "/generate", json=body) as r:
            if r.status_code != 200:
                await r.aread()
                return _result(req, f"status {r.status_code}: {r.text[:200]}", start, ttft, itl, got, cached)
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[len("data:"):].strip()
                if data == "[DONE]":
                    done = True
                    break
                meta = json.loads(data)["meta_info"]
                reason = meta.get("finish_reason") or {}
                if isinstance(reason, dict) and reason.get("type") == "abort":
                    return _result(req, f"aborted: {reason.get('message')}", start, ttft, itl, got, cached)
                now, n = time.perf_counter(), int(meta.get("completion_tokens", 0))
                cached = int(meta.get("cached_tokens", 0) or 0)
                if n > got:
                    if ttft is None:
                        ttft = now - start
                    else:  # a chunk may carry several tokens (held-back text): spread its gap over them
                        itl.extend([(now - last) / (n - got)] * (n - got))
                    got, last = n, now
    except httpx.HTTPError as e:
        return _result(req, f"{type(e).__name__}: {e}", start, ttft, itl, got, cached)
    error = None if done else "stream ended without [DONE]"
    if error is None and got != req.output_len:
        error = f"expected {req.output_len} output tokens (ignore_eos), got {got}"
    return _result(req, error, start, ttft, itl, got, cached)


async def send_one_llama_server(client: httpx.AsyncClient, req: BenchRequest) -> dict[str, Any]:
    """The same request to llama.cpp's llama-server: its streamed ``/completion`` (a chunk per token),
    greedy, EOS ignored, with its per-slot prompt cache; cached tokens from the last chunk's timings."""
    body = {"prompt": req.input_ids, "n_predict": req.output_len, "temperature": 0.0, "top_k": 1,
            "repeat_penalty": 1.0, "ignore_eos": True, "cache_prompt": True, "stream": True}
    start = time.perf_counter()
    ttft: float | None = None
    itl: list[float] = []
    got, cached, last, done = 0, 0, start, False
    try:
        async with client.stream("POST", "/completion", json=body) as r:
            if r.status_code != 200:
                await r.aread()
                return _result(req, f"status {r.status_code}: {r.text[:200]}", start, ttft, itl, got, cached)
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                chunk = json.loads(line[len("data:"):].strip())
                now = time.perf_counter()
                if chunk.get("stop"):
                    timings = chunk.get("timings") or {}
                    cached = int(timings.get("cache_n", 0) or 0)
                    got = int(timings.get("predicted_n", got) or got)
                    done = True
                    break
                n = int(chunk.get("tokens_predicted", got + 1)) - got  # one token a chunk, counted by the server
                if n:
                    if ttft is None:
                        ttft = now - start
                    else:
                        itl.extend([(now - last) / n] * n)
                    got, last = got + n, now
    except httpx.HTTPError as e:
        return _result(req, f"{type(e).__name__}: {e}", start, ttft, itl, got, cached)
    error = None if done else "stream ended without a final chunk"
    if error is None and got != req.output_len:
        error = f"expected {req.output_len} output tokens (ignore_eos), got {got}"
    return _result(req, error, start, ttft, itl, got, cached)


async def run_load(url: str, requests: list[BenchRequest], *, request_rate: float, max_concurrency: int | None,
                   time_limit_s: float, seed: int = 0, sender: Any = None) -> tuple[list[dict[str, Any]], float]:
    """Send every request (Poisson arrivals at request_rate/s, at most max_concurrency in flight);
    requests still running at the time limit are cancelled and count as failures."""
    rng = random.Random(seed)
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    send = sender or send_one

    async def guarded(client: httpx.AsyncClient, req: BenchRequest) -> dict[str, Any]:
        if sem is None:
            return await send(client, req)
        async with sem:
            return await send(client, req)

    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(time_limit_s), limits=limits) as client:
        start = time.perf_counter()
        tasks = []
        for req in requests:
            tasks.append(asyncio.create_task(guarded(client, req)))
            if math.isfinite(request_rate) and time.perf_counter() - start < time_limit_s:
                await asyncio.sleep(rng.expovariate(request_rate))
        remaining = max(0.0, time_limit_s - (time.perf_counter() - start))
        await asyncio.wait(tasks, timeout=remaining)
        duration = time.perf_counter() - start
        results = []
        for req, task in zip(requests, tasks):
            if task.done():
                results.append(task.result())
            else:
                task.cancel()
                results.append({**_result(req, f"not finished within {time_limit_s:.0f} s", start, None, [], 0, 0),
                                "e2e": duration})
        await asyncio.gather(*tasks, return_exceptions=True)
    return results, duration


def _counters(client: httpx.Client) -> tuple[int, int]:
    info = client.get("/get_server_info").json()
    return int(info.get("prompt_tokens", 0)), int(info.get("cached_tokens", 0))


def bench_url(url: str, requests: list[BenchRequest], args: argparse.Namespace) -> dict[str, Any]:
    """Warm the server, flush its cache, run the load once and summarize it."""
    with httpx.Client(base_url=url, timeout=120) as client:
        warm = client.post("/generate", json={"input_ids": requests[0].input_ids[:8],
                                              "sampling_params": {"max_new_tokens": 2}})
        warm.raise_for_status()
        client.post("/flush_cache")  # the warm-up must not seed the cache
        before = _counters(client)
        results, duration = asyncio.run(run_load(url, requests, request_rate=args.request_rate,
                                                 max_concurrency=args.max_concurrency,
                                                 time_limit_s=args.time_limit, seed=args.seed))
        after = _counters(client)
    hit_rate = (after[1] - before[1]) / max(after[0] - before[0], 1)
    return summarize(results, duration, hit_rate)


def bench_llama_server(requests: list[BenchRequest], args: argparse.Namespace) -> dict[str, Any]:
    """The same load on llama-server (bench/llama_server.py) over the embedded GGUF, with as many parallel
    slots as requests can be in flight (at most 32), the same threads; its hit rate from its timings."""
    from bench.common import threads
    from bench.llama_server import LlamaServer
    from radixlang.runtime.models.loader.model_loader import default_model_path

    slots = min(32, args.max_concurrency or len(requests))
    ctx = max(len(r.input_ids) + r.output_len for r in requests) + 16
    with LlamaServer(default_model_path(), parallel=slots, threads=args.num_threads or threads(),
                     ctx_per_slot=ctx) as server:
        with httpx.Client(base_url=server.url, timeout=120) as client:  # warm-up, like bench_url's
            client.post("/completion", json={"prompt": requests[0].input_ids[:8], "n_predict": 2}).raise_for_status()
        results, duration = asyncio.run(run_load(server.url, requests, request_rate=args.request_rate,
                                                 max_concurrency=args.max_concurrency, time_limit_s=args.time_limit,
                                                 seed=args.seed, sender=send_one_llama_server))
    ok = [r for r in results if r["ok"]]
    hit_rate = sum(r["cached_tokens"] for r in ok) / max(sum(r["prompt_len"] for r in ok), 1)
    return summarize(results, duration, hit_rate)


def server_args(args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {"log_level": "warning"}
    for name in ("model_path", "load_format", "max_total_tokens", "num_threads"):
        if getattr(args, name) is not None:
            out[name] = getattr(args, name)
    return out


def _vocab_size(url: str) -> int:
    return int(httpx.get(url + "/get_server_info", timeout=30).json()["vocab_size"])


def run(args: argparse.Namespace) -> dict[str, Any]:
    runs: dict[str, Any] = {}
    requests: list[BenchRequest] = []
    if args.url:
        requests = make_dataset(args, _vocab_size(args.url))
        runs["server"] = bench_url(args.url, requests, args)
    else:
        from radixlang.lang.backends.runtime import Runtime
        for name, extra in VARIANTS.items():
            with Runtime(launch_timeout=300, **server_args(args), **extra) as runtime:
                requests = requests or make_dataset(args, _vocab_size(runtime.url))
                print(f"[{name}] {len(requests)} requests against {runtime.url}", flush=True)
                runs[name] = bench_url(runtime.url, requests, args)
    result = {"machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count()},
              "args": {k: v for k, v in vars(args).items() if k != "out"},
              "workload": {"num_requests": len(requests), "input_tokens": sum(len(r.input_ids) for r in requests),
                           "output_tokens": sum(r.output_len for r in requests)},
              "runs": runs}
    if args.llama_server and not args.url:
        print(f"[llama_server] {len(requests)} requests", flush=True)
        runs["llama_server"] = bench_llama_server(requests, args)
        result["ratios_vs_llama_server"] = ratios(runs["radix_cache"], runs["llama_server"])
    if set(VARIANTS) <= set(runs):
        result["ratios"] = ratios(runs["radix_cache"], runs["no_radix_cache"])
    return result


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a small workload (~2-3 minutes on SmolLM2, 2 cores)")
    ap.add_argument("--url", help="bench a running server instead of starting two (no cache comparison)")
    ap.add_argument("--llama-server", action="store_true",
                    help="also run the load on llama.cpp's llama-server (python -m bench.llama_server --build) on "
                         "the embedded GGUF; the model is then the embedded one")
    ap.add_argument("--model-path", help="model for the servers it starts (default: the embedded SmolLM2)")
    ap.add_argument("--load-format", help="e.g. dummy: random weights from a config folder")
    ap.add_argument("--max-total-tokens", type=int, help="the servers' KV pool size in tokens")
    ap.add_argument("--num-threads", type=int, help="the servers' torch CPU threads")
    ap.add_argument("--dataset", choices=("shared-prefix", "random"), default="shared-prefix")
    ap.add_argument("--num-prompts", type=int, help="random: number of requests (default 24 quick / 96)")
    ap.add_argument("--random-input-len", type=int, nargs=2, metavar=("MIN", "MAX"))
    ap.add_argument("--random-output-len", type=int, nargs=2, metavar=("MIN", "MAX"))
    ap.add_argument("--num-groups", type=int, help="shared-prefix: groups (default 4 quick / 8)")
    ap.add_argument("--prompts-per-group", type=int, help="shared-prefix: questions per group (default 8 / 16)")
    ap.add_argument("--system-prompt-len", type=int, help="shared-prefix: tokens (default 400 / 800)")
    ap.add_argument("--question-len", type=int, help="shared-prefix: tokens (default 32 / 64)")
    ap.add_argument("--output-len", type=int, help="shared-prefix: new tokens (default 16 / 64)")
    ap.add_argument("--request-rate", type=float, default=math.inf,
                    help="Poisson arrivals per second (inf: all at once)")
    ap.add_argument("--max-concurrency", type=int, help="cap on requests in flight")
    ap.add_argument("--time-limit", type=float, default=300.0, help="seconds per run; unfinished requests fail")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(RESULTS / "serving.json"), help="JSON result path (PNG beside it)")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    result = run(args)
    print_comparison(result)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print("wrote", out)
    try:
        plot(result, out.with_suffix(".png"))
        print("wrote", out.with_suffix(".png"))
    except ImportError:
        print("matplotlib not installed: no PNG (pip install matplotlib)")
    return result


if __name__ == "__main__":
    main()
