"""A broken radix tree raises RuntimeError (never a bare assert, which ``python -O`` strips)."""
from __future__ import annotations

import pytest
import torch

from radixlang.radix_cache import RadixCache, SWARadixCache


def _tree(cls=RadixCache, *args) -> RadixCache:
    tree = cls(*args)
    tree.insert([1, 2, 3, 4], torch.arange(10, 14))
    tree.check_integrity()
    return tree


def test_unbalanced_dec_lock_ref_raises():
    tree = _tree()
    node = tree.match_prefix([1, 2, 3, 4]).last_node
    with pytest.raises(RuntimeError, match="unbalanced dec_lock_ref"):
        tree.dec_lock_ref(node)


@pytest.mark.parametrize("counter", ["_evictable", "_protected"])
def test_check_integrity_raises_on_a_miscounted_size(counter):
    tree = _tree()
    setattr(tree, counter, getattr(tree, counter) + 1)
    with pytest.raises(RuntimeError, match=f"{counter.lstrip('_')} .* != counted"):
        tree.check_integrity()


def test_check_integrity_raises_on_an_unlocked_ancestor():
    tree = _tree()
    tree.insert([1, 2, 5], torch.arange(20, 23))  # splits the path at [1, 2]
    leaf = tree.match_prefix([1, 2, 5]).last_node
    leaf.lock_ref = 1  # a lock that never reached its parent
    with pytest.raises(RuntimeError, match="ancestors must be locked"):
        tree.check_integrity()


def test_swa_check_integrity_raises_on_a_miscounted_window_size():
    tree = _tree(SWARadixCache, 3)
    tree._swa_evictable += 1
    with pytest.raises(RuntimeError, match="swa evictable/protected"):
        tree.check_integrity()
