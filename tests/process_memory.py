"""What a test process holds on to, and letting go of it: see RELEASE_ABOVE_MB in tests/conftest.py."""
from __future__ import annotations

import ctypes
import functools
import gc
import os
import sys


def rss_mb() -> int:
    """This process's resident memory (Linux; 0 elsewhere, where nothing is released)."""
    if not os.path.exists("/proc/self/statm"):
        return 0
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") // 2**20


def release_freed_memory() -> None:
    """Let go of torn-down apps, collect cycles, then hand the heap's free pages back to the system (glibc;
    elsewhere a no-op)."""
    fastapi_models = sys.modules.get("fastapi.dependencies.models")
    for value in list(vars(fastapi_models).values()) if fastapi_models else []:
        if isinstance(value, functools._lru_cache_wrapper):  # classification caches: recomputed when needed
            value.cache_clear()
    gc.collect()
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (AttributeError, OSError):
        pass
