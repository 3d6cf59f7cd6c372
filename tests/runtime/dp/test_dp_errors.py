"""Broken calls into the dp helpers raise named errors, never bare asserts (which ``python -O`` strips)."""
from __future__ import annotations

import pytest

from radixlang.runtime.dp.replica_states import merge_states
from radixlang.runtime.dp.router import ApproxTree


def test_merging_no_replica_states_is_a_value_error():
    with pytest.raises(ValueError, match="at least one replica state"):
        merge_states([])


@pytest.mark.parametrize("n", [0, 3])
def test_a_split_outside_the_node_raises(n):
    tree = ApproxTree(16)
    tree.insert([1, 2, 3])
    node = tree.root.children[1]
    with pytest.raises(RuntimeError, match=f"split point {n} must lie inside the node's 3 ids"):
        tree._split(node, n)
    assert tree.match([1, 2, 3]) == 3 and tree.num_tokens == 3  # nothing changed


def test_a_split_of_a_detached_node_raises():
    tree = ApproxTree(16)
    tree.insert([1, 2, 3])
    node = tree.root.children.pop(1)
    node.parent = None
    with pytest.raises(RuntimeError, match="no longer in the tree"):
        tree._split(node, 1)
