"""HellaSwag-style: a 20-shot prefix of context + ending, then select among 4 endings."""
from __future__ import annotations

import random

import radixlang as sgl
from bench.workloads import Workload, sentence


def dataset(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    prefix = "".join(f"{sentence(rng, 18)} {sentence(rng, 10)}\n\n" for _ in range(20))
    return [{"prefix": prefix, "context": sentence(rng, 18),
             "endings": [" " + sentence(rng, rng.randrange(8, 14)) for _ in range(4)]} for _ in range(n)]


@sgl.function
def hellaswag(s, prefix, context, endings):
    s += prefix + context
    s += sgl.select("ending", endings)


WORKLOAD = Workload("hellaswag_20shot_select", hellaswag, dataset, ("ending",), quick_n=2, full_n=32)
