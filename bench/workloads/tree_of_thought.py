"""Tree of thought: fork 3 thoughts, fork each 3 ways again (depth 2), then pick a final answer."""
from __future__ import annotations

import random

import radixlang as sgl
from bench.workloads import Workload, sentence

WIDTH = 3


def dataset(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    return [{"problem": sentence(rng, 60)} for _ in range(n)]


@sgl.function
def tree_of_thought(s, problem):
    s += "Solve the problem step by step.\nProblem: " + problem + "\n"
    thoughts = s.fork(WIDTH)
    for i, t in enumerate(thoughts):
        t += f"Thought {i + 1}:" + sgl.gen("thought", max_tokens=16, stop="\n") + "\n"
        leaves = t.fork(WIDTH)
        for j, leaf in enumerate(leaves):
            leaf += f"Refinement {j + 1}:" + sgl.gen("refine", max_tokens=16, stop="\n")
        leaves.join()
    thoughts.join()
    s += "Best thought: " + sgl.select("best", [f" {i + 1}" for i in range(WIDTH)])


WORKLOAD = Workload("tree_of_thought", tree_of_thought, dataset, ("thought", "best"), quick_n=2, full_n=16)
