"""EngineFront: the HTTP app over an in-process Engine (``create_app(EngineFront(engine))``).

The server proper runs the TokenizerManager over three processes; this front lets a
notebook or a test serve the same routes from one process. Blocking Engine calls run
in worker threads so the event loop keeps serving.
"""
from __future__ import annotations

import asyncio
import uuid
from typing import Any, Iterator

from radixlang.runtime.entrypoints.engine import Engine


class EngineStream:
    """Async iteration over an Engine stream; ``aclose()`` aborts the request unless it finished."""

    def __init__(self, engine: Engine, rid: str, it: Iterator[dict]) -> None:
        self.engine, self.rid, self._it = engine, rid, it
        self._ended = False

    def __aiter__(self) -> EngineStream:
        return self

    async def __anext__(self) -> dict[str, Any]:
        if self._ended:
            raise StopAsyncIteration
        snap = await asyncio.to_thread(next, self._it)
        self._ended = snap["meta_info"].get("finish_reason") is not None
        return snap

    async def aclose(self) -> None:
        if not self._ended:
            self._ended = True
            await asyncio.to_thread(self.engine.abort_request, self.rid)


class EngineFront:
    """The ``http_server.Front`` of an in-process Engine."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.server_args = engine.server_args
        self.tokenizer = engine.tokenizer
        self.model_path = engine.scheduler.runner.model_path
        self.tokenizer_path = engine.scheduler.runner.tokenizer_path
        self.draining = False

    def is_healthy(self) -> bool:
        return self.engine._error is None and self.engine._thread.is_alive()

    async def generate(self, **kwargs: Any) -> dict | list[dict]:
        return await asyncio.to_thread(self.engine.generate, **kwargs)

    async def stream(self, **kwargs: Any) -> EngineStream:
        rid = kwargs.pop("rid", None) or uuid.uuid4().hex
        it = self.engine.generate(**kwargs, rid=rid, stream=True)
        return EngineStream(self.engine, rid, it)

    def abort_request(self, rid: str) -> None:
        self.engine.abort_request(rid)

    async def flush_cache(self) -> bool:
        return await asyncio.to_thread(self.engine.flush_cache)

    async def get_server_info(self) -> dict[str, Any]:
        return await asyncio.to_thread(self.engine.get_server_info)
