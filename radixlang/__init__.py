"""radixlang: a structured-generation LLM runtime with a Python DSL frontend."""
from __future__ import annotations

from typing import Any

__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    # The runtime (torch) loads only when asked for, so DSL clients stay light.
    if name == "Engine":
        from radixlang.runtime.engine import Engine
        return Engine
    raise AttributeError(f"module 'radixlang' has no attribute {name!r}")
