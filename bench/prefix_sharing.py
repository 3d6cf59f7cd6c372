"""Prefix sharing: radix cache on vs --disable-radix-cache, in one run, on SmolLM2.

    python -m bench.prefix_sharing [--quick]

Few-shot: 64 questions behind one ~600-token 5-shot prefix, 8 new tokens each, all
submitted together. Multi-turn: 8 chats x 4 turns, each turn resending the history.
Also a radix-tree microbenchmark (match_prefix + insert ops/s).
"""
from __future__ import annotations

import argparse
import random
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from bench.common import threads, timed, write_result
from radixlang import Engine
from radixlang.radix_cache import RadixCache

TOPICS = ["astronomy", "biology", "chemistry", "economics", "geography", "history", "law", "medicine",
          "music", "philosophy", "physics", "statistics"]


def few_shot_prompts(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    shots = []
    for i in range(5):
        facts = " ".join(f"Fact {j}: the {rng.choice(TOPICS)} result number {rng.randrange(1000)} holds."
                         for j in range(9))
        shots.append(f"Question {i + 1}: {facts}\nWhich statement is true?\nA. first\nB. second\nC. third\n"
                     f"D. fourth\nAnswer: {rng.choice('ABCD')}\n\n")
    prefix = "The following are multiple choice questions.\n\n" + "".join(shots)
    return [prefix + f"Question: what is {rng.randrange(100)} plus {rng.randrange(100)} in "
            f"{rng.choice(TOPICS)}?\nA. 1\nB. 2\nC. 3\nD. 4\nAnswer:" for _ in range(n)]


def run_few_shot(engine: Engine, prompts: list[str]) -> tuple[float, float]:
    engine.flush_cache()
    before = engine.get_server_info()
    _, t = timed(engine.generate, prompts, {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True})
    after = engine.get_server_info()
    prompt_tokens = after["prompt_tokens"] - before["prompt_tokens"]
    cached = after["cached_tokens"] - before["cached_tokens"]
    return len(prompts) / t, cached / max(prompt_tokens, 1)


def run_chat(engine: Engine, chats: int, turns: int) -> tuple[float, float]:
    engine.flush_cache()
    before = engine.get_server_info()
    rng = random.Random(1)
    tok = engine.tokenizer

    def one_chat(c: int) -> None:
        messages = [{"role": "system", "content": f"You are assistant number {c}. Be brief."}]
        for t in range(turns):
            messages.append({"role": "user", "content": f"Tell me about {rng.choice(TOPICS)} item {t}."})
            text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            out = engine.generate(text, {"temperature": 0, "max_new_tokens": 16, "ignore_eos": True})
            messages.append({"role": "assistant", "content": out["text"]})

    start = time.perf_counter()
    with ThreadPoolExecutor(chats) as pool:
        list(pool.map(one_chat, range(chats)))
    elapsed = time.perf_counter() - start
    after = engine.get_server_info()
    hit = (after["cached_tokens"] - before["cached_tokens"]) / max(after["prompt_tokens"] - before["prompt_tokens"], 1)
    return chats * turns / elapsed, hit


def radix_micro(num_keys: int, seed: int = 0) -> float:
    rng = random.Random(seed)
    prefixes = [[rng.randrange(50000) for _ in range(rng.randrange(50, 500))] for _ in range(300)]
    keys = [rng.choice(prefixes) + [rng.randrange(50000) for _ in range(rng.randrange(5, 50))]
            for _ in range(num_keys)]
    tree = RadixCache()
    slot = 0
    start = time.perf_counter()
    for k in keys:
        tree.match_prefix(k)
        tree.insert(k, torch.arange(slot, slot + len(k)))
        slot += len(k)
    return 2 * num_keys / (time.perf_counter() - start)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    n = 16 if args.quick else 64
    prompts = few_shot_prompts(n)
    results = {}
    for name, kw in (("cache", {}), ("no_cache", {"disable_radix_cache": True})):
        with Engine(max_total_tokens=65536, num_threads=threads(), **kw) as engine:
            plen = len(engine.tokenizer.encode(prompts[0], add_special_tokens=False))
            fs, fs_hit = run_few_shot(engine, prompts)
            chat, chat_hit = run_chat(engine, 4 if args.quick else 8, 4)
            results[name] = {"few_shot_programs_s": fs, "few_shot_hit_rate": fs_hit,
                             "chat_turns_s": chat, "chat_hit_rate": chat_hit, "prompt_tokens": plen}
    on, off = results["cache"], results["no_cache"]
    results["ratios"] = {"few_shot": on["few_shot_programs_s"] / off["few_shot_programs_s"],
                         "chat": on["chat_turns_s"] / off["chat_turns_s"]}
    results["radix_ops_s"] = radix_micro(20_000 if args.quick else 100_000)
    print(f"few-shot ({n} x ~{on['prompt_tokens']} tokens, 8 new): cache {on['few_shot_programs_s']:.2f}/s, "
          f"no cache {off['few_shot_programs_s']:.2f}/s -> {results['ratios']['few_shot']:.2f}x, "
          f"hit rate {on['few_shot_hit_rate']:.3f}")
    print(f"multi-turn chat: cache {on['chat_turns_s']:.2f} turns/s, no cache {off['chat_turns_s']:.2f} turns/s "
          f"-> {results['ratios']['chat']:.2f}x, hit rate {on['chat_hit_rate']:.3f}")
    print(f"radix match_prefix + insert: {results['radix_ops_s']:.0f} ops/s")
    print("wrote", write_result("prefix_sharing", results))


if __name__ == "__main__":
    main()
