"""radixlang on Ray Serve: 3 replicas vs 1 server on this machine, and prefix-aware vs round-robin routing on
the same deployment, in one run.

    python -m bench.ray_serve [--replicas 3] [--prefixes 9] [--waves 4] [--kill-node]

Workload: ``--prefixes`` few-shot prefixes of ~200 words, ``--waves`` waves of one request per prefix (shuffled,
6 at a time), 16 new tokens each; the embedded SmolLM2. Cells, each from flushed caches:

* ``server``: one ``launch_server`` over HTTP;
* ``ray_cache_aware``: a 3-node Ray cluster on this machine (``ray.cluster_utils.Cluster``), ``--replicas``
  replicas of 1 CPU, through the HTTP endpoint (the ingress tokenizes, ``PrefixRouter`` routes by prefix);
* ``ray_round_robin``: the same deployment, called through its handle without token ids, which the same
  router sends to the replicas in turn.

Reported: prompt-token hit rate (cached / prompt tokens over the replicas), requests/s and output tok/s. On a
machine with fewer cores than replicas the replicas share the cores: throughput says what the routing costs,
not what more machines would give. ``--kill-node`` then removes a worker node mid-load and reports how each
in-flight request ended and how long until the service answered again (tests/e2e/test_ray_serve.py runs
the same check).
"""
from __future__ import annotations

import argparse
import random
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

import httpx

from bench.common import write_result
from bench.ray_cluster import LocalDeployment, local_deployment

ARGS = {"num_threads": 1, "max_total_tokens": 8192, "log_level": "warning"}
NEW_TOKENS = 16


def trace(num_prefixes: int, num_waves: int, seed: int = 0) -> list[list[str]]:
    rng = random.Random(seed)
    words = "alpha beta gamma delta omega sigma kappa theta lambda zeta river stone cloud maple ember".split()
    prefixes = [" ".join(rng.choice(words) for _ in range(200)) for _ in range(num_prefixes)]
    waves = []
    for _ in range(num_waves):
        wave = [p + " Q: " + " ".join(rng.choice(words) for _ in range(rng.randrange(3, 8))) for p in prefixes]
        rng.shuffle(wave)
        waves.append(wave)
    return waves


def run_cell(url: str, send: Callable[[str], int], waves: list[list[str]]) -> dict[str, Any]:
    assert httpx.post(url + "/flush_cache", timeout=120).status_code == 200
    before = httpx.get(url + "/get_server_info", timeout=120).json()
    start = time.perf_counter()
    with ThreadPoolExecutor(6) as pool:
        tokens = sum(sum(pool.map(send, wave)) for wave in waves)
    wall = time.perf_counter() - start
    after = httpx.get(url + "/get_server_info", timeout=120).json()
    prompt = after["prompt_tokens"] - before["prompt_tokens"]
    cached = after["cached_tokens"] - before["cached_tokens"]
    num = sum(len(w) for w in waves)
    return {"hit_rate": round(cached / prompt, 4), "req_per_s": round(num / wall, 3),
            "out_tok_per_s": round(tokens / wall, 2), "requests": num, "wall_s": round(wall, 2)}


def http_sender(url: str) -> Callable[[str], int]:
    def send(text: str) -> int:
        r = httpx.post(url + "/generate", timeout=300, json={
            "text": text, "sampling_params": {"temperature": 0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True}})
        r.raise_for_status()
        return r.json()["meta_info"]["completion_tokens"]
    return send


def handle_sender() -> Callable[[str], int]:
    from ray import serve
    replicas = serve.get_deployment_handle("RadixReplica", app_name="radixlang")

    def send(text: str) -> int:  # no token ids: the router sends it to the replicas in turn
        out = replicas.generate.remote({"prompt": text, "sampling_params": {
            "temperature": 0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True}}).result()
        return out["out"]["meta_info"]["completion_tokens"]
    return send


def server_cell(waves: list[list[str]]) -> dict[str, Any]:
    from radixlang.lang.backends.runtime import Runtime
    with Runtime(launch_timeout=600, **ARGS) as rt:
        return run_cell(rt.url, http_sender(rt.url), waves)


def kill_node(deployment: LocalDeployment) -> dict[str, Any]:
    url = deployment.url
    victim = deployment.worker_with_a_replica()

    def one(i: int) -> str:
        try:
            r = httpx.post(url + "/generate", timeout=150, json={"text": f"request {i}: " + "word " * 40,
                           "sampling_params": {"max_new_tokens": 32, "ignore_eos": True}})
        except httpx.HTTPError as e:
            return f"transport error {type(e).__name__}"
        if r.status_code != 200:
            return f"{r.status_code}"
        return r.json()["meta_info"]["finish_reason"]["type"]

    with ThreadPoolExecutor(12) as pool:
        results = pool.map(one, range(12))
        time.sleep(1)
        killed = time.monotonic()
        deployment.cluster.remove_node(victim, allow_graceful=False)
        outcomes = list(results)
    while True:
        try:
            if http_sender(url)("still there?"):
                break
        except httpx.HTTPError:
            time.sleep(0.5)
    return {"outcomes": {o: outcomes.count(o) for o in set(outcomes)},
            "answers_again_after_s": round(time.monotonic() - killed, 1)}


def ray_cells(waves: list[list[str]], num_replicas: int, *, with_kill: bool) -> dict[str, Any]:
    with local_deployment(ARGS, num_replicas=num_replicas) as deployment:
        url = deployment.url
        out = {"ray_cache_aware": run_cell(url, http_sender(url), waves),
               "ray_round_robin": run_cell(url, handle_sender(), waves)}
        if with_kill:
            out["node_loss"] = kill_node(deployment)
        return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--replicas", type=int, default=3)
    parser.add_argument("--prefixes", type=int, default=9)
    parser.add_argument("--waves", type=int, default=4)
    parser.add_argument("--kill-node", action="store_true")
    ns = parser.parse_args()
    waves = trace(ns.prefixes, ns.waves)
    result = {"server": server_cell(waves), **ray_cells(waves, ns.replicas, with_kill=ns.kill_node)}
    aware, rr, one = result["ray_cache_aware"], result["ray_round_robin"], result["server"]
    result["ratios"] = {"hit_rate_cache_aware_vs_round_robin": round(aware["hit_rate"] / rr["hit_rate"], 2),
                        "req_per_s_cache_aware_vs_round_robin": round(aware["req_per_s"] / rr["req_per_s"], 2),
                        "hit_rate_ray_vs_server": round(aware["hit_rate"] / one["hit_rate"], 2),
                        "req_per_s_ray_vs_server": round(aware["req_per_s"] / one["req_per_s"], 2)}
    print(write_result("ray_serve", result))
    for key, value in result.items():
        print(key, value)


if __name__ == "__main__":
    main()
