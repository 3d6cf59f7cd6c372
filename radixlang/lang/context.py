"""Where the default backend lives, and how a raw Engine becomes a Backend.

``DEFAULT_CONTEXT`` is the one module-level holder instance (documented in
DESIGN's spirit: a small context object, not a bare global). Tests and
libraries that want isolation build their own ``BackendContext`` or pass
``backend=`` explicitly.
"""
from __future__ import annotations

import contextvars
import threading
from typing import Any

from radixlang.lang.backends.base import Backend


class BackendContext:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._default: Backend | None = None

    def set(self, backend: Any) -> Backend | None:
        with self._lock:
            self._default = None if backend is None else as_backend(backend)
            return self._default

    def get(self) -> Backend | None:
        with self._lock:
            return self._default

    def resolve(self, backend: Any = None) -> Backend:
        """The backend to use: the one given, else the default; a clear error when neither exists."""
        chosen = as_backend(backend) if backend is not None else self.get()
        if chosen is None:
            raise ValueError("no backend: pass backend=... or call set_default_backend(Engine(...) | "
                             "RuntimeEndpoint(url) | Runtime(...) | OpenAI(model))")
        return chosen


DEFAULT_CONTEXT = BackendContext()

# True while a program body runs in this context: calling a @function with plain
# arguments there makes an inline sub-program instead of a new run.
INSIDE_PROGRAM: contextvars.ContextVar[bool] = contextvars.ContextVar("radixlang_inside_program", default=False)


def _looks_like_engine(obj: Any) -> bool:
    return all(hasattr(obj, a) for a in ("generate", "tokenizer", "flush_cache", "get_server_info"))


def as_backend(obj: Any) -> Backend:
    """A Backend as is; a radixlang Engine (or anything with its API) wrapped in an EngineBackend."""
    if isinstance(obj, Backend):
        return obj
    if _looks_like_engine(obj):
        from radixlang.lang.backends.engine import EngineBackend
        return EngineBackend(obj)
    raise TypeError(f"expected a Backend or a radixlang Engine, got {type(obj).__name__}")
