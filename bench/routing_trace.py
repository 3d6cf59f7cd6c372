"""The routing simulator's trace (bench/routing_sim.py): tenants, few-shot prefixes, multi-turn chats.

Seeded and in token ids: each tenant has a system prompt and few-shot prefixes that extend it;
conversations start by a Poisson process, pick a tenant by Zipf popularity and maybe one of its few-shot
prefixes (Zipf again), then run a few turns, each resending the previous prompt and answer plus a new
user message, a think time after the previous turn ends.
"""
from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class TraceConfig:
    num_tenants: int
    num_conversations: int
    conversations_per_s: float
    fewshot_per_tenant: int = 4
    fewshot_prob: float = 0.8
    zipf_s: float = 1.1
    system_len: tuple[int, int] = (200, 1000)
    fewshot_len: tuple[int, int] = (400, 1500)
    user_len: tuple[int, int] = (20, 200)
    output_len: tuple[int, int] = (16, 256)
    mean_turns: float = 3.0
    max_turns: int = 8
    think_s: float = 5.0
    vocab_size: int = 32000
    seed: int = 0

    def __post_init__(self) -> None:
        if self.num_tenants < 1 or self.num_conversations < 1:
            raise ValueError(f"num_tenants and num_conversations must be >= 1, got {self.num_tenants} "
                             f"and {self.num_conversations}")
        if self.conversations_per_s <= 0:
            raise ValueError(f"conversations_per_s must be > 0, got {self.conversations_per_s}")
        if not 1 <= self.mean_turns <= self.max_turns:
            raise ValueError(f"mean_turns must be in [1, max_turns={self.max_turns}], got {self.mean_turns}")

    @property
    def max_request_tokens(self) -> int:
        """KV one request can hold at most: the longest prompt (every part at its longest) and answer."""
        turns = self.max_turns * (self.user_len[1] + self.output_len[1])
        return self.system_len[1] + self.fewshot_len[1] + turns


@dataclass(eq=False)
class Request:
    rid: int
    prefix_ids: tuple[int, ...]  # the tenant's system or few-shot prefix on a first turn, else empty
    user_ids: tuple[int, ...]
    output_ids: tuple[int, ...]
    arrival_s: float | None  # first turns only; later turns arrive a think time after the previous ends
    think_s: float = 0.0
    prev_turn: Request | None = None
    next_turn: Request | None = None

    @property
    def prompt_ids(self) -> tuple[int, ...]:
        """Built on each call, so that the trace holds each conversation once rather than every turn's prompt
        (a 256-worker trace would otherwise take about half a gigabyte)."""
        prev = self.prev_turn
        context = self.prefix_ids if prev is None else prev.prompt_ids + prev.output_ids
        return context + self.user_ids


def _zipf_weights(n: int, s: float) -> list[float]:
    return [1.0 / (rank ** s) for rank in range(1, n + 1)]


def _num_turns(rng: random.Random, cfg: TraceConfig) -> int:
    """1 + a geometric-like tail, so the mean is about ``mean_turns`` (before the cap)."""
    if cfg.mean_turns == 1:
        return 1
    return min(cfg.max_turns, 1 + int(rng.expovariate(1.0 / (cfg.mean_turns - 1))))


def make_trace(cfg: TraceConfig) -> list[Request]:
    """Every request of the trace, first turns in arrival order, each conversation's turns linked."""
    rng = random.Random(cfg.seed)

    def ids(bounds: tuple[int, int]) -> tuple[int, ...]:
        return tuple(rng.randrange(cfg.vocab_size) for _ in range(rng.randint(*bounds)))

    systems = [ids(cfg.system_len) for _ in range(cfg.num_tenants)]
    fewshots = [[s + ids(cfg.fewshot_len) for _ in range(cfg.fewshot_per_tenant)] for s in systems]
    tenant_w = _zipf_weights(cfg.num_tenants, cfg.zipf_s)
    fewshot_w = _zipf_weights(cfg.fewshot_per_tenant, cfg.zipf_s)
    requests: list[Request] = []
    now = 0.0
    for _ in range(cfg.num_conversations):
        now += rng.expovariate(cfg.conversations_per_s)
        tenant = rng.choices(range(cfg.num_tenants), tenant_w)[0]
        prefix = systems[tenant]
        if rng.random() < cfg.fewshot_prob:
            prefix = rng.choices(fewshots[tenant], fewshot_w)[0]
        num_turns = _num_turns(rng, cfg)
        prev: Request | None = None
        for turn in range(num_turns):
            req = Request(len(requests), prefix if prev is None else (), ids(cfg.user_len), ids(cfg.output_len),
                          arrival_s=now if turn == 0 else None, think_s=rng.expovariate(1.0 / cfg.think_s),
                          prev_turn=prev)
            if prev is not None:
                prev.next_turn = req
            requests.append(req)
            prev = req
    return requests
