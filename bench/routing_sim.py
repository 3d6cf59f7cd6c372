"""Routing simulator: a multi-tenant trace replayed over 8-256 simulated workers (issue #40, item 3).

    python -m bench.routing_sim --workers 8 64 256 [--requests-per-worker 96] [--seed 0]

Policies, all fed the same trace:

* ``radixlang``: our router, the real ``radixlang.runtime.dp.router.Router`` (cache_aware, its
  defaults), given what the request front gives it: one tree bound per worker equal to the worker's KV
  size, ``select(prompt ids)`` on arrival, ``finished(worker)`` when the request ends.
* ``smg``: SMG's cache_aware policy with its CLI defaults (bench/routing_smg.py): one shared
  approximate tree of request text (the ids joined by spaces), only bounded by its periodic eviction.
* ``round_robin``: the Router's round robin.

Trace (bench/routing_trace.py, seeded, token ids directly): tenants with a system prompt and few-shot
prefixes, Zipf popularity, multi-turn chats. It grows with the worker count (tenants and requests per
worker stay fixed), so every size sees the same load.

Workers: each has a KV budget in tokens and a real ``RadixCache`` over token ids; a request is admitted
(FCFS, at most ``max_running`` at once) when the KV of its uncached prompt and its answer fits after LRU
eviction of unlocked leaves; it runs ``prefill_s * uncached tokens + decode_s * answer tokens`` and then
inserts prompt + answer into the cache, as the scheduler does. The hit rate is what the workers really
had cached at admission (cached prompt tokens / prompt tokens).

Reported per policy and worker count: hit rate; load imbalance, max/mean requests in flight (queued or
running) per worker, time-averaged over the steady part of the run (from 20% of the arrival span to its
end); routing cost, the mean wall time of the policy's select call in microseconds (SMG's text join and
its periodic eviction, a background task there, are outside it); mean request latency in simulated
seconds. Results go to bench/results/routing_sim.json.
"""
from __future__ import annotations

import argparse
import heapq
import itertools
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from typing import Protocol

import torch

from bench.common import write_result
from bench.routing_smg import SmgCacheAware
from bench.routing_trace import Request, TraceConfig, make_trace
from radixlang.radix_cache import RadixCache
from radixlang.radix_cache.radix_cache import TreeNode
from radixlang.runtime.dp.router import Router

POLICY_NAMES = ("radixlang", "smg", "round_robin")


# ---- policies ---------------------------------------------------------------------------------------------
class Policy(Protocol):
    def route(self, prompt_ids: tuple[int, ...], now_s: float) -> tuple[int, float]:
        """(worker, seconds the select call took)."""

    def finished(self, worker: int) -> None: ...


class RouterPolicy:
    """radixlang's Router (cache_aware or round_robin), fed as the request front feeds it."""

    def __init__(self, router: Router) -> None:
        self.router = router

    def route(self, prompt_ids: tuple[int, ...], now_s: float) -> tuple[int, float]:
        start = time.perf_counter()
        worker = self.router.select(prompt_ids)
        return worker, time.perf_counter() - start

    def finished(self, worker: int) -> None:
        self.router.finished(worker)


class SmgPolicy:
    def __init__(self, smg: SmgCacheAware) -> None:
        self.smg = smg

    def route(self, prompt_ids: tuple[int, ...], now_s: float) -> tuple[int, float]:
        self.smg.tick(now_s)
        text = " ".join(map(str, prompt_ids))  # SMG routes HTTP requests by their text
        start = time.perf_counter()
        worker = self.smg.select(text)
        return worker, time.perf_counter() - start

    def finished(self, worker: int) -> None:
        self.smg.finished(worker)


def make_policy(name: str, num_workers: int, kv_tokens: int) -> Policy:
    if name == "radixlang":
        return RouterPolicy(Router(num_workers, policy="cache_aware", max_tree_tokens=[kv_tokens] * num_workers))
    if name == "round_robin":
        return RouterPolicy(Router(num_workers, policy="round_robin"))
    if name == "smg":
        return SmgPolicy(SmgCacheAware(num_workers))
    raise ValueError(f"policy must be one of {', '.join(POLICY_NAMES)}, got {name!r}")


# ---- workers ---------------------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class WorkerConfig:
    kv_tokens: int = 32768
    max_running: int = 8
    prefill_s: float = 0.25e-3  # per uncached prompt token
    decode_s: float = 10e-3  # per answer token


@dataclass(eq=False)
class _Running:
    req: Request
    worker: int
    node: TreeNode
    private_tokens: int  # KV slots held outside the tree: uncached prompt + answer


@dataclass(eq=False)
class _Worker:
    cache: RadixCache = field(default_factory=RadixCache)
    queue: deque[Request] = field(default_factory=deque)
    num_running: int = 0
    private_tokens: int = 0

    def free_tokens(self, kv_tokens: int) -> int:
        return kv_tokens - self.cache.evictable_size() - self.cache.protected_size() - self.private_tokens


# ---- simulation --------------------------------------------------------------------------------------------
@dataclass
class SimResult:
    policy: str
    num_workers: int
    num_requests: int
    prompt_tokens: int  # summed at admission: each request counts once
    hit_rate: float
    imbalance: float
    route_us: float
    latency_s: float
    routed: list[int] = field(repr=False)  # worker per request id


class _Sim:
    def __init__(self, policy: Policy, trace: list[Request], num_workers: int, wcfg: WorkerConfig) -> None:
        self.policy, self.trace, self.wcfg = policy, trace, wcfg
        self.workers = [_Worker() for _ in range(num_workers)]
        self.in_flight = [0] * num_workers
        self.events: list[tuple[float, int, Request | _Running]] = []
        self._seq = itertools.count()
        self.routed = [-1] * len(trace)
        self.arrived_s = [0.0] * len(trace)
        self.prompts: dict[int, tuple[int, ...]] = {}  # of the requests in flight
        self.latency_s = 0.0
        self.cached_tokens = self.prompt_tokens = 0
        self.route_s = 0.0
        starts = [r.arrival_s for r in trace if r.arrival_s is not None]
        self.window = (0.2 * starts[-1], starts[-1])
        self.imbalance_area = self.window_time = 0.0
        self.now = 0.0

    def run(self) -> None:
        for req in self.trace:
            if req.arrival_s is not None:
                self._push(req.arrival_s, req)
        while self.events:
            at, _, item = heapq.heappop(self.events)
            self._advance(at)
            if isinstance(item, Request):
                self._arrive(item)
            else:
                self._finish(item)

    def _push(self, at: float, item: Request | _Running) -> None:
        heapq.heappush(self.events, (at, next(self._seq), item))

    def _advance(self, at: float) -> None:
        """Add max/mean in flight over [now, at) to the time average where it falls in the window."""
        lo, hi = max(self.now, self.window[0]), min(at, self.window[1])
        total = sum(self.in_flight)
        if hi > lo and total > 0:
            self.imbalance_area += (hi - lo) * max(self.in_flight) * len(self.in_flight) / total
            self.window_time += hi - lo
        self.now = at

    def _arrive(self, req: Request) -> None:
        if self.routed[req.rid] != -1:
            raise RuntimeError(f"request {req.rid} arrived twice")
        prompt = self.prompts[req.rid] = req.prompt_ids
        worker, took_s = self.policy.route(prompt, self.now)
        self.route_s += took_s
        self.routed[req.rid] = worker
        self.arrived_s[req.rid] = self.now
        self.in_flight[worker] += 1
        self.workers[worker].queue.append(req)
        self._admit(worker)

    def _admit(self, worker: int) -> None:
        w, cfg = self.workers[worker], self.wcfg
        while w.queue and w.num_running < cfg.max_running:
            req = w.queue[0]
            prompt = self.prompts[req.rid]
            match = w.cache.match_prefix(list(prompt))
            w.cache.inc_lock_ref(match.last_node)  # its prefix must survive the eviction below
            cached = int(match.kv_indices.numel())
            need = len(prompt) - cached + len(req.output_ids)
            shortfall = need - w.free_tokens(cfg.kv_tokens)
            if shortfall > 0:
                w.cache.evict(shortfall, lambda _slots: None)
            if need > w.free_tokens(cfg.kv_tokens):
                w.cache.dec_lock_ref(match.last_node)
                return  # FCFS: wait for a running request to end
            w.queue.popleft()
            w.num_running += 1
            w.private_tokens += need
            self.cached_tokens += cached
            self.prompt_tokens += len(prompt)
            service_s = cfg.prefill_s * (len(prompt) - cached) + cfg.decode_s * len(req.output_ids)
            self._push(self.now + service_s, _Running(req, worker, match.last_node, need))

    def _finish(self, run: _Running) -> None:
        w, req = self.workers[run.worker], run.req
        full = list(self.prompts.pop(req.rid) + req.output_ids)
        w.cache.insert(full, torch.empty(len(full), dtype=torch.int64))  # slot values are never read here
        w.cache.dec_lock_ref(run.node)
        w.num_running -= 1
        w.private_tokens -= run.private_tokens
        self.in_flight[run.worker] -= 1
        self.policy.finished(run.worker)
        self.latency_s += self.now - self.arrived_s[req.rid]
        if req.next_turn is not None:
            self._push(self.now + req.think_s, req.next_turn)
        self._admit(run.worker)


def simulate(policy_name: str, trace: list[Request], num_workers: int, wcfg: WorkerConfig) -> SimResult:
    sim = _Sim(make_policy(policy_name, num_workers, wcfg.kv_tokens), trace, num_workers, wcfg)
    sim.run()
    if any(w.queue or w.num_running for w in sim.workers):
        raise RuntimeError(f"{policy_name}: the run ended with requests still queued or running")
    n = len(trace)
    return SimResult(policy=policy_name, num_workers=num_workers, num_requests=n, prompt_tokens=sim.prompt_tokens,
                     hit_rate=sim.cached_tokens / max(sim.prompt_tokens, 1),
                     imbalance=sim.imbalance_area / sim.window_time if sim.window_time else 1.0,
                     route_us=sim.route_s / n * 1e6, latency_s=sim.latency_s / n, routed=sim.routed)


# ---- sizing and report -----------------------------------------------------------------------------------
def scaled_trace_config(num_workers: int, *, requests_per_worker: int, wcfg: WorkerConfig, load: float = 0.7,
                        seed: int = 0) -> TraceConfig:
    """A trace whose tenants and requests grow with the workers, arriving at ``load`` times the fleet's
    capacity without any cache hit (so hits show as spare capacity, not as a different offered load)."""
    # request sizes do not depend on the tenant count or the rate: a 200-conversation sample gives the means
    num_sampled = 200
    sample = make_trace(TraceConfig(num_tenants=16, num_conversations=num_sampled, conversations_per_s=1.0,
                                    seed=seed))
    service_s = sum(wcfg.prefill_s * len(r.prompt_ids) + wcfg.decode_s * len(r.output_ids) for r in sample)
    service_s /= len(sample)
    turns_per_conversation = len(sample) / num_sampled
    requests_per_s = load * num_workers * wcfg.max_running / service_s
    return TraceConfig(num_tenants=num_workers, seed=seed,
                       num_conversations=max(1, round(requests_per_worker * num_workers / turns_per_conversation)),
                       conversations_per_s=requests_per_s / turns_per_conversation)


def run(worker_counts: list[int], *, requests_per_worker: int, seed: int, wcfg: WorkerConfig,
        policies: tuple[str, ...] = POLICY_NAMES) -> list[SimResult]:
    results: list[SimResult] = []
    for num_workers in worker_counts:
        cfg = scaled_trace_config(num_workers, requests_per_worker=requests_per_worker, wcfg=wcfg, seed=seed)
        if cfg.max_request_tokens > wcfg.kv_tokens:
            raise ValueError(f"kv_tokens must hold the longest request ({cfg.max_request_tokens}), "
                             f"got {wcfg.kv_tokens}")
        trace = make_trace(cfg)
        results.extend(simulate(name, trace, num_workers, wcfg) for name in policies)
    return results


def format_table(results: list[SimResult]) -> str:
    lines = ["| workers | requests | policy | hit rate | imbalance (max/mean in flight) | route us/req | "
             "latency s |", "|---:|---:|---|---:|---:|---:|---:|"]
    for r in results:
        lines.append(f"| {r.num_workers} | {r.num_requests} | {r.policy} | {r.hit_rate:.3f} | {r.imbalance:.2f} | "
                     f"{r.route_us:.1f} | {r.latency_s:.2f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, nargs="+", default=[8, 64, 256])
    parser.add_argument("--requests-per-worker", type=int, default=96)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--kv-tokens", type=int, default=WorkerConfig.kv_tokens)
    args = parser.parse_args()
    wcfg = WorkerConfig(kv_tokens=args.kv_tokens)
    start = time.perf_counter()
    results = run(args.workers, requests_per_worker=args.requests_per_worker, seed=args.seed, wcfg=wcfg)
    wall_s = time.perf_counter() - start
    print(f"trace: {args.requests_per_worker} requests and 1 tenant per worker (it grows with the worker "
          f"count), seed {args.seed}; workers: {asdict(wcfg)}")
    print(format_table(results))
    print(f"wall {wall_s:.0f} s")
    path = write_result("routing_sim", {"workers": asdict(wcfg), "requests_per_worker": args.requests_per_worker,
                                        "seed": args.seed, "wall_s": wall_s,
                                        "results": [{k: v for k, v in asdict(r).items() if k != "routed"}
                                                    for r in results]})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
