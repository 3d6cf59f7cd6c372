"""Multi-turn chat: each turn resends the whole history (short: 2 turns x 8 tokens; long: 4 turns x 32)."""
from __future__ import annotations

import random

import radixlang as sgl
from bench.workloads import TOPICS, Workload, sentence


def _dataset(turns: int, words: int):
    def make(n: int, seed: int = 0) -> list[dict]:
        rng = random.Random(seed)
        return [{"system": f"You are a helpful assistant who knows {rng.choice(TOPICS)}. {sentence(rng, 30)}",
                 "questions": [sentence(rng, words) + " Why?" for _ in range(turns)]} for _ in range(n)]
    return make


def _program(max_tokens: int):
    @sgl.function
    def chat(s, system, questions):
        s += sgl.system(system)
        for i, q in enumerate(questions):
            s += sgl.user(q)
            s += sgl.assistant(sgl.gen(f"turn_{i}", max_tokens=max_tokens))
    return chat


SHORT = Workload("chat_short", _program(8), _dataset(2, 12), ("turn_0", "turn_1"), quick_n=4, full_n=32)
LONG = Workload("chat_long", _program(32), _dataset(4, 40), ("turn_0", "turn_1", "turn_2", "turn_3"),
                quick_n=2, full_n=16)
