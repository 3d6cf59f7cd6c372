"""Per-token scores kept in the radix tree: stored beside the KV, split with nodes, merged (known over
unknown, wider top-k over narrower), dropped on eviction; checked against a dict oracle."""
from __future__ import annotations

import math
import random

import pytest
import torch

from radixlang.radix_cache import RadixCache, SWARadixCache
from radixlang.radix_cache.scores import TokenScores

NAN = float("nan")


def _scores(vals: list[float], tops: list[list[float]] | None = None) -> TokenScores:
    lp = torch.tensor(vals, dtype=torch.float32)
    if tops is None:
        return TokenScores(lp)
    width = max(len(t) for t in tops)
    tv = torch.tensor([t + [NAN] * (width - len(t)) for t in tops], dtype=torch.float32)
    ti = torch.tensor([[i + 1 for i in range(width)] for _ in tops], dtype=torch.int32)
    return TokenScores(lp, tv, ti)


def _vals(s: TokenScores) -> list[float | None]:
    return [None if math.isnan(v) else v for v in s.logprobs.tolist()]


def test_store_read_split_and_evict():
    tree = RadixCache()
    tree.insert([1, 2, 3, 4], torch.arange(4))
    assert _vals(tree.prefix_scores([1, 2, 3, 4, 5])) == [None] * 4  # inserted without scores
    assert tree.store_scores([1, 2, 3, 4], _scores([NAN, -1.0, -2.0, -3.0])) == 4
    tree.insert([1, 2, 9], torch.tensor([0, 1, 10]))  # splits the node after [1, 2]
    tree.check_integrity()
    assert _vals(tree.prefix_scores([1, 2, 3, 4])) == [None, -1.0, -2.0, -3.0]
    assert _vals(tree.prefix_scores([1, 2, 9])) == [None, -1.0, None]
    assert _vals(tree.prefix_scores([1, 2, 3, 7])) == [None, -1.0, -2.0]  # stops inside a node
    assert len(tree.prefix_scores([5, 6])) == 0
    tree.evict(10, lambda kv: None)
    assert len(tree.prefix_scores([1, 2, 3, 4])) == 0
    tree.insert([1, 2, 3, 4], torch.arange(4))
    assert _vals(tree.prefix_scores([1, 2, 3, 4])) == [None] * 4  # the evicted scores are gone with the KV


def test_known_wins_and_wider_top_k_wins():
    tree = RadixCache()
    tree.insert([1, 2, 3], torch.arange(3))
    tree.store_scores([1, 2, 3], _scores([NAN, -1.0, NAN], [[NAN], [-0.5], [NAN]]))
    tree.store_scores([1, 2, 3], _scores([NAN, NAN, -2.0], [[NAN, NAN], [NAN, NAN], [-0.1, -0.2]]))
    got = tree.prefix_scores([1, 2, 3])
    assert _vals(got) == [None, -1.0, -2.0]
    assert got.top_known().tolist() == [0, 1, 2]
    tree.store_scores([1, 2, 3], _scores([NAN, -1.0, -2.0], [[NAN, NAN], [-0.5, -0.7], [-0.1, NAN]]))
    got = tree.prefix_scores([1, 2, 3])
    assert got.top_known().tolist() == [0, 2, 2]  # row 1 widened; row 2 kept its wider top-2
    assert got.top_values is not None and got.top_values[2].tolist() == pytest.approx([-0.1, -0.2])


def test_store_on_a_partly_cached_key_and_namespaces():
    tree = RadixCache()
    tree.insert([1, 2, 3, 4], torch.arange(4))
    assert tree.store_scores([1, 2, 8], _scores([NAN, -1.0, -9.0])) == 2  # only [1, 2] is cached
    assert _vals(tree.prefix_scores([1, 2, 3, 4])) == [None, -1.0, None, None]
    tree.insert([1, 2], torch.arange(2), namespace=("lora", 1))
    assert _vals(tree.prefix_scores([1, 2], namespace=("lora", 1))) == [None, None]  # per namespace
    with pytest.raises(ValueError):
        tree.store_scores([1, 2], _scores([-1.0]))


def test_swa_tree_splits_scores_too():
    tree = SWARadixCache(window=2)
    tree.insert([1, 2, 3, 4], torch.arange(4))
    tree.store_scores([1, 2, 3, 4], _scores([NAN, -1.0, -2.0, -3.0]))
    tree.match_prefix([1, 2, 5])
    tree.check_integrity()
    assert _vals(tree.prefix_scores([1, 2, 3, 4])) == [None, -1.0, -2.0, -3.0]


@pytest.mark.parametrize("seed", range(4))
def test_random_against_an_oracle(seed):
    """Random inserts, stores, matches and evictions; a dict from prefix to the score of its last token is
    the oracle for every position that is still cached."""
    rng = random.Random(seed)
    tree = RadixCache(page_size=rng.choice([1, 2]))
    oracle: dict[tuple[int, ...], float] = {}
    for _ in range(200):
        key = [rng.randrange(4) for _ in range(rng.randrange(1, 9))]
        op = rng.random()
        if op < 0.4:
            tree.insert(key, torch.arange(len(key)))
        elif op < 0.7:
            cached = len(tree.prefix_scores(key))
            vals = [float(-rng.randrange(1, 50)) if rng.random() < 0.7 else NAN for _ in key]
            for i in range(cached):  # a token's score depends only on its prefix: keep the oracle's
                vals[i] = oracle.get(tuple(key[:i + 1]), vals[i])
            n = tree.store_scores(key, _scores(vals))
            for i in range(n):
                if not math.isnan(vals[i]):
                    oracle.setdefault(tuple(key[:i + 1]), vals[i])
        elif op < 0.85:
            tree.match_prefix(key)
        else:
            tree.evict(rng.randrange(1, 6), lambda kv: None)
        tree.check_integrity()
        got = tree.prefix_scores(key)
        for i, v in enumerate(_vals(got)):
            want = oracle.get(tuple(key[:i + 1]))
            if v is not None:
                assert v == want  # evicted prefixes may come back unscored, never with a wrong score
