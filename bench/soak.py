"""Soak: many mixed requests at fixed concurrency against a live server; no errors, no leaks, bounded RSS.

The mix cycles through free, streaming, regex- and JSON-constrained requests over a few
shared prefixes. After the load the server must be idle with every KV slot free or cached
(checked through /get_server_info), and its resident memory (VmRSS summed over the server process
and its children) must not grow past a bound after a warm-up share of the load.

    python -m bench.soak                       # starts a server on the embedded model
    python -m bench.soak --url http://127.0.0.1:30000 --requests 200 --concurrency 16
"""
from __future__ import annotations

import argparse
import json
import os
import random
import re
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx

REGEX = r"(yes|no|maybe), [a-z]{2,8}"
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"]}
PREFIXES = [f"Shared context number {k}: " + " ".join(f"fact{k}_{j} is true." for j in range(40)) for k in range(4)]


def make_requests(n: int, seed: int = 0) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        text = PREFIXES[i % len(PREFIXES)] + f" Question {i}:"
        params: dict[str, Any] = {"max_new_tokens": rng.randint(4, 24), "temperature": rng.choice([0, 0.8]),
                                  "sampling_seed": i}
        kind = ("free", "stream", "regex", "json")[i % 4]
        if kind == "regex":
            params["regex"] = REGEX
            params["max_new_tokens"] = 64
        elif kind == "json":
            params["json_schema"] = json.dumps(SCHEMA)
            params["max_new_tokens"] = 96
        out.append({"kind": kind, "body": {"text": text, "sampling_params": params, "stream": kind == "stream"}})
    return out


def send(client: httpx.Client, req: dict[str, Any]) -> str | None:
    """One request; None when it succeeded and its output is valid, else what went wrong."""
    body = req["body"]
    if body["stream"]:
        frames = []
        with client.stream("POST", "/generate", json=body) as r:
            if r.status_code != 200:
                return f"stream status {r.status_code}"
            frames = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
        if not frames or frames[-1] != "[DONE]":
            return "stream did not end with [DONE]"
        return None
    r = client.post("/generate", json=body)
    if r.status_code != 200:
        return f"status {r.status_code}: {r.text[:200]}"
    out = r.json()
    finish = out["meta_info"]["finish_reason"]["type"]
    if req["kind"] == "regex" and finish == "stop" and not re.fullmatch(REGEX, out["text"]):
        return f"regex output does not match: {out['text']!r}"
    if req["kind"] == "json" and finish == "stop":
        try:
            doc = json.loads(out["text"])
        except ValueError:
            return f"json output does not parse: {out['text']!r}"
        if not (isinstance(doc, dict) and set(doc) == {"name", "age"}):
            return f"json output has the wrong keys: {doc!r}"
    return None


def _children(pid: int) -> list[int]:
    """Direct children of pid, from /proc/<pid>/task/*/children (or every /proc/*/stat's ppid field)."""
    kids: list[int] = []
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as f:
                kids += [int(x) for x in f.read().split()]
        return kids
    except OSError:
        pass
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    stat = f.read()
            except OSError:
                continue
            if int(stat[stat.rindex(")") + 2:].split()[1]) == pid:  # fields after "(comm)": state, ppid
                kids.append(int(entry))
    return kids


def rss_mb(pid: int, field: str = "VmRSS") -> float | None:
    """VmRSS of pid and all its descendants (the server may run as several processes), in MiB; ``field``
    another line of /proc/<pid>/status (VmHWM: each process's peak, summed)."""
    total_kb, seen, todo = 0, set(), [pid]
    while todo:
        p = todo.pop()
        if p in seen:
            continue
        seen.add(p)
        try:
            with open(f"/proc/{p}/status") as f:
                total_kb += next((int(line.split()[1]) for line in f if line.startswith(field + ":")), 0)
        except OSError:
            if p == pid:
                return None
            continue
        todo += _children(p)
    return total_kb / 1024


def soak(url: str, n: int, concurrency: int, pid: int | None = None, headers: dict | None = None,
         time_limit_s: float = 600, warmup: int = 0) -> dict[str, Any]:
    """Run n mixed requests; the first ``warmup`` of them come before the RSS baseline is read."""
    reqs = make_requests(n)
    with httpx.Client(base_url=url, timeout=120, headers=headers or {}) as client:
        send(client, reqs[0])  # warm: grammars compiled, prefixes cached
        started = time.perf_counter()
        with ThreadPoolExecutor(concurrency) as pool:
            errors = [e for e in pool.map(lambda r: send(client, r), reqs[:warmup]) if e]
            rss_before = rss_mb(pid) if pid else None
            errors += [e for e in pool.map(lambda r: send(client, r), reqs[warmup:]) if e]
        wall = time.perf_counter() - started
        if wall > time_limit_s:
            errors.append(f"took {wall:.0f} s, over the {time_limit_s:.0f} s limit")
        deadline = time.time() + 30
        info = client.get("/get_server_info").json()
        while (info["num_running_reqs"] or info["num_waiting_reqs"]) and time.time() < deadline:
            time.sleep(0.2)
            info = client.get("/get_server_info").json()
        mem = info["memory"]
        leaked = mem["kv_total_tokens"] - mem["kv_free_tokens"] - mem["kv_cached_tokens"]
    rss_after = rss_mb(pid) if pid else None
    return {"requests": n, "warmup_requests": warmup, "concurrency": concurrency, "wall_s": wall, "errors": errors,
            "leaked_kv_slots": leaked, "running_after": info["num_running_reqs"],
            "rss_before_mb": rss_before, "rss_after_mb": rss_after,
            "rss_growth_mb": None if rss_before is None or rss_after is None else rss_after - rss_before}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", help="a running server; absent: start one on the embedded model")
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--warmup", type=int, default=50, help="requests before the RSS baseline")
    args = ap.parse_args()
    if args.url:
        result = soak(args.url, args.requests, args.concurrency, warmup=args.warmup)
    else:
        from radixlang.lang.backends.runtime import Runtime
        with Runtime(log_level="warning") as runtime:  # the embedded model
            result = soak(runtime.url, args.requests, args.concurrency, pid=runtime.pid, warmup=args.warmup)
    print(json.dumps(result, indent=2))
    ok = not result["errors"] and result["leaked_kv_slots"] == 0
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
