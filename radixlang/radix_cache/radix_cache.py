"""RadixCache: a radix tree over token ids whose values are KV slot indices.

Invariants (checked by ``check_integrity``):
- every node but the root holds a non-empty key and a kv tensor of the same length;
- a child is stored under the first page of its key (the first token when page_size == 1);
- ``evictable_size() + protected_size() == total_size()``: a node's tokens count as
  protected while its lock_ref > 0, else as evictable.

Who frees what: ``insert`` keeps exactly the slots [matched_len, len(key)) of the
kv indices it is given; slots [0, matched_len) duplicate what the tree already
held and are the caller's to free. ``evict`` hands the slots of the leaves it
drops to ``free_fn``. The tree never frees anything else and knows nothing of
requests or pools.

Scores: a node may keep, beside its KV, each token's logprob (and top-k) given everything before
it (``store_scores``, read back by ``prefix_scores``; scores.py); they split with the node and go
with it when it is evicted. They live in the node's namespace, so they are per adapter as its KV is.
"""
from __future__ import annotations

import heapq
from typing import Callable, Hashable, Iterator, NamedTuple

import torch

from radixlang.radix_cache.scores import TokenScores, concat_scores, merge_scores, unknown_scores


class TreeNode:
    __slots__ = ("children", "parent", "key", "value", "lock_ref", "last_access", "swa_lock_ref", "swa_tombstone",
                 "scores")

    def __init__(self, parent: TreeNode | None = None) -> None:
        self.children: dict[Hashable, TreeNode] = {}
        self.parent = parent
        self.key: list[int] = []
        self.value: torch.Tensor = torch.empty(0, dtype=torch.int64)  # [len(key)] int64 KV slots
        self.lock_ref = 0
        self.last_access = 0
        # SWARadixCache (swa_radix_cache.py): locks on the window KV, and whether the window KV is gone
        self.swa_lock_ref = 0
        self.swa_tombstone = False
        self.scores: TokenScores | None = None  # [len(key)] per-token logprobs (scores.py); None: none known

    def __lt__(self, other: TreeNode) -> bool:
        return self.last_access < other.last_access


class MatchResult(NamedTuple):
    kv_indices: torch.Tensor  # [matched_len] int64
    last_node: TreeNode


def _common_len(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def _require(holds: bool, broken: str) -> None:
    """check_integrity's checks: an explicit raise, which ``python -O`` keeps where it strips asserts."""
    if not holds:
        raise RuntimeError(f"radix tree invariant broken: {broken}")


class RadixCache:
    def __init__(self, page_size: int = 1) -> None:
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.page_size = page_size
        self.reset()

    # ---- keys ------------------------------------------------------------------------------
    def _child_key(self, key: list[int]) -> Hashable:
        return key[0] if self.page_size == 1 else tuple(key[:self.page_size])

    def _match_len(self, a: list[int], b: list[int]) -> int:
        n = _common_len(a, b)
        return n - n % self.page_size

    def _root_for(self, namespace: Hashable | None) -> TreeNode:
        if namespace is None:
            return self.root
        node = self.namespaces.get(namespace)
        if node is None:
            node = TreeNode(parent=None)
            node.lock_ref = 1  # namespace roots are never evicted
            self.namespaces[namespace] = node
        return node

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    # ---- interface -------------------------------------------------------------------------
    def reset(self) -> None:
        self.root = TreeNode()
        self.root.lock_ref = 1
        self.namespaces: dict[Hashable, TreeNode] = {}
        self._clock = 0
        self._evictable = 0
        self._protected = 0

    def match_prefix(self, key: list[int], namespace: Hashable | None = None) -> MatchResult:
        """Longest cached prefix of key (whole pages). Side effects: may split a node; updates access times."""
        key = key[:len(key) - len(key) % self.page_size]
        node = self._root_for(namespace)
        now = self._tick()
        node.last_access = now
        values = []
        while key:
            child = node.children.get(self._child_key(key))
            if child is None:
                break
            n = self._match_len(child.key, key)
            if n == 0:
                break
            if n < len(child.key):
                child = self._split(child, n)
            child.last_access = now
            values.append(child.value)
            node = child
            key = key[n:]
        kv = torch.cat(values) if values else torch.empty(0, dtype=torch.int64)
        return MatchResult(kv, node)

    def insert(self, key: list[int], kv_indices: torch.Tensor, namespace: Hashable | None = None) -> int:
        """Insert key -> kv_indices; return how many leading tokens were already cached (caller frees those)."""
        return self._insert_walk(key, kv_indices, namespace, self._add_leaf, None)

    def _insert_walk(self, key: list[int], kv_indices: torch.Tensor, namespace: Hashable | None,
                     add_leaf: Callable[[TreeNode, list[int], torch.Tensor, int, int], None],
                     visit: Callable[[TreeNode, torch.Tensor, int], TreeNode] | None) -> int:
        """The walk of an insert: down the cached prefix of key (split where it ends inside a node), then
        ``add_leaf(parent, the rest of key, its slots, tokens matched before it, now)``. ``visit(node, the
        incoming slots of its tokens, tokens matched before it)`` sees each cached node on the way and
        returns the node the walk goes on from (a subclass's hook: SWARadixCache revives tombstones)."""
        if len(key) != int(kv_indices.numel()):
            raise ValueError(f"one KV slot per token: {len(key)} tokens, {int(kv_indices.numel())} slots")
        usable = len(key) - len(key) % self.page_size
        key, kv_indices = key[:usable], kv_indices[:usable].to(torch.int64)
        node = self._root_for(namespace)
        now = self._tick()
        matched = 0
        while key:
            child = node.children.get(self._child_key(key))
            if child is None:
                add_leaf(node, key, kv_indices[matched:], matched, now)
                return matched
            n = self._match_len(child.key, key)
            if n < len(child.key):
                child = self._split(child, n)
            child.last_access = now
            if visit is not None:
                child = visit(child, kv_indices[matched:matched + n], matched)
            matched += n
            node = child
            key = key[n:]
        return matched

    def _add_leaf(self, parent: TreeNode, key: list[int], kv: torch.Tensor, matched: int, now: int) -> None:
        new = TreeNode(parent=parent)
        new.key, new.value, new.last_access = list(key), kv.clone(), now
        parent.children[self._child_key(key)] = new
        self._evictable += len(key)

    def _split(self, child: TreeNode, n: int) -> TreeNode:
        """Cut child after n tokens; return the new upper node (which keeps child's lock count)."""
        parent = child.parent
        if parent is None:
            raise RuntimeError("cannot split the root")
        upper = TreeNode(parent=parent)
        upper.key, upper.value = child.key[:n], child.value[:n]
        upper.lock_ref, upper.last_access = child.lock_ref, child.last_access
        upper.swa_lock_ref, upper.swa_tombstone = child.swa_lock_ref, child.swa_tombstone
        if child.scores is not None:
            upper.scores, child.scores = child.scores.slice(0, n), child.scores.slice(n, len(child.key))
        parent.children[self._child_key(upper.key)] = upper
        child.key, child.value, child.parent = child.key[n:], child.value[n:], upper
        upper.children[self._child_key(child.key)] = child
        return upper

    def _walk(self, key: list[int], namespace: Hashable | None) -> Iterator[tuple[TreeNode, int, int]]:
        """(node, key position, tokens it matches) along key's longest cached prefix, token-granular; the last
        node may match only a head of its key. Read only: no split, no access time."""
        node, pos = self._root_for(namespace), 0
        while pos < len(key):
            child = node.children.get(self._child_key(key[pos:]))
            n = 0 if child is None else _common_len(child.key, key[pos:])
            if child is None or n == 0:
                return
            yield child, pos, n
            if n < len(child.key):
                return
            node, pos = child, pos + n

    def store_scores(self, key: list[int], scores: TokenScores, namespace: Hashable | None = None) -> int:
        """Keep ``scores`` (one per token of key) beside the cached tokens of key's longest cached prefix,
        filling what was unknown there; return how many tokens that covered. No split, no access time."""
        if len(scores) != len(key):
            raise ValueError(f"one score per token: {len(key)} tokens, {len(scores)} scores")
        covered = 0
        for child, pos, n in self._walk(key, namespace):
            part = scores.slice(pos, pos + n)
            if n < len(child.key):
                part = concat_scores([part, unknown_scores(len(child.key) - n)])
            child.scores = merge_scores(child.scores, part)
            covered = pos + n
        return covered

    def prefix_scores(self, key: list[int], namespace: Hashable | None = None) -> TokenScores:
        """Scores of key's longest cached prefix (NaN where unknown). Read only: no split, no access time."""
        return concat_scores([child.scores.slice(0, n) if child.scores is not None else unknown_scores(n)
                              for child, _, n in self._walk(key, namespace)])

    def inc_lock_ref(self, node: TreeNode) -> int:
        delta = 0
        while node is not None and node.parent is not None:
            if node.lock_ref == 0:
                self._evictable -= len(node.key)
                self._protected += len(node.key)
                delta -= len(node.key)
            node.lock_ref += 1
            node = node.parent
        return delta

    def dec_lock_ref(self, node: TreeNode) -> int:
        delta = 0
        while node is not None and node.parent is not None:
            if node.lock_ref <= 0:
                raise RuntimeError("unbalanced dec_lock_ref: a node on the path holds no lock")
            if node.lock_ref == 1:
                self._evictable += len(node.key)
                self._protected -= len(node.key)
                delta += len(node.key)
            node.lock_ref -= 1
            node = node.parent
        return delta

    def evict(self, num_tokens: int, free_fn: Callable[[torch.Tensor], None]) -> int:
        """Free least-recently-used unlocked leaves until num_tokens are freed; return the count freed."""
        heap = [n for n in self._leaves() if n.lock_ref == 0]
        heapq.heapify(heap)
        freed = 0
        while freed < num_tokens and heap:
            leaf = heapq.heappop(heap)
            free_fn(leaf.value)
            freed += len(leaf.key)
            parent = leaf.parent
            self._remove_leaf(leaf)
            if parent.parent is not None and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, parent)
        return freed

    def _remove_leaf(self, leaf: TreeNode) -> None:
        """Detach an unlocked leaf whose slots were freed."""
        if leaf.parent is None:
            raise RuntimeError("cannot remove a root")
        self._evictable -= len(leaf.key)
        del leaf.parent.children[self._child_key(leaf.key)]

    def evictable_size(self) -> int:
        return self._evictable

    def protected_size(self) -> int:
        return self._protected

    def total_size(self) -> int:
        return sum(len(n.key) for n in self._nodes())

    # ---- inspection --------------------------------------------------------------------------
    def _nodes(self):
        stack = [self.root, *self.namespaces.values()]
        while stack:
            node = stack.pop()
            if node.parent is not None:
                yield node
            stack.extend(node.children.values())

    def _leaves(self):
        return [n for n in self._nodes() if not n.children]

    def check_integrity(self) -> None:
        evictable = protected = 0
        for node in self._nodes():
            _require(bool(node.key) and len(node.key) == int(node.value.numel()), "key/value length mismatch")
            _require(node.parent.children.get(self._child_key(node.key)) is node, "child stored under a wrong key")
            _require(node.scores is None or len(node.scores) == len(node.key), "key/scores length mismatch")
            _require(node.lock_ref >= 0, "a negative lock_ref")
            for child in node.children.values():
                _require(child.lock_ref <= node.lock_ref, "a locked node's ancestors must be locked")
            if node.lock_ref > 0:
                protected += len(node.key)
            else:
                evictable += len(node.key)
        _require(evictable == self._evictable, f"evictable {self._evictable} != counted {evictable}")
        _require(protected == self._protected, f"protected {self._protected} != counted {protected}")

    def pretty_print(self) -> str:
        lines: list[str] = []

        def walk(node: TreeNode, depth: int) -> None:
            for child in node.children.values():
                head = child.key[:8]
                lines.append(f"{'  ' * depth}{head}{'...' if len(child.key) > 8 else ''} "
                             f"len={len(child.key)} lock={child.lock_ref}")
                walk(child, depth + 1)
        walk(self.root, 0)
        for ns, root in self.namespaces.items():
            lines.append(f"[namespace {ns!r}]")
            walk(root, 1)
        lines.append(f"total={self.total_size()} evictable={self._evictable} protected={self._protected}")
        return "\n".join(lines)

