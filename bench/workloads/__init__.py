"""Whole-program workloads in the spirit of SGLang's paper: each is a DSL program plus a seeded local dataset."""
from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any, Callable

TOPICS = ["astronomy", "biology", "chemistry", "economics", "geography", "history", "law", "medicine",
          "music", "philosophy", "physics", "statistics"]
WORDS = ("the a river city engine theory market cell planet court melody proof signal ratio garden window "
         "stone letter bridge forest number storm voice paper light metal field story table").split()


def sentence(rng: random.Random, n: int) -> str:
    """A pseudo-English sentence of n words: realistic token counts without any download."""
    return " ".join(rng.choice(WORDS) for _ in range(n)).capitalize() + "."


@dataclass(frozen=True)
class Workload:
    name: str
    program: Any  # an @sgl.function
    dataset: Callable[[int, int], list[dict[str, Any]]]  # (n, seed) -> program arguments
    outputs: tuple[str, ...]  # variables every finished program must hold
    quick_n: int
    full_n: int
    sampling: dict[str, Any] = field(default_factory=lambda: {"temperature": 0})


def all_workloads() -> list[Workload]:
    from bench.workloads import agent, chat, fewshot, hellaswag, json_extract, mmlu, skeleton, tree_of_thought
    return [mmlu.GEN, mmlu.SELECT, hellaswag.WORKLOAD, json_extract.WORKLOAD, chat.SHORT, chat.LONG,
            agent.WORKLOAD, tree_of_thought.WORKLOAD, skeleton.WORKLOAD, fewshot.WORKLOAD]
