"""How many KV slots the pool gets when ``--max-total-tokens`` is not given.

As SGLang's ``mem_fraction_static``: a share of the device's *total* memory holds the static allocation,
the weights and the KV pool, so the pool gets ``fraction x total - weights``. On CUDA the default share is
SGLang's 0.88. On the CPU the host is shared with everything else the machine runs, so the default gives
the pool ``CPU_KV_SHARE`` of the memory the weights leave (split between the processes of the node), which
depends on the machine and the model only, never on what happens to be free at the moment of the start
(#42: three starts on one machine sized the pool at 67,863, 42,123 and 18,284 tokens).

Either way the pool never takes more than what is actually available less a reserve for activations
without a warning that names the numbers, and a ``max_total_tokens`` larger than that is kept as asked,
with a warning.
"""
from __future__ import annotations

from typing import NamedTuple

CUDA_MEM_FRACTION = 0.88  # SGLang's mem_fraction_static on a large GPU: weights + KV of the total
CPU_KV_SHARE = 0.1  # the CPU default: this share of the host memory the weights leave goes to the KV pool
CPU_MAX_TOKENS = 1 << 20  # a tiny model's pool on the CPU stops here (zeroing it costs host memory)
MIN_TOKENS = 256


class KVPoolSize(NamedTuple):
    tokens: int
    how: str  # where the figure comes from, for the start log
    warning: str | None  # set where the pool is smaller than the fraction asks, or larger than what is available


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def activation_reserve(total_bytes: int) -> int:
    """Memory kept out of the pool for activations, graphs and workspaces: 5% of the total, at least 1 GiB."""
    return max(1 << 30, total_bytes // 20)


def cpu_default_fraction(total_bytes: int, model_bytes: int, share: float = CPU_KV_SHARE) -> float:
    """The mem_fraction_static (of the total: weights + KV) that gives the pool ``share`` of what the weights
    leave."""
    if total_bytes <= 0:
        return share
    model = min(model_bytes, total_bytes)
    return (model + share * (total_bytes - model)) / total_bytes


def size_kv_pool(*, total_bytes: int, available_bytes: int, model_bytes: int, per_token_bytes: float,
                 fraction: float, asked_tokens: int | None = None, min_tokens: int = MIN_TOKENS,
                 max_tokens: int | None = None) -> KVPoolSize:
    """The pool's size in tokens, as a pure function of the memory figures.

    ``total_bytes``: the device's (or this process's share of the host's) total memory; ``available_bytes``:
    what is free now, the weights already loaded; ``model_bytes``: the weights (and whatever else this
    process holds); ``fraction``: of the total for weights + KV; ``asked_tokens``: ``max_total_tokens``,
    kept as given.
    """
    if per_token_bytes <= 0:
        raise ValueError(f"per_token_bytes must be > 0, got {per_token_bytes}")
    reserve = activation_reserve(total_bytes)
    ceiling = max(0, available_bytes - reserve)
    room = (f"{_gib(ceiling)} available ({_gib(available_bytes)} free less {_gib(reserve)} kept for "
            f"activations)")
    if asked_tokens is not None:
        need = asked_tokens * per_token_bytes
        warning = None
        if need > ceiling:
            warning = (f"max_total_tokens {asked_tokens} needs {_gib(need)} of KV ({per_token_bytes:.0f} bytes per "
                       f"token), more than the {room}; keeping it as asked")
        return KVPoolSize(asked_tokens, "max_total_tokens", warning)
    budget = int(fraction * total_bytes) - model_bytes
    want = int(max(budget, 0) // per_token_bytes)
    how = (f"mem_fraction_static {fraction:.3f} of {_gib(total_bytes)} total = {_gib(fraction * total_bytes)}, "
           f"less {_gib(model_bytes)} of weights")
    tokens = want
    warnings = []
    if max_tokens is not None and tokens > max_tokens:
        tokens = max_tokens
        how += f", capped at {max_tokens} tokens"
    if tokens * per_token_bytes > ceiling:
        tokens = int(ceiling // per_token_bytes)
        warnings.append(f"the KV pool of {want} tokens ({_gib(max(budget, 0))}: {how}) does not fit the {room}: "
                        f"{tokens} tokens")
        how += f"; cut to the {_gib(ceiling)} available"
    if tokens < min_tokens:
        warnings.append(f"the KV pool would hold {tokens} tokens ({how}); raised to the minimum of {min_tokens} "
                        f"({_gib(min_tokens * per_token_bytes)})")
        how += f"; raised to the minimum {min_tokens}"
        tokens = min_tokens
    return KVPoolSize(tokens, how, "; ".join(warnings) or None)


def host_memory() -> tuple[int, int]:
    """(total, available) bytes of host memory, within the cgroup's limit where one is set."""
    total, available = 0, 0
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    total = int(line.split()[1]) * 1024
                elif line.startswith("MemAvailable:"):
                    available = int(line.split()[1]) * 1024
    except OSError:
        pass
    if not total:  # no /proc: a conservative guess rather than a failure
        total, available = 8 << 30, 4 << 30
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            limit = f.read().strip()
        with open("/sys/fs/cgroup/memory.current") as f:
            used = int(f.read().strip())
        if limit.isdigit():
            total = min(total, int(limit))
            available = min(available, max(0, int(limit) - used))
    except (OSError, ValueError):
        pass
    return total, available
