"""Data parallelism: dp=2 with the cache-aware router vs round robin, in one run.

    python -m bench.dp_routing [--quick] [--engine-only]

Workload: several few-shot prefixes (one per topic seed), each asked several
questions; the requests of a wave are shuffled together and submitted at once,
and the waves run one after another so the replicas' caches warm up. Both
engines see the same token ids. Two KV sizes: "roomy" (every prefix fits in
every replica) and "tight" (a replica's pool holds 75% of the prefixes' tokens,
so round robin, which sends every prefix everywhere, makes the replicas evict,
while cache-aware routing splits the prefixes between them, as SGLang's router
does for a fleet whose caches cannot each hold the whole working set).

Reported per policy: the prompt-token hit rate (cached / prompt tokens, summed
over the replicas), requests/s over all waves, and how many requests each
replica served. The same cells run through the in-process Engine and through a
launched server (HTTP /generate, one batched call per wave; --engine-only skips
the server): both run the one request front, so their routing, and so their hit
rates, should agree; "server_vs_engine" reports the hit-rate ratio and whether
every replica served the same number of requests. Full run: SmolLM2; --quick: a
small random-weight Llama with SmolLM2's tokenizer and fewer requests.
"""
from __future__ import annotations

import argparse
import json
import random
import shutil
import tempfile
import time
from pathlib import Path

import httpx

from bench.common import timed, write_result
from bench.prefix_sharing import few_shot_prompts
from radixlang import Engine
from radixlang.runtime.models.loader.model_loader import resolve_model_dir
from radixlang.runtime.dp.router import Router

POLICIES = ("cache_aware", "round_robin")
SCENARIOS = ("roomy", "tight")  # roomy: every prefix fits in every replica's KV pool; tight: see TIGHT
TIGHT = 0.75  # each replica's pool holds 75% of the distinct prompt tokens: enough for its share, not for all
GREEDY = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}


def waves(tokenizer, *, num_prefixes: int, per_prefix: int, num_waves: int, seed: int = 0) -> list[list[list[int]]]:
    """num_waves lists of num_prefixes * per_prefix prompts (token ids), shuffled within each wave."""
    rng = random.Random(seed)
    pools = [few_shot_prompts(per_prefix * num_waves, seed=100 + p) for p in range(num_prefixes)]
    out = []
    for w in range(num_waves):
        texts = [pool[w * per_prefix + i] for pool in pools for i in range(per_prefix)]
        rng.shuffle(texts)
        out.append([tokenizer.encode(t, add_special_tokens=False) for t in texts])
    return out


class ServerClient:
    """The three Engine calls run_policy makes, over a launched server's HTTP API."""

    def __init__(self, url: str) -> None:
        self.client = httpx.Client(base_url=url, timeout=600)

    def generate(self, *, input_ids: list[list[int]], sampling_params: dict) -> list[dict]:
        r = self.client.post("/generate", json={"input_ids": input_ids, "sampling_params": sampling_params})
        r.raise_for_status()
        return r.json()

    def flush_cache(self) -> bool:
        return self.client.post("/flush_cache").status_code == 200

    def get_server_info(self) -> dict:
        return self.client.get("/get_server_info").json()

    def check_memory_leak(self) -> None:
        pass  # no HTTP route: the Engine cell of the same run checks it


def run_server(kw: dict, policy: str, pool: int, workload: list[list[list[int]]]) -> dict:
    from radixlang.lang.backends.runtime import Runtime
    with Runtime(launch_timeout=600, dp_size=2, load_balance_method=policy, max_total_tokens=pool,
                 log_level="warning", **kw) as runtime:
        return run_policy(ServerClient(runtime.url), workload)


def run_policy(engine: Engine | ServerClient, workload: list[list[list[int]]]) -> dict:
    engine.generate(input_ids=[[11, 12, 13], [21, 22, 23]], sampling_params=GREEDY)  # warm both replicas
    assert engine.flush_cache(), "flush_cache refused: the engine is not idle"
    before = engine.get_server_info()
    wall = 0.0
    for wave in workload:
        _, t = timed(engine.generate, input_ids=wave, sampling_params=GREEDY)
        wall += t
    after = engine.get_server_info()
    engine.check_memory_leak()
    diff = {k: after[k] - before[k] for k in ("prompt_tokens", "cached_tokens", "num_requests")}
    per_replica = [a["num_requests"] - b["num_requests"] for a, b in zip(after["replicas"], before["replicas"])]
    return {"hit_rate": diff["cached_tokens"] / max(diff["prompt_tokens"], 1),
            "requests_s": diff["num_requests"] / wall, "wall_s": wall, "requests_per_replica": per_replica,
            **diff}


def router_select_us(workload: list[list[list[int]]], repeats: int = 20) -> float:
    """Microseconds per cache-aware select + finished on this workload's prompts (2 replicas)."""
    prompts = [ids for wave in workload for ids in wave]
    router = Router(2, max_tree_tokens=32768)
    start = time.perf_counter()
    for _ in range(repeats):
        for ids in prompts:
            router.finished(router.select(ids))
    return (time.perf_counter() - start) / (repeats * len(prompts)) * 1e6


def tiny_model_dir(path: Path) -> str:
    """A 4-layer random Llama config with the embedded model's tokenizer (weights: load_format=dummy)."""
    src = Path(resolve_model_dir(None))
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (src / name).exists():
            shutil.copy(src / name, path / name)
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 49152,
              "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 4, "num_attention_heads": 4,
              "num_key_value_heads": 2, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5,
              "rope_theta": 50000.0, "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2}
    (path / "config.json").write_text(json.dumps(config))
    return str(path)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="tiny random model, fewer requests")
    ap.add_argument("--engine-only", action="store_true", help="skip the server cells")
    args = ap.parse_args()
    shape = dict(num_prefixes=4, per_prefix=2, num_waves=3) if args.quick else \
        dict(num_prefixes=8, per_prefix=2, num_waves=4)
    results: dict = {"model": "tiny-random-llama" if args.quick else "SmolLM2-135M-Instruct", "dp_size": 2,
                     "workload": shape}
    with tempfile.TemporaryDirectory() as tmp:
        kw = {"model_path": tiny_model_dir(Path(tmp)), "load_format": "dummy"} if args.quick else {}
        workload: list[list[list[int]]] = []
        for scenario in SCENARIOS:
            for policy in POLICIES:
                start = time.perf_counter()
                # the first engine tokenizes the workload; "tight" sizes each replica's pool from it
                pool = 32768 if scenario == "roomy" else int(TIGHT * shape["num_prefixes"] * len(workload[0][0]))
                with Engine(dp_size=2, load_balance_method=policy, max_total_tokens=pool, **kw) as engine:
                    workload = workload or waves(engine.tokenizer, **shape)
                    row = run_policy(engine, workload)
                results.setdefault(scenario, {"kv_tokens_per_replica": pool})[policy] = row
                print(f"{scenario} {policy}: built and ran in {time.perf_counter() - start:.1f}s")
                if not args.engine_only:
                    start = time.perf_counter()
                    results[scenario].setdefault("server", {})[policy] = run_server(kw, policy, pool, workload)
                    print(f"{scenario} {policy} (server): launched and ran in {time.perf_counter() - start:.1f}s")
    n = sum(len(w) for w in workload)
    print(f"{n} requests in {shape['num_waves']} waves, {shape['num_prefixes']} few-shot prefixes, "
          f"~{len(workload[0][0])} prompt tokens each")
    for scenario in SCENARIOS:
        res = results[scenario]
        aware, rr = res["cache_aware"], res["round_robin"]
        res["ratios"] = {"hit_rate": aware["hit_rate"] / max(rr["hit_rate"], 1e-9),
                         "requests_s": aware["requests_s"] / rr["requests_s"]}
        print(f"{scenario} (KV pool {res['kv_tokens_per_replica']} tokens per replica):")
        for policy in POLICIES:
            r = res[policy]
            print(f"  {policy:12s} hit rate {r['hit_rate']:.3f}  {r['requests_s']:.2f} req/s  "
                  f"per replica {r['requests_per_replica']}")
        print(f"  cache_aware / round_robin: hit rate {res['ratios']['hit_rate']:.2f}x, "
              f"throughput {res['ratios']['requests_s']:.2f}x")
        for policy in POLICIES if "server" in res else ():
            srv, eng = res["server"][policy], res[policy]
            res.setdefault("server_vs_engine", {})[policy] = {
                "hit_rate": srv["hit_rate"] / max(eng["hit_rate"], 1e-9),
                "same_requests_per_replica": srv["requests_per_replica"] == eng["requests_per_replica"]}
            ratio = res["server_vs_engine"][policy]["hit_rate"]
            print(f"  server {policy:12s} hit rate {srv['hit_rate']:.3f}  {srv['requests_s']:.2f} req/s  "
                  f"per replica {srv['requests_per_replica']}  (hit rate {ratio:.2f}x the engine's)")
    results["router_select_us"] = router_select_us(workload)
    print(f"router: {results['router_select_us']:.0f} us per cache-aware select + finished")
    print("wrote", write_result("dp_routing", results))


if __name__ == "__main__":
    main()
