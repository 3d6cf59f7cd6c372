"""The headline case of issue #8: requests sharing a ~417-token few-shot prefix, 16 new tokens each (greedy).

The full run has issue #8's 32 requests (`bench.fewshot` measures exactly those, best of three turns);
--quick runs 16.

llama.cpp serving them one at a time recomputes only what differs from the previous prompt; radixlang
batches the 32 and computes the shared prefix once.
"""
from __future__ import annotations

import random

import radixlang as sgl
from bench.workloads import Workload, sentence

SHOTS = 10  # -> 419 prompt tokens of shared prefix with SmolLM2's tokenizer
NEW_TOKENS = 16


def _shot(rng: random.Random) -> str:
    return f"Q: {sentence(rng, 14)} Why?\nA:"


def few_shot_prefix(seed: int = 0) -> str:
    rng = random.Random(seed)
    shots = "".join(f"{_shot(rng)} {sentence(rng, 16)}\n\n" for _ in range(SHOTS))
    return "Answer each question in one sentence.\n\n" + shots


def dataset(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed + 1)
    prefix = few_shot_prefix(seed)
    return [{"prefix": prefix, "question": _shot(rng)} for _ in range(n)]


@sgl.function
def fewshot(s, prefix, question):
    s += prefix + question
    s += sgl.gen("answer", max_tokens=NEW_TOKENS)


WORKLOAD = Workload("fewshot_417", fewshot, dataset, ("answer",), quick_n=16, full_n=32)
