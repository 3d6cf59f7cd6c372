"""Seeded local datasets for bench.serving: random token ids, so input lengths are exact and nothing is downloaded.

- ``random``: each request draws its input and output lengths uniformly from a range.
- ``shared-prefix``: G groups, each a long system prompt shared by its questions (the radix
  cache's case); requests are shuffled so the groups interleave as independent users would.
"""
from __future__ import annotations

import argparse
import random
from dataclasses import dataclass

# (quick, full) defaults; --quick is sized for ~2-3 minutes on SmolLM2 with 2 cores, both servers included
DEFAULTS = {"num_prompts": (24, 96), "random_input_len": ((64, 512), (128, 1024)),
            "random_output_len": ((8, 48), (16, 128)), "num_groups": (4, 8), "prompts_per_group": (8, 16),
            "system_prompt_len": (400, 800), "question_len": (32, 64), "output_len": (16, 64)}


@dataclass(frozen=True)
class BenchRequest:
    input_ids: list[int]
    output_len: int


def _ids(rng: random.Random, n: int, vocab_size: int) -> list[int]:
    low = min(1000, vocab_size // 2)  # stay clear of the special and control tokens at the start of the vocab
    return [rng.randrange(low, vocab_size) for _ in range(n)]


def random_dataset(n: int, input_len: tuple[int, int], output_len: tuple[int, int], vocab_size: int,
                   seed: int = 0) -> list[BenchRequest]:
    if n < 1 or not 1 <= input_len[0] <= input_len[1] or not 1 <= output_len[0] <= output_len[1]:
        raise ValueError(f"need n >= 1 and 1 <= MIN <= MAX lengths, got n={n}, input {input_len}, output {output_len}")
    rng = random.Random(seed)
    return [BenchRequest(_ids(rng, rng.randint(*input_len), vocab_size), rng.randint(*output_len)) for _ in range(n)]


def shared_prefix_dataset(num_groups: int, per_group: int, system_len: int, question_len: int, output_len: int,
                          vocab_size: int, seed: int = 0) -> list[BenchRequest]:
    if min(num_groups, per_group, system_len, question_len, output_len) < 1:
        raise ValueError(f"every shared-prefix size must be >= 1, got groups={num_groups}, per_group={per_group}, "
                         f"system={system_len}, question={question_len}, output={output_len}")
    rng = random.Random(seed)
    out = []
    for _ in range(num_groups):
        system = _ids(rng, system_len, vocab_size)
        out += [BenchRequest(system + _ids(rng, question_len, vocab_size), output_len) for _ in range(per_group)]
    rng.shuffle(out)
    return out


def make_dataset(args: argparse.Namespace, vocab_size: int) -> list[BenchRequest]:
    """The dataset named by args.dataset; unset sizes take the --quick or full default."""
    pick = {k: (getattr(args, k) if getattr(args, k) is not None else v[0 if args.quick else 1])
            for k, v in DEFAULTS.items()}
    if args.dataset == "random":
        return random_dataset(pick["num_prompts"], tuple(pick["random_input_len"]), tuple(pick["random_output_len"]),
                              vocab_size, args.seed)
    return shared_prefix_dataset(pick["num_groups"], pick["prompts_per_group"], pick["system_prompt_len"],
                                 pick["question_len"], pick["output_len"], vocab_size, args.seed)
