"""Skeleton of thought: generate a 3-point skeleton, expand each point in parallel, then summarize."""
from __future__ import annotations

import random

import radixlang as sgl
from bench.workloads import TOPICS, Workload, sentence

POINTS = 3


def dataset(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    return [{"question": f"How should a student learn {rng.choice(TOPICS)}? {sentence(rng, 30)}"}
            for _ in range(n)]


@sgl.function
def skeleton_of_thought(s, question):
    s += sgl.user(question + f" First give a skeleton of {POINTS} short points.")
    s += sgl.assistant(sgl.gen("skeleton", max_tokens=32))
    points = s.fork(POINTS)
    for i, p in enumerate(points):
        p += sgl.user(f"Expand point {i + 1} in two sentences.")
        p += sgl.assistant(sgl.gen("expansion", max_tokens=32))
    points.join()
    s += sgl.user("Summarize in one sentence.")
    s += sgl.assistant(sgl.gen("summary", max_tokens=16))


WORKLOAD = Workload("skeleton_of_thought", skeleton_of_thought, dataset, ("skeleton", "expansion", "summary"),
                    quick_n=2, full_n=16)
