"""Fixtures for grammar tests: the SmolLM2 tokenizer and a random-walk "model"."""

from __future__ import annotations

import os
import random
from collections import deque
from collections.abc import Callable

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from radixlang.constrained import BACKENDS, CompiledGrammar, Grammar, GrammarCompiler, TokenizerInfo  # noqa: E402
from radixlang.kernels.bitmask import unpack_bitmask  # noqa: E402


@pytest.fixture(scope="session")
def smollm_tokenizer(smollm_path: str):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(smollm_path)


@pytest.fixture(scope="session")
def smollm_info(smollm_tokenizer) -> TokenizerInfo:
    return TokenizerInfo.from_tokenizer(smollm_tokenizer)


@pytest.fixture(scope="module")
def compilers(request):
    """One GrammarCompiler per backend over the module's tokenizer: its ``info`` fixture, or the fixture its
    ``COMPILER_INFO`` names (each module picks the vocabulary its grammars are tested on)."""
    info = request.getfixturevalue(getattr(request.module, "COMPILER_INFO", "info"))
    made = {name: GrammarCompiler(info, backend=name, cache_size=256) for name in BACKENDS}
    yield made
    for c in made.values():
        c.shutdown()


@pytest.fixture(scope="session")
def smollm_compiler(smollm_info: TokenizerInfo):
    compiler = GrammarCompiler(smollm_info, cache_size=128)
    yield compiler
    compiler.shutdown()


class DistanceToAccept:
    """Shortest number of bytes from a state to an accepting state (over single-byte tokens)."""

    def __init__(self, compiled: CompiledGrammar) -> None:
        self.compiled = compiled
        self.edges: dict[int, list[tuple[int, int]]] = {}  # state -> [(token_id, next_state)]
        self.dist: dict[int, int] = {}

    def _explore(self, start: int) -> None:
        single = [t for t in self.compiled.tokenizer_info.single_byte_ids if t >= 0]
        todo = [start]
        while todo:
            s = todo.pop()
            if s in self.edges:
                continue
            out = [(t, n) for t in single if (n := self.compiled.next_state(s, t)) is not None]
            self.edges[s] = out
            todo.extend(n for _, n in out if n not in self.edges)
        reverse: dict[int, list[int]] = {}
        for s, out in self.edges.items():
            for _, n in out:
                reverse.setdefault(n, []).append(s)
        self.dist = {s: 0 for s in self.edges if self.compiled.is_final(s)}
        queue = deque(self.dist)
        while queue:
            s = queue.popleft()
            for p in reverse.get(s, []):
                if p not in self.dist:
                    self.dist[p] = self.dist[s] + 1
                    queue.append(p)

    def best_token(self, state: int, rng: random.Random) -> int:
        if state not in self.edges:
            self._explore(state)
        options = [(self.dist.get(n, 1 << 30), t) for t, n in self.edges[state]]
        best = min(d for d, _ in options)
        return rng.choice([t for d, t in options if d == best])


def random_walk(grammar: Grammar, rng: random.Random, *, explore_steps: int = 24,
                max_steps: int = 2000, distances: DistanceToAccept | None = None) -> bytes:
    """Sample uniformly among allowed tokens, then head for acceptance; returns the output bytes.

    Every step checks that the mask and accept_token agree on the chosen token and
    on a few disallowed ones.
    """
    info = grammar.compiled.tokenizer_info
    distances = distances or DistanceToAccept(grammar.compiled)
    row = torch.zeros(info.num_words(), dtype=torch.int32)
    out = bytearray()
    for step in range(max_steps):
        grammar.allowed_token_mask(row)
        allowed = unpack_bitmask(row.unsqueeze(0), info.vocab_size)[0]  # [vocab] bool
        allowed_ids = allowed.nonzero().flatten()
        assert allowed_ids.numel() > 0, "a live state must allow some token"
        for t in rng.sample(range(info.vocab_size), 3):
            if not allowed[t]:
                assert not grammar.copy().accept_token(t)
        eos_allowed = [t for t in info.eos_token_ids if allowed[t]]
        assert bool(eos_allowed) == grammar.is_accepting()
        if step < explore_steps:
            token = int(allowed_ids[rng.randrange(allowed_ids.numel())])
        elif eos_allowed:
            token = eos_allowed[0]
        else:
            token = distances.best_token(grammar.state, rng)
            assert allowed[token]
        assert grammar.accept_token(token)
        if grammar.is_terminated():
            return bytes(out)
        out += info.token_bytes[token]
    raise AssertionError(f"no EOS after {max_steps} steps: {bytes(out)[:200]!r}")


@pytest.fixture(scope="session")
def walk() -> Callable[..., list[str]]:
    """walk(compiled, seeds) -> the decoded outputs of one random walk per seed."""

    def run(compiled: CompiledGrammar, seeds: tuple[int, ...] = (0, 1, 2)) -> list[str]:
        distances = DistanceToAccept(compiled)
        return [random_walk(Grammar(compiled), random.Random(seed), distances=distances).decode("utf-8")
                for seed in seeds]

    return run
