"""radixlang: a structured-generation LLM runtime with a Python DSL frontend.

`import radixlang as sgl` gives the DSL (`sgl.function`, `sgl.gen`, `sgl.select`,
roles, backends) without importing torch; `sgl.Engine` loads the runtime on
first use, so DSL clients that talk to a server stay light.
"""
from __future__ import annotations

from typing import Any

from radixlang.lang._public import *  # noqa: F401,F403
from radixlang.lang._public import __all__ as _lang_all

__version__ = "0.1.0"
__all__ = [*_lang_all, "Engine", "__version__"]  # noqa: F405 (Engine: lazily by __getattr__)


def __getattr__(name: str) -> Any:
    if name == "Engine":
        from radixlang.runtime.entrypoints.engine import Engine
        return Engine
    raise AttributeError(f"module 'radixlang' has no attribute {name!r}")
