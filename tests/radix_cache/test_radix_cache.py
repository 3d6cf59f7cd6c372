"""RadixCache against a brute-force oracle, with an integrity check after every operation."""
from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from radixlang.radix_cache import RadixCache

keys = st.lists(st.integers(0, 3), min_size=0, max_size=12)


class Oracle:
    """The first insert of a token path wins; a path's slots stay until evicted."""

    def __init__(self, page: int) -> None:
        self.page = page
        self.paths: dict[tuple[int, ...], int] = {}  # prefix -> slot of its last token

    def insert(self, key: list[int], kv: list[int]) -> int:
        usable = len(key) - len(key) % self.page
        matched = 0
        for i in range(usable):
            p = tuple(key[:i + 1])
            if p in self.paths and matched == i:
                matched += 1
            else:
                self.paths.setdefault(p, kv[i])
        return matched - matched % self.page

    def match(self, key: list[int]) -> list[int]:
        out = []
        for i in range(len(key)):
            p = tuple(key[:i + 1])
            if p not in self.paths:
                break
            out.append(self.paths[p])
        return out[:len(out) - len(out) % self.page]


@settings(max_examples=80, deadline=None)
@given(ops=st.lists(st.tuples(st.sampled_from(["insert", "match", "lock_evict"]), keys), max_size=25),
       page=st.sampled_from([1, 4]))
def test_against_oracle(ops, page):
    tree, oracle = RadixCache(page_size=page), Oracle(page)
    next_slot = 1
    freed: list[int] = []
    for op, key in ops:
        if op == "insert":
            kv = list(range(next_slot, next_slot + len(key)))
            next_slot += len(key)
            assert tree.insert(key, torch.tensor(kv, dtype=torch.int64)) == oracle.insert(key, kv)
        elif op == "match":
            got = tree.match_prefix(key).kv_indices.tolist()
            assert got == oracle.match(key)
        else:
            res = tree.match_prefix(key)
            locked = set(res.kv_indices.tolist())
            tree.inc_lock_ref(res.last_node)
            tree.check_integrity()
            now: list[int] = []
            n = tree.evict(10 ** 6, lambda t: now.extend(t.tolist()))
            assert not locked & set(now), "evicted a locked node"
            assert tree.evictable_size() == 0 and tree.total_size() == tree.protected_size() == len(locked)
            assert n == len(now) == len(set(now)) and not set(now) & set(freed)
            freed.extend(now)
            tree.dec_lock_ref(res.last_node)
            oracle.paths = {p: s for p, s in oracle.paths.items() if s not in freed}
        tree.check_integrity()
        assert tree.evictable_size() + tree.protected_size() == tree.total_size()


def test_lru_order_and_split():
    tree = RadixCache()
    tree.insert([1, 2, 3, 4], torch.tensor([10, 11, 12, 13]))
    tree.insert([1, 2, 5], torch.tensor([20, 21, 22]))  # splits [1,2 | 3,4]
    assert tree.total_size() == 5
    tree.insert([7, 8], torch.tensor([30, 31]))
    tree.match_prefix([1, 2, 3, 4])  # touch: [5] and [7,8] are now older
    freed: list[int] = []
    tree.evict(1, lambda t: freed.extend(t.tolist()))
    assert freed == [22]
    tree.evict(2, lambda t: freed.extend(t.tolist()))
    assert freed == [22, 30, 31]
    tree.check_integrity()
    assert tree.match_prefix([1, 2, 3, 9]).kv_indices.tolist() == [10, 11, 12]
    assert "len=" in tree.pretty_print()


def test_namespaces_isolate():
    tree = RadixCache()
    tree.insert([1, 2, 3], torch.tensor([1, 2, 3]), namespace="lora-a")
    assert tree.match_prefix([1, 2, 3]).kv_indices.numel() == 0
    assert tree.match_prefix([1, 2, 3], namespace="lora-b").kv_indices.numel() == 0
    assert tree.match_prefix([1, 2, 3], namespace="lora-a").kv_indices.tolist() == [1, 2, 3]
    tree.check_integrity()


def test_insert_returns_duplicates_for_caller():
    tree = RadixCache()
    assert tree.insert([1, 2, 3], torch.tensor([1, 2, 3])) == 0
    assert tree.insert([1, 2, 3, 4], torch.tensor([7, 8, 9, 10])) == 3  # caller frees 7, 8, 9
    assert tree.match_prefix([1, 2, 3, 4]).kv_indices.tolist() == [1, 2, 3, 10]

