"""EngineFront: the HTTP app over an in-process Engine (``create_app(EngineFront(engine))``).

The server proper runs the TokenizerManager over three processes; this front lets a
notebook or a test serve the same routes from one process. Both are the same
``AsyncFront`` over the same request front; only the transport differs.
"""
from __future__ import annotations

from radixlang.runtime.entrypoints.engine import Engine
from radixlang.runtime.front.request_front import AsyncFront


class EngineFront(AsyncFront):
    """The ``http_common.Front`` of an in-process Engine."""

    def __init__(self, engine: Engine) -> None:
        super().__init__(engine.front, model_path=engine.scheduler.runner.model_path,
                         tokenizer_path=engine.scheduler.runner.tokenizer_path)
        self.engine = engine

    def is_healthy(self) -> bool:
        return super().is_healthy() and all(r.thread.is_alive() for r in self.engine.replicas)
