"""Agent loop, 4 steps: select a tool, generate its JSON arguments, append a canned tool result."""
from __future__ import annotations

import random

import radixlang as sgl
from bench.workloads import TOPICS, Workload, sentence

TOOLS = ["search", "calculator", "weather", "lookup"]
ARGS = {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}
STEPS = 4


def dataset(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    return [{"task": f"Research {rng.choice(TOPICS)}: {sentence(rng, 20)}",
             "results": [sentence(rng, 25) for _ in range(STEPS)]} for _ in range(n)]


@sgl.function
def agent(s, task, results):
    s += sgl.system("You are an agent. Tools: search, calculator, weather, lookup. Answer in JSON arguments.")
    s += sgl.user(task)
    for step in range(STEPS):
        s += sgl.assistant("Tool: " + sgl.select(f"tool_{step}", TOOLS) + "\nArguments: "
                           + sgl.gen(f"args_{step}", max_tokens=24, json_schema=ARGS))
        s += sgl.user("Tool result: " + results[step])


WORKLOAD = Workload("agent_4step", agent, dataset,
                    tuple(f"{k}_{i}" for i in range(STEPS) for k in ("tool", "args")), quick_n=2, full_n=16)
