"""Router: picks the data-parallel replica for each request.

Two policies (SGLang's ``--load-balance-method`` names):

* ``round_robin``: replicas in turn, whatever the prompt.
* ``cache_aware``: the router keeps, per replica, an approximate prefix tree of
  the token ids it has sent there (a radix trie of ids, no KV) and routes by it:

  1. For every replica, the length of the longest prefix of the request that
     its tree holds. ``best`` is the replica with the longest match; ties go to
     the replica with fewer requests in flight, then the lower index.
  2. ``least`` is the replica with the fewest requests in flight (ties: the
     longer match, then the smaller tree, so that new prefixes spread over the
     replicas even when requests come one at a time, then the lower index).
  3. The request goes to ``least`` when the best match is short,
     ``match < cache_threshold * len(input_ids)``, or when ``best`` is
     overloaded: ``load[best] - load[least] > balance_abs_threshold`` and
     ``load[best] > balance_rel_threshold * load[least]``. Otherwise it goes
     to ``best``.
  4. The request's ids are inserted into the chosen replica's tree.

  Defaults: ``cache_threshold=0.5``, ``balance_abs_threshold=8``,
  ``balance_rel_threshold=1.5``. Load is the number of requests in flight:
  ``select`` adds one to the chosen replica, ``finished`` takes one away.
  Each tree holds at most ``max_tree_tokens`` ids (one size for all, or one
  per replica: the request front passes each replica's KV pool size, as the
  replica reported it when it was ready); past that its least recently used
  leaves are dropped, as the replica's real radix cache evicts under memory
  pressure.
  ``flush(replica)`` empties a tree when that replica's cache is flushed.

The router is pure Python over token ids (no torch) and thread-safe; the one
request front (front/request_front.py) drives it for the in-process Engine
and the server alike.
"""
from __future__ import annotations

import heapq
import itertools
import threading
from typing import Sequence

POLICIES = ("cache_aware", "round_robin")


class _Node:
    __slots__ = ("key", "children", "parent", "last_access")

    def __init__(self, key: tuple[int, ...], parent: _Node | None) -> None:
        self.key = key
        self.children: dict[int, _Node] = {}
        self.parent = parent
        self.last_access = 0


class ApproxTree:
    """A radix trie of token-id sequences, bounded to ``max_tokens`` ids with LRU leaf eviction."""

    def __init__(self, max_tokens: int) -> None:
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        self.max_tokens = max_tokens
        self.root = _Node((), None)
        self.num_tokens = 0
        self._num_nodes = 0
        self._clock = itertools.count(1)
        self._leaves: list[tuple[int, int, _Node]] = []  # (last_access, tiebreak, node); stale entries skipped
        self._tiebreak = itertools.count()

    def match(self, ids: Sequence[int]) -> int:
        """How many leading ids of ``ids`` the tree holds. Does not touch LRU order."""
        ids = tuple(ids)
        node, i = self.root, 0
        while i < len(ids):
            child = node.children.get(ids[i])
            if child is None:
                break
            n = _common_len(child.key, ids, i)
            i += n
            if n < len(child.key):
                break
            node = child
        return i

    def insert(self, ids: Sequence[int]) -> None:
        """Add ``ids`` (its whole path becomes most recently used), then evict down to the bound."""
        ids = tuple(ids)
        if not ids:
            return
        now = next(self._clock)
        node, i = self.root, 0
        while i < len(ids):
            child = node.children.get(ids[i])
            if child is None:
                child = _Node(ids[i:], node)
                node.children[ids[i]] = child
                self.num_tokens += len(child.key)
                self._num_nodes += 1
            else:
                n = _common_len(child.key, ids, i)
                if n < len(child.key):
                    child = self._split(child, n)
            i += len(child.key)
            node = child
        end = node
        while node is not self.root and node.parent is not None:  # only the root has no parent
            node.last_access = now
            node = node.parent
        if not end.children:
            self._push(end)
        self.evict(self.max_tokens)

    def evict(self, max_tokens: int) -> None:
        """Drop least recently used leaves until at most ``max_tokens`` ids remain."""
        while self.num_tokens > max_tokens and self._leaves:
            stamp, _, node = heapq.heappop(self._leaves)
            if node.children or node.parent is None or stamp != node.last_access:
                continue  # stale: no longer a leaf, already removed, or touched since
            parent = node.parent
            del parent.children[node.key[0]]
            node.parent = None
            self.num_tokens -= len(node.key)
            self._num_nodes -= 1
            if parent is not self.root and not parent.children:
                self._push(parent)

    def _split(self, child: _Node, n: int) -> _Node:
        """Cut ``child``'s key after n ids; returns the new upper node."""
        parent = child.parent
        if parent is None:
            raise RuntimeError("cannot split a node that is no longer in the tree")
        if not 0 < n < len(child.key):
            raise RuntimeError(f"split point {n} must lie inside the node's {len(child.key)} ids")
        upper = _Node(child.key[:n], parent)
        upper.last_access = child.last_access
        self._num_nodes += 1
        parent.children[upper.key[0]] = upper
        child.key = child.key[n:]
        child.parent = upper
        upper.children[child.key[0]] = child
        return upper

    def _push(self, node: _Node) -> None:
        if len(self._leaves) > 2 * self._num_nodes + 64:  # mostly stale entries: rebuild from the live leaves
            self._leaves = [(n.last_access, next(self._tiebreak), n) for n in self._iter_nodes() if not n.children]
            heapq.heapify(self._leaves)
        heapq.heappush(self._leaves, (node.last_access, next(self._tiebreak), node))

    def _iter_nodes(self):
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())


def _common_len(key: tuple[int, ...], ids: tuple[int, ...], start: int) -> int:
    """Length of the common prefix of key and ids[start:]; slice compares run in C, bisecting a mismatch."""
    n = min(len(key), len(ids) - start)
    if key[:n] == ids[start:start + n]:
        return n
    lo, hi = 0, n  # key[:lo] matches, key[:hi] does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if key[lo:mid] == ids[start + lo:start + mid]:
            lo = mid
        else:
            hi = mid
    return lo


class Router:
    """Chooses a replica per request and tracks requests in flight (see the module docstring)."""

    def __init__(self, num_replicas: int, *, policy: str = "cache_aware", cache_threshold: float = 0.5,
                 balance_abs_threshold: int = 8, balance_rel_threshold: float = 1.5,
                 max_tree_tokens: int | Sequence[int] = 1 << 20) -> None:
        if num_replicas < 1:
            raise ValueError(f"num_replicas must be >= 1, got {num_replicas}")
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}, got {policy!r}")
        if not 0.0 <= cache_threshold <= 1.0:
            raise ValueError(f"cache_threshold must be in [0, 1], got {cache_threshold}")
        if balance_abs_threshold < 0 or balance_rel_threshold < 1.0:
            raise ValueError(f"balance thresholds must be abs >= 0 and rel >= 1, got "
                             f"{balance_abs_threshold} and {balance_rel_threshold}")
        self.num_replicas = num_replicas
        self.policy = policy
        self.cache_threshold = cache_threshold
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        sizes = [max_tree_tokens] * num_replicas if isinstance(max_tree_tokens, int) else list(max_tree_tokens)
        if len(sizes) != num_replicas:
            raise ValueError(f"max_tree_tokens has {len(sizes)} sizes for {num_replicas} replicas")
        self.trees = [ApproxTree(size) for size in sizes]
        self.loads = [0] * num_replicas
        self.num_routed = [0] * num_replicas
        self._next = 0
        self._lock = threading.Lock()

    def select(self, input_ids: Sequence[int]) -> int:
        """The replica for this request; counts it in flight there (and, cache-aware, remembers its ids)."""
        with self._lock:
            if self.policy == "round_robin":
                replica = self._next
                self._next = (self._next + 1) % self.num_replicas
            else:
                ids = tuple(input_ids)
                replica = self._cache_aware(ids)
                self.trees[replica].insert(ids)
            self.loads[replica] += 1
            self.num_routed[replica] += 1
            return replica

    def finished(self, replica: int) -> None:
        """A request sent to ``replica`` has ended (finished, failed or aborted)."""
        with self._lock:
            if not 0 <= replica < self.num_replicas:
                raise ValueError(f"replica must be in [0, {self.num_replicas}), got {replica}")
            if self.loads[replica] == 0:
                raise ValueError(f"replica {replica} has no request in flight to finish")
            self.loads[replica] -= 1

    def flush(self, replica: int | None = None) -> None:
        """Forget what was sent to ``replica`` (all replicas if None): call after its cache is flushed."""
        with self._lock:
            for r in range(self.num_replicas) if replica is None else [replica]:
                self.trees[r] = ApproxTree(self.trees[r].max_tokens)

    def _cache_aware(self, input_ids: tuple[int, ...]) -> int:
        matches = [tree.match(input_ids) for tree in self.trees]
        replicas = range(self.num_replicas)
        best = min(replicas, key=lambda r: (-matches[r], self.loads[r], r))
        least = min(replicas, key=lambda r: (self.loads[r], -matches[r], self.trees[r].num_tokens, r))
        short = matches[best] < self.cache_threshold * len(input_ids)
        hi, lo = self.loads[best], self.loads[least]
        overloaded = hi - lo > self.balance_abs_threshold and hi > self.balance_rel_threshold * lo
        return least if short or overloaded else best

    def stats(self) -> dict[str, list[int]]:
        """Per replica: requests in flight, requests routed so far, ids held by the approximate tree."""
        with self._lock:
            return {"in_flight": list(self.loads), "routed": list(self.num_routed),
                    "tree_tokens": [t.num_tokens for t in self.trees]}
