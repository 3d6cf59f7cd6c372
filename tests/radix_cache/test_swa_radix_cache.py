"""SWARadixCache: tombstones, window locks and swa eviction, against a brute-force oracle of which slots
still hold window KV, with an integrity check after every operation."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from radixlang.radix_cache import SWARadixCache, TreeNode

W = 3  # window: a usable prefix needs window KV for its last 2 tokens


def _t(xs: list[int]) -> torch.Tensor:
    return torch.tensor(xs, dtype=torch.int64)


class SwaSlots:
    """Which cached slots hold window KV: what the pool's full_to_swa would say."""

    def __init__(self) -> None:
        self.live: set[int] = set()

    def free_swa(self, slots: torch.Tensor) -> None:
        for s in slots.tolist():
            assert s in self.live, f"double free of the window KV of slot {s}"
            self.live.remove(s)

    def free(self, slots: torch.Tensor) -> None:
        self.live.difference_update(slots.tolist())

    def move(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        for a, b in zip(src.tolist(), dst.tolist()):
            assert a in self.live and b not in self.live
            self.live.remove(a)
            self.live.add(b)


def _usable(slots: list[int], live: set[int], window: int) -> int:
    """Oracle: the longest m whose last window - 1 tokens hold window KV."""
    for m in range(len(slots), 0, -1):
        if all(s in live for s in slots[max(0, m - window + 1):m]):
            return m
    return 0


def test_match_stops_where_the_window_before_it_lost_its_kv():
    tree, swa = SWARadixCache(W), SwaSlots()
    key = list(range(10))
    # positions 0..5 lost window KV while the request ran; 6..9 keep it
    swa.live.update(range(16, 20))
    assert tree.insert(key, _t(list(range(10, 20))), swa_from=6) == 0
    tree.check_integrity()
    assert tree.match_prefix(key).kv_indices.tolist() == list(range(10, 20))
    # a request that diverges at 8: its query at 8 sees 6 and 7, both live
    assert tree.match_prefix(key[:8] + [99]).kv_indices.numel() == 8
    # diverging at 7: the query at 7 sees 5 (tombstoned): nothing usable but the empty prefix
    assert tree.match_prefix(key[:7] + [99]).kv_indices.numel() == 0
    assert tree.match_through_tombstones(key[:7] + [99]).kv_indices.numel() == 7
    assert tree.swa_evictable_size() == 4 and tree.evictable_size() == 10


def test_a_short_prefix_needs_only_the_window_it_has():
    tree = SWARadixCache(W)
    tree.insert([1, 2, 3, 4], _t([5, 6, 7, 8]), swa_from=0)
    assert tree.match_prefix([1, 9]).kv_indices.tolist() == [5]  # m = 1 needs position 0 only


def test_insert_revives_a_tombstone_from_a_request_that_recomputed_it():
    tree, swa = SWARadixCache(W), SwaSlots()
    tree.insert(list(range(8)), _t(list(range(10, 18))), swa_from=8)  # all tombstoned
    tree.check_integrity()
    assert tree.match_prefix(list(range(8))).kv_indices.numel() == 0
    # another request computed the first 6 tokens itself (slots 30..35, all with window KV)
    swa.live.update(range(30, 36))
    matched = tree.insert(list(range(6)), _t(list(range(30, 36))), swa_from=0, revive_fn=swa.move)
    assert matched == 6  # the caller frees its duplicate full slots 30..35; their window KV moved
    tree.check_integrity()
    assert swa.live == set(range(10, 16))
    assert tree.match_prefix(list(range(6)) + [99]).kv_indices.tolist() == list(range(10, 16))
    assert tree.swa_evictable_size() == 6


def test_revive_keeps_tokens_before_swa_from_tombstoned():
    tree, swa = SWARadixCache(W), SwaSlots()
    tree.insert(list(range(8)), _t(list(range(10, 18))), swa_from=8)
    swa.live.update(range(34, 38))
    tree.insert(list(range(8)), _t(list(range(30, 38))), swa_from=4, revive_fn=swa.move)
    tree.check_integrity()
    assert swa.live == set(range(14, 18)) and tree.swa_evictable_size() == 4
    assert tree.match_prefix(list(range(8))).kv_indices.numel() == 8
    assert tree.match_prefix(list(range(5)) + [99]).kv_indices.numel() == 0  # sees 3, a tombstone


def _locked_path() -> tuple[SWARadixCache, SwaSlots, TreeNode]:
    """A tree holding one 10-token path (slots 10-19, all with window KV), locked at its end."""
    tree, swa = SWARadixCache(W), SwaSlots()
    swa.live.update(range(10, 20))
    tree.insert(list(range(10)), _t(list(range(10, 20))))
    node = tree.match_prefix(list(range(10))).last_node
    tree.inc_lock_ref(node)
    return tree, swa, node


def test_window_lock_protects_only_the_last_window_and_evict_swa_tombstones_the_rest():
    tree, swa, node = _locked_path()
    tree.check_integrity()
    assert tree.protected_size() == 10 and tree.swa_protected_size() == W - 1
    assert tree.evict_swa(100, swa.free_swa, swa.free) == 10 - (W - 1)
    tree.check_integrity()
    assert swa.live == {18, 19}
    assert tree.match_prefix(list(range(10))).kv_indices.numel() == 10  # the lock kept the last window
    assert tree.evict(100, swa.free) == 0  # full KV stays locked
    # a split inside the locked window (another request diverging at 9) keeps the locks balanced
    tree.insert(list(range(9)) + [50], _t(list(range(10, 19)) + [60]))
    tree.dec_lock_ref(node)
    tree.check_integrity()
    assert tree.swa_protected_size() == 0 and tree.protected_size() == 0


def test_release_window_keeps_the_full_lock_and_lets_the_window_go():
    tree, swa, node = _locked_path()
    tree.release_window(node)
    tree.check_integrity()
    assert tree.protected_size() == 10 and tree.swa_protected_size() == 0
    assert tree.evict_swa(100, swa.free_swa, swa.free) == 10  # the whole path tombstoned
    assert not swa.live and tree.evict(100, swa.free) == 0  # its full KV stays locked
    with pytest.raises(RuntimeError, match="unbalanced"):
        tree.release_window(node)
    tree.dec_lock_ref(node, window=False)
    tree.check_integrity()
    assert tree.protected_size() == 0 and tree.evict(100, swa.free) == 10


def test_evict_swa_drops_an_unlocked_leaf_whole_with_the_bare_tombstones_above_it():
    tree, swa = SWARadixCache(W), SwaSlots()
    freed_full: list[int] = []

    def free(slots: torch.Tensor) -> None:
        freed_full.extend(slots.tolist())
        swa.free(slots)
    swa.live.update(range(14, 18))
    tree.insert(list(range(8)), _t(list(range(10, 18))), swa_from=4)  # [0, 4) tombstone, [4, 8) live leaf
    tree.insert(list(range(4)) + [9, 9], _t([10, 11, 12, 13, 20, 21]), swa_from=6)  # a tombstoned branch
    tree.check_integrity()
    assert tree.evict_swa(1, swa.free_swa, free) == 4
    tree.check_integrity()
    # the live leaf went whole; the shared tombstone above it still has a child, so it stays
    assert sorted(freed_full) == [14, 15, 16, 17] and tree.total_size() == 6 and not swa.live
    tree.inc_lock_ref(tree.match_through_tombstones(list(range(4)) + [9, 9]).last_node)
    assert tree.evict(10, free) == 0  # locked: nothing goes


def test_evict_frees_leaves_whole_tombstoned_or_not():
    tree, swa = SWARadixCache(W), SwaSlots()
    swa.live.update(range(14, 18))
    tree.insert(list(range(8)), _t(list(range(10, 18))), swa_from=4)
    assert tree.evict(8, swa.free) == 8
    tree.check_integrity()
    assert not swa.live and tree.total_size() == 0 and tree.swa_evictable_size() == 0


ops = st.lists(st.tuples(st.sampled_from(["insert", "lock", "release", "evict_swa", "evict"]),
                         st.lists(st.integers(0, 2), min_size=1, max_size=10), st.integers(0, 10)),
               max_size=30)


@settings(max_examples=150, deadline=None)
@given(ops)
def test_against_oracle(ops):
    tree, swa = SWARadixCache(W), SwaSlots()
    next_slot = 1
    locked: list[list] = []  # [node, window part released]
    for op, key, arg in ops:
        if op == "insert":
            n = len(key)
            kv = list(range(next_slot, next_slot + n))
            next_slot += n
            swa_from = min(arg, n)
            swa.live.update(kv[swa_from:])
            matched = tree.insert(key, _t(kv), swa_from=swa_from, revive_fn=swa.move)
            swa.free(_t(kv[:matched]))  # the caller frees its duplicates (window KV where still held)
        elif op == "lock":
            node = tree.match_prefix(key).last_node
            tree.inc_lock_ref(node)
            locked.append([node, False])
        elif op == "release":  # a request whose queries moved past its prefix's window
            held = [lock for lock in locked if not lock[1]]
            if held:
                lock = held[arg % len(held)]
                tree.release_window(lock[0])
                lock[1] = True
        elif op == "evict_swa":
            tree.evict_swa(arg, swa.free_swa, swa.free)
        else:
            if locked and arg % 2:
                node, released = locked.pop(arg % len(locked))
                tree.dec_lock_ref(node, window=not released)
            tree.evict(arg, swa.free)
        tree.check_integrity()
        # the oracle: every usable match keeps window KV for its last window - 1 tokens, and is the longest
        full = tree.match_through_tombstones(key).kv_indices.tolist()
        got = tree.match_prefix(key).kv_indices.tolist()
        assert got == full[:_usable(full, swa.live, W)]
        assert tree.swa_evictable_size() + tree.swa_protected_size() == len(swa.live)
    for node, released in locked:
        tree.dec_lock_ref(node, window=not released)
    tree.check_integrity()
    assert tree.swa_protected_size() == 0 and tree.protected_size() == 0


def test_window_must_be_positive():
    with pytest.raises(ValueError, match="window must be >= 1"):
        SWARadixCache(0)
