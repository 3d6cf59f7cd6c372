"""Multi-turn chat: each turn resends the whole history (short: 2 turns x 8 tokens; long: 4 turns x 32).

Every conversation starts with the same system prompt, as every conversation of one deployed
assistant does; what each user talks about comes in their first message. (With a different
system prompt per conversation, nothing of a first turn can be cached, which caps the hit rate
at what the later turns resend: 0.48 and 0.71 for these shapes.)
"""
from __future__ import annotations

import random

import radixlang as sgl
from bench.workloads import TOPICS, Workload, sentence


def system_prompt(seed: int = 0) -> str:
    rng = random.Random(seed + 100)
    rules = " ".join(sentence(rng, 12) for _ in range(8))
    return f"You are a helpful assistant. Answer briefly and plainly. {rules}"


def _dataset(turns: int, words: int):
    def make(n: int, seed: int = 0) -> list[dict]:
        rng = random.Random(seed)
        system = system_prompt(seed)
        chats = []
        for _ in range(n):
            questions = [sentence(rng, words) + " Why?" for _ in range(turns)]
            questions[0] = f"Let us talk about {rng.choice(TOPICS)}. {questions[0]}"
            chats.append({"system": system, "questions": questions})
        return chats
    return make


def _program(max_tokens: int):
    @sgl.function
    def chat(s, system, questions):
        s += sgl.system(system)
        for i, q in enumerate(questions):
            s += sgl.user(q)
            s += sgl.assistant(sgl.gen(f"turn_{i}", max_tokens=max_tokens))
    return chat


SHORT = Workload("chat_short", _program(8), _dataset(2, 12), ("turn_0", "turn_1"), quick_n=8, full_n=32)
LONG = Workload("chat_long", _program(32), _dataset(4, 40), ("turn_0", "turn_1", "turn_2", "turn_3"),
                quick_n=4, full_n=16)
