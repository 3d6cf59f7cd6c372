"""JSON extraction: read a short biography, emit an object that follows a schema (constrained decoding)."""
from __future__ import annotations

import random

import radixlang as sgl
from bench.workloads import TOPICS, Workload, sentence

SCHEMA = {"type": "object",
          "properties": {"name": {"type": "string"}, "age": {"type": "integer"}, "field": {"type": "string"}},
          "required": ["name", "age", "field"]}
NAMES = ["Ada", "Alan", "Grace", "Edsger", "Barbara", "Donald", "Frances", "John", "Leslie", "Margaret"]


def dataset(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    return [{"bio": f"{rng.choice(NAMES)} is {rng.randrange(20, 90)} years old and works in "
                    f"{rng.choice(TOPICS)}. {sentence(rng, 40)}"} for _ in range(n)]


@sgl.function
def extract(s, bio):
    s += "Extract the person's name, age and field as JSON.\n"
    s += "Text: " + bio + "\nJSON: "
    s += sgl.gen("info", max_tokens=48, json_schema=SCHEMA)


WORKLOAD = Workload("json_extraction", extract, dataset, ("info",), quick_n=4, full_n=32)
