"""MMLU-style: a shared 5-shot prefix (~380 tokens), a ~72-token question, a 1-token answer via gen and via select."""
from __future__ import annotations

import random

import radixlang as sgl
from bench.workloads import TOPICS, Workload, sentence


def _question(rng: random.Random) -> str:
    opts = "".join(f"{c}. {sentence(rng, 6)}\n" for c in "ABCD")
    return f"Question: {sentence(rng, 25)}\n{opts}Answer:"


def few_shot_prefix(seed: int = 0) -> str:
    rng = random.Random(seed)
    shots = "".join(_question(rng) + f" {rng.choice('ABCD')}\n\n" for _ in range(5))
    return f"The following are multiple choice questions about {rng.choice(TOPICS)}.\n\n" + shots


def dataset(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed + 1)
    prefix = few_shot_prefix(seed)
    return [{"prefix": prefix, "question": _question(rng)} for _ in range(n)]


@sgl.function
def mmlu_gen(s, prefix, question):
    s += prefix + question
    s += sgl.gen("answer", max_tokens=1)


@sgl.function
def mmlu_select(s, prefix, question):
    s += prefix + question
    s += sgl.select("answer", [" A", " B", " C", " D"])


GEN = Workload("mmlu_5shot_gen", mmlu_gen, dataset, ("answer",), quick_n=8, full_n=64)
SELECT = Workload("mmlu_5shot_select", mmlu_select, dataset, ("answer",), quick_n=4, full_n=64)
