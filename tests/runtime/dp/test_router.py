"""Router: the approximate tree against a brute-force oracle, the routing rule, round robin, bounds."""
from __future__ import annotations

import random
import subprocess
import sys

import pytest

from radixlang.runtime.dp.router import ApproxTree, Router


def _common(a, b) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def _check_integrity(tree: ApproxTree) -> None:
    total, stack = 0, [tree.root]
    while stack:
        node = stack.pop()
        for first, child in node.children.items():
            assert child.parent is node and child.key and child.key[0] == first
            total += len(child.key)
            stack.append(child)
    assert total == tree.num_tokens <= tree.max_tokens


def _sequences(tree: ApproxTree) -> list[tuple[int, ...]]:
    """Every root-to-leaf id sequence the tree holds."""
    out: list[tuple[int, ...]] = []
    stack = [(tree.root, ())]
    while stack:
        node, prefix = stack.pop()
        path = prefix + node.key
        if not node.children and node is not tree.root:
            out.append(path)
        stack.extend((c, path) for c in node.children.values())
    return out


def test_tree_matches_brute_force_without_eviction():
    rng = random.Random(0)
    tree, stored = ApproxTree(max_tokens=1 << 30), []
    bases = [[rng.randrange(6) for _ in range(rng.randrange(1, 12))] for _ in range(5)]
    for _ in range(300):
        seq = rng.choice(bases)[:rng.randrange(0, 12)] + [rng.randrange(6) for _ in range(rng.randrange(0, 6))]
        probe = rng.choice(bases) + [rng.randrange(6)]
        assert tree.match(probe) == max((_common(probe, s) for s in stored), default=0)
        tree.insert(seq)
        if seq:
            stored.append(seq)
        _check_integrity(tree)
    assert sorted(_sequences(tree)) == sorted({tuple(s) for s in stored if not any(
        len(o) > len(s) and o[:len(s)] == s for o in stored)})


def test_tree_stays_bounded_and_keeps_recent_sequences():
    rng = random.Random(1)
    tree = ApproxTree(max_tokens=200)
    seqs = []
    for _ in range(500):
        seq = [rng.randrange(50) for _ in range(rng.randrange(1, 60))]
        tree.insert(seq)
        seqs.append(seq)
        _check_integrity(tree)
        assert tree.match(seq) == len(seq)  # the newest insert is never the one evicted
        for held in _sequences(tree):  # everything held is a prefix of something inserted
            assert any(list(held) == s[:len(held)] for s in seqs)
    assert len(tree._leaves) <= 2 * tree._num_nodes + 65  # stale heap entries are compacted


def test_tree_evicts_least_recently_used_first():
    tree = ApproxTree(max_tokens=30)
    a, b, c = [1] * 10, [2] * 10, [3] * 10
    for seq in (a, b, c):
        tree.insert(seq)
    tree.insert(a)  # a is now the most recent
    tree.insert([4] * 10)  # must evict b, the oldest
    assert tree.match(b) == 0 and tree.match(a) == 10 and tree.match(c) == 10


def _oracle_select(stored, loads, ids, *, threshold, abs_t, rel_t) -> int:
    n = len(loads)
    matches = [max((_common(ids, s) for s in stored[r]), default=0) for r in range(n)]
    best = min(range(n), key=lambda r: (-matches[r], loads[r], r))
    sizes = [len({tuple(s[:k]) for s in stored[r] for k in range(1, len(s) + 1)}) for r in range(n)]
    least = min(range(n), key=lambda r: (loads[r], -matches[r], sizes[r], r))
    if matches[best] < threshold * len(ids):
        return least
    if loads[best] - loads[least] > abs_t and loads[best] > rel_t * loads[least]:
        return least
    return best


@pytest.mark.parametrize("num_replicas", [1, 2, 3])
def test_cache_aware_follows_the_rule(num_replicas):
    rng = random.Random(num_replicas)
    kw = {"cache_threshold": 0.5, "balance_abs_threshold": 2, "balance_rel_threshold": 1.5}
    router = Router(num_replicas, policy="cache_aware", max_tree_tokens=1 << 30, **kw)
    prefixes = [[rng.randrange(1000) for _ in range(20)] for _ in range(4)]
    stored, loads = [[] for _ in range(num_replicas)], [0] * num_replicas
    for _ in range(400):
        if rng.random() < 0.35 and any(loads):
            r = rng.choice([i for i in range(num_replicas) if loads[i]])
            router.finished(r)
            loads[r] -= 1
            continue
        ids = rng.choice(prefixes)[:rng.randrange(0, 21)] + [rng.randrange(1000) for _ in range(rng.randrange(1, 8))]
        expected = _oracle_select(stored, loads, ids, threshold=kw["cache_threshold"],
                                  abs_t=kw["balance_abs_threshold"], rel_t=kw["balance_rel_threshold"])
        assert router.select(ids) == expected
        stored[expected].append(ids)
        loads[expected] += 1
        assert router.loads == loads


def test_cache_aware_keeps_a_prefix_on_one_replica_and_spreads_new_ones():
    router = Router(2)
    a, b = list(range(100, 140)), list(range(200, 240))
    first_a, first_b = router.select(a + [1]), router.select(b + [1])
    assert first_a != first_b  # nothing matched: the least-loaded replica takes the new prefix
    for i in range(4):
        assert router.select(a + [i + 2]) == first_a
        assert router.select(b + [i + 2]) == first_b


def test_new_prefixes_spread_when_requests_come_one_at_a_time():
    router = Router(2)
    prefixes = [list(range(k * 100, k * 100 + 40)) for k in range(4)]
    homes = []
    for p in prefixes:  # each request ends before the next: loads stay 0, the tree sizes decide
        homes.append(router.select(p + [1]))
        router.finished(homes[-1])
    assert sorted(homes) == [0, 0, 1, 1]
    for p, home in zip(prefixes, homes):
        assert router.select(p + [2]) == home
        router.finished(home)


def test_overloaded_best_replica_sends_to_least_loaded():
    router = Router(2, balance_abs_threshold=3, balance_rel_threshold=1.0)
    prefix = list(range(50))
    picks = [router.select(prefix + [i]) for i in range(6)]
    # the first four stay with the prefix; the fifth finds replica 0 four ahead (> 3) and goes to 1
    assert picks[:4] == [0, 0, 0, 0] and picks[4] == 1
    assert router.stats()["in_flight"] == [picks.count(0), picks.count(1)]


def test_short_match_goes_to_least_loaded():
    router = Router(2, cache_threshold=0.5)
    assert router.select(list(range(10))) == 0
    assert router.select(list(range(4)) + list(range(500, 510))) == 1  # 4/14 matched on 0: too little


def test_round_robin_and_finished():
    router = Router(3, policy="round_robin")
    assert [router.select([1, 2]) for _ in range(7)] == [0, 1, 2, 0, 1, 2, 0]
    assert router.loads == [3, 2, 2] and router.trees[0].num_tokens == 0
    router.finished(0)
    assert router.loads == [2, 2, 2]
    for _ in range(2):
        router.finished(1)
    with pytest.raises(ValueError, match="no request in flight"):
        router.finished(1)
    with pytest.raises(ValueError, match=r"replica must be in \[0, 3\), got 3"):
        router.finished(3)


def test_bad_arguments():
    with pytest.raises(ValueError, match="policy must be one of cache_aware, round_robin, got 'random'"):
        Router(2, policy="random")
    with pytest.raises(ValueError, match="num_replicas must be >= 1, got 0"):
        Router(0)
    with pytest.raises(ValueError, match="cache_threshold"):
        Router(2, cache_threshold=1.5)


def test_router_does_not_import_torch():
    code = "import sys, radixlang.runtime.dp.router; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_flush_forgets_a_replicas_prefixes():
    router = Router(2)
    prefix = list(range(30))
    assert router.select(prefix + [1]) == 0
    router.finished(0)
    router.flush(0)
    assert router.trees[0].num_tokens == 0
    assert router.select(list(range(500, 540))) == 0 and router.select(prefix + [2]) == 1  # no longer remembered


def test_server_args_load_balance_method():
    from radixlang.runtime.server_args import ServerArgs
    assert ServerArgs().load_balance_method == "cache_aware"
    with pytest.raises(ValueError, match="load_balance_method must be one of cache_aware, round_robin"):
        ServerArgs(load_balance_method="random")
