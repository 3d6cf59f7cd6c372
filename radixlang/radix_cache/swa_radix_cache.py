"""SWARadixCache: the radix tree of a model whose sliding-window layers keep KV in a second slot space.

Each cached token has full KV (what ``value`` names, read by full-attention layers) and, until freed,
window KV. A node whose window KV was freed is a *tombstone* (``swa_tombstone``): it still serves the
full-attention layers of a longer match, but a query at position m sees window keys m - window + 1 .. m,
so a prefix is usable only up to a length m whose last ``window - 1`` tokens all keep their window KV.

Invariants (``check_integrity``, beyond RadixCache's):
- ``swa_evictable_size() + swa_protected_size()`` counts the tokens of live (not tombstoned) nodes: a
  node's tokens are swa-protected while ``swa_lock_ref > 0``;
- a lock (``inc_lock_ref(node)``) holds the full KV of the whole path, as in RadixCache, and the window KV of
  the path's last ``window - 1`` tokens; it splits the path at that boundary, so every lock covers whole
  nodes and a later split copies ``swa_lock_ref`` to both halves correctly.

Who frees what, beyond RadixCache: ``insert(..., swa_from=b)`` stores the new tokens before position b as
tombstones (the caller freed their window KV already); where incoming tokens at or after b meet a tombstone,
``revive_fn(incoming, cached)`` moves their window KV onto the cached slots and the node lives again (the
caller then frees the incoming duplicates as usual). ``evict_swa`` frees the window KV of least-recently-used nodes
without window locks: tombstones through ``free_swa_fn``, or whole unlocked leaves through ``free_fn``;
``evict`` drops whole leaves through ``free_fn``. ``free_fn`` frees both kinds of KV.
"""
from __future__ import annotations

import heapq
from typing import Callable, Hashable

import torch

from radixlang.radix_cache.radix_cache import MatchResult, RadixCache, TreeNode


class SWARadixCache(RadixCache):
    def __init__(self, window: int, page_size: int = 1) -> None:
        """``window``: the longest sliding window of the model's layers, in tokens."""
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        self.window = window
        super().__init__(page_size)

    def reset(self) -> None:
        super().reset()
        self._swa_evictable = 0
        self._swa_protected = 0

    # ---- matching --------------------------------------------------------------------------------
    def match_prefix(self, key: list[int], namespace: Hashable | None = None) -> MatchResult:
        """Longest cached prefix whose last ``window - 1`` tokens keep window KV (whole nodes). Side effects
        as RadixCache.match_prefix."""
        full = super().match_prefix(key, namespace)
        path = _path(full.last_node)
        best_len, best = 0, path[0].parent if path else full.last_node
        pos = run = 0  # run: live tokens just before pos
        for node in path:
            pos += len(node.key)
            run = 0 if node.swa_tombstone else run + len(node.key)
            if run >= min(pos, self.window - 1):
                best_len, best = pos, node
        if best is None:
            raise RuntimeError("a matched path without a root")
        return MatchResult(full.kv_indices[:best_len], best)

    def match_through_tombstones(self, key: list[int], namespace: Hashable | None = None) -> MatchResult:
        """Longest cached prefix, tombstones or not: for re-pointing a request at the copy it just inserted."""
        return super().match_prefix(key, namespace)

    # ---- insert ----------------------------------------------------------------------------------
    def insert(self, key: list[int], kv_indices: torch.Tensor, namespace: Hashable | None = None, *,
               swa_from: int = 0, revive_fn: Callable[[torch.Tensor, torch.Tensor], None] | None = None) -> int:
        """Insert key -> kv_indices; return how many leading tokens were already cached (caller frees those).

        ``swa_from``: kv_indices[swa_from:] hold window KV and are the caller's own, those before do not (or
        are the tree's). New tokens before it are stored as tombstones; tombstoned tokens at or after it take
        the incoming window KV through ``revive_fn(incoming slots, cached slots)``."""

        def add(parent: TreeNode, rest: list[int], kv: torch.Tensor, matched: int, now: int) -> None:
            self._add_leaves(parent, rest, kv, swa_from - matched, now)

        def visit(node: TreeNode, incoming: torch.Tensor, matched: int) -> TreeNode:
            if node.swa_tombstone and matched + len(node.key) > swa_from and revive_fn is not None:
                return self._revive(node, incoming, swa_from - matched, revive_fn)
            return node

        return self._insert_walk(key, kv_indices, namespace, add, visit)

    def _add_leaves(self, parent: TreeNode, key: list[int], kv: torch.Tensor, dead: int, now: int) -> None:
        """New nodes under parent: the first ``dead`` tokens as a tombstone, the rest live."""
        dead = max(0, min(dead, len(key)))
        for lo, hi, tomb in ((0, dead, True), (dead, len(key), False)):
            if lo == hi:
                continue
            new = TreeNode(parent=parent)
            new.key, new.value, new.last_access = list(key[lo:hi]), kv[lo:hi].clone(), now
            new.swa_tombstone = tomb
            parent.children[self._child_key(new.key)] = new
            self._evictable += hi - lo
            if not tomb:
                self._swa_evictable += hi - lo
            parent = new

    def _revive(self, node: TreeNode, incoming: torch.Tensor, dead: int,
                revive_fn: Callable[[torch.Tensor, torch.Tensor], None]) -> TreeNode:
        """Give a tombstone's tokens from ``dead`` on the incoming window KV; return the node that ends where
        ``node`` did (the revived part)."""
        if dead > 0:
            self._split(node, dead)  # the tombstone keeps the first dead tokens; node keeps the rest
            incoming = incoming[dead:]
        revive_fn(incoming, node.value)
        node.swa_tombstone = False
        self._count_swa(node, +1)
        return node

    # ---- locks -----------------------------------------------------------------------------------
    def inc_lock_ref(self, node: TreeNode) -> int:
        delta = super().inc_lock_ref(node)
        for n in self._window_span(node, split=True):
            if n.swa_lock_ref == 0 and not n.swa_tombstone:
                self._swa_evictable -= len(n.key)
                self._swa_protected += len(n.key)
            n.swa_lock_ref += 1
        return delta

    def dec_lock_ref(self, node: TreeNode, *, window: bool = True) -> int:
        """Drop a lock on node; ``window=False``: one whose window part ``release_window`` dropped already."""
        if window:
            self.release_window(node)
        return super().dec_lock_ref(node)

    def release_window(self, node: TreeNode) -> None:
        """Drop the window part of a lock on node, keeping its full part (a request whose queries no longer
        see the path's last ``window - 1`` tokens): their window KV becomes evictable again."""
        for n in self._window_span(node, split=False):
            if n.swa_lock_ref < 1:
                raise RuntimeError("unbalanced release of a window lock")
            n.swa_lock_ref -= 1
            if n.swa_lock_ref == 0 and not n.swa_tombstone:
                self._swa_evictable += len(n.key)
                self._swa_protected -= len(n.key)

    def _window_span(self, node: TreeNode, *, split: bool) -> list[TreeNode]:
        """The nodes that hold the last ``window - 1`` tokens of node's path, bottom up. With ``split`` the
        node crossing that boundary is cut there first; without, the boundary must already fall between
        nodes (it does for a path a lock split)."""
        need, have = self.window - 1, 0
        span: list[TreeNode] = []
        while have < need and node.parent is not None:
            over = have + len(node.key) - need
            if over > 0:
                if not split:
                    raise RuntimeError("a window lock's boundary fell inside a node: unbalanced locks")
                self._split(node, over)  # node keeps its last len - over tokens
            span.append(node)
            have += len(node.key)
            node = node.parent
        return span

    # ---- eviction --------------------------------------------------------------------------------
    def evict_swa(self, num_tokens: int, free_swa_fn: Callable[[torch.Tensor], None],
                  free_fn: Callable[[torch.Tensor], None]) -> int:
        """Free the window KV of least-recently-used live nodes without window locks until num_tokens window
        slots are freed; return the count freed. An inner or locked node becomes a tombstone (its full KV
        still serves longer matches); an unlocked leaf goes whole through ``free_fn`` (as a tombstone it would
        end every match through it too early to be used), with the tombstoned ancestors it leaves bare."""
        heap = [n for n in self._nodes() if not n.swa_tombstone and n.swa_lock_ref == 0]
        heapq.heapify(heap)
        freed = 0
        while freed < num_tokens and heap:
            node = heapq.heappop(heap)
            freed += len(node.key)
            if node.children or node.lock_ref > 0:
                free_swa_fn(node.value)
                node.swa_tombstone = True
                self._count_swa(node, -1)
                continue
            parent = node.parent
            free_fn(node.value)
            self._remove_leaf(node)
            while (parent is not None and parent.parent is not None and parent.swa_tombstone
                   and not parent.children and parent.lock_ref == 0):
                up = parent.parent
                free_fn(parent.value)
                self._remove_leaf(parent)
                parent = up
        return freed

    def _remove_leaf(self, leaf: TreeNode) -> None:
        if not leaf.swa_tombstone:
            self._count_swa(leaf, -1)
        super()._remove_leaf(leaf)

    def _count_swa(self, node: TreeNode, sign: int) -> None:
        """A node's tokens start (+1) or stop (-1) holding window KV."""
        if node.swa_lock_ref > 0:
            self._swa_protected += sign * len(node.key)
        else:
            self._swa_evictable += sign * len(node.key)

    def swa_evictable_size(self) -> int:
        """Cached tokens whose window KV no lock holds (``evict_swa`` can free them)."""
        return self._swa_evictable

    def swa_protected_size(self) -> int:
        return self._swa_protected

    def check_integrity(self) -> None:
        super().check_integrity()
        evictable = protected = 0
        for node in self._nodes():
            if node.swa_lock_ref > node.lock_ref:
                raise RuntimeError("a window lock outside the full lock")
            if node.swa_tombstone:
                continue
            if node.swa_lock_ref > 0:
                protected += len(node.key)
            else:
                evictable += len(node.key)
        if (evictable, protected) != (self._swa_evictable, self._swa_protected):
            raise RuntimeError(f"swa evictable/protected {self._swa_evictable}/{self._swa_protected} != "
                               f"counted {evictable}/{protected}")


def _path(node: TreeNode) -> list[TreeNode]:
    """The nodes from below the root down to node."""
    path = []
    while node.parent is not None:
        path.append(node)
        node = node.parent
    return path[::-1]
