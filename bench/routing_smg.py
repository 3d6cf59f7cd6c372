"""SMG's ``cache_aware`` routing policy, rebuilt for the routing simulator (bench/routing_sim.py).

SMG (SGLang Model Gateway, lightseekorg/smg; ``model_gateway/src/policies/cache_aware.rs``) keeps ONE
approximate radix tree of request *text* shared by all workers: every node records which workers
("tenants") were sent a text passing through it, with a last-access time per tenant. The router
inserts each request's text under the worker it chose; nothing comes back from the workers, so the
tree only forgets by its own periodic eviction. Per request (HTTP string-tree path):

1. loads = requests in flight per worker. If ``max - min > balance_abs_threshold`` and
   ``max > balance_rel_threshold * min`` the fleet is imbalanced: the least-loaded worker takes it.
2. Otherwise walk the tree as far as the text matches (a partial match inside a node counts) and take
   a tenant of the deepest node reached; ``match_rate = matched chars / text chars``. Above
   ``cache_threshold`` that tenant takes the request, else the least-loaded worker (SMG's code picks
   the least-loaded one here; its docs say "the smallest tree").
3. The text is inserted under the chosen worker.
Every ``eviction_interval`` seconds each tenant's least recently used leaves are dropped until it
holds at most ``max_tree_size`` characters.

Defaults are the ``smg`` CLI defaults in SMG's docs (docs/configuration/routing.md, "Cache-Aware
Policy"): cache_threshold 0.3, balance_abs_threshold 64, balance_rel_threshold 1.5, eviction_interval
120 s, max_tree_size 67108864 (2**26). (The Rust ``CacheAwareConfig::default()`` used when it is built
without the CLI says 0.5 / 32 / 1.1 / 30 s / 10000.) Our own code, not SMG's: one thread, no locks.
"""
from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class SmgConfig:
    cache_threshold: float = 0.3
    balance_abs_threshold: int = 64
    balance_rel_threshold: float = 1.5
    eviction_interval_s: float = 120.0
    max_tree_size: int = 1 << 26


class _Node:
    __slots__ = ("text", "children", "parent", "tenants")

    def __init__(self, text: str, parent: _Node | None) -> None:
        self.text = text
        self.children: dict[str, _Node] = {}
        self.parent = parent
        self.tenants: dict[int, int] = {}  # worker -> last access; insertion order picks the match tenant


class MultiTenantTree:
    """One radix tree of strings whose nodes remember which workers hold them."""

    def __init__(self, num_workers: int) -> None:
        self.root = _Node("", None)
        self.tenant_chars = [0] * num_workers
        self._clock = itertools.count(1)

    def match(self, text: str) -> tuple[int, int | None]:
        """(matched characters, a worker holding the deepest node reached); (0, None) on no match."""
        node, i = self.root, 0
        while i < len(text):
            child = node.children.get(text[i])
            if child is None:
                break
            n = _common_len(child.text, text, i)
            i += n
            node = child
            if n < len(child.text):
                break  # partial match: this node still names the tenant, as SMG does
        if node is self.root:
            return 0, None
        return i, next(iter(node.tenants))

    def insert(self, text: str, worker: int) -> None:
        """Add ``text`` under ``worker``; every node on its path becomes most recently used by it."""
        now = next(self._clock)
        node, i = self.root, 0
        while i < len(text):
            child = node.children.get(text[i])
            if child is None:
                child = _Node(text[i:], node)
                node.children[text[i]] = child
            else:
                n = _common_len(child.text, text, i)
                if n < len(child.text):
                    child = self._split(child, n)
            if worker not in child.tenants:
                self.tenant_chars[worker] += len(child.text)
            child.tenants[worker] = now
            i += len(child.text)
            node = child

    def evict_tenant_by_size(self, max_chars: int) -> None:
        """Drop each worker's least recently used leaves until it holds at most ``max_chars`` characters."""
        for worker, chars in enumerate(self.tenant_chars):
            if chars > max_chars:
                self._evict_tenant(worker, max_chars)

    def _evict_tenant(self, worker: int, max_chars: int) -> None:
        heap = [(n.tenants[worker], id(n), n) for n in self._nodes() if self._is_tenant_leaf(n, worker)]
        heapq.heapify(heap)
        while self.tenant_chars[worker] > max_chars and heap:
            _, _, node = heapq.heappop(heap)
            del node.tenants[worker]
            self.tenant_chars[worker] -= len(node.text)
            parent = node.parent
            if parent is None:
                raise RuntimeError("the root holds no tenant and is never evicted")
            if not node.tenants:
                del parent.children[node.text[0]]
            if parent is not self.root and self._is_tenant_leaf(parent, worker):
                heapq.heappush(heap, (parent.tenants[worker], id(parent), parent))

    @staticmethod
    def _is_tenant_leaf(node: _Node, worker: int) -> bool:
        return worker in node.tenants and not any(worker in c.tenants for c in node.children.values())

    def _split(self, child: _Node, n: int) -> _Node:
        parent = child.parent
        if parent is None or not 0 < n < len(child.text):
            raise RuntimeError(f"cannot split a node of {len(child.text)} chars at {n}")
        upper = _Node(child.text[:n], parent)
        upper.tenants = dict(child.tenants)
        parent.children[upper.text[0]] = upper
        child.text, child.parent = child.text[n:], upper
        upper.children[child.text[0]] = child
        return upper

    def _nodes(self):
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())


def _common_len(key: str, text: str, start: int) -> int:
    """Length of the common prefix of key and text[start:] (slice compares run in C)."""
    n = min(len(key), len(text) - start)
    if key[:n] == text[start:start + n]:
        return n
    lo, hi = 0, n
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if key[lo:mid] == text[start + lo:start + mid]:
            lo = mid
        else:
            hi = mid
    return lo


class SmgCacheAware:
    """SMG's cache_aware selection over a MultiTenantTree; loads are requests in flight."""

    def __init__(self, num_workers: int, config: SmgConfig | None = None) -> None:
        self.config = config or SmgConfig()
        self.tree = MultiTenantTree(num_workers)
        self.loads = [0] * num_workers
        self._next_eviction_s = self.config.eviction_interval_s

    def select(self, text: str) -> int:
        """The worker for a request whose prompt text is ``text``; counts it in flight there."""
        loads, cfg = self.loads, self.config
        lo, hi = min(loads), max(loads)
        least = loads.index(lo)  # the first least-loaded worker, as Rust's min_by_key returns
        if hi - lo > cfg.balance_abs_threshold and hi > cfg.balance_rel_threshold * lo:
            worker = least
        else:
            matched, tenant = self.tree.match(text)
            rate = matched / len(text) if text else 0.0
            worker = tenant if tenant is not None and rate > cfg.cache_threshold else least
        self.tree.insert(text, worker)
        loads[worker] += 1
        return worker

    def finished(self, worker: int) -> None:
        if self.loads[worker] == 0:
            raise ValueError(f"worker {worker} has no request in flight to finish")
        self.loads[worker] -= 1

    def tick(self, now_s: float) -> None:
        """Run the periodic eviction the gateway's background task would have run by ``now_s``."""
        while now_s >= self._next_eviction_s:
            self.tree.evict_tenant_by_size(self.config.max_tree_size)
            self._next_eviction_s += self.config.eviction_interval_s
