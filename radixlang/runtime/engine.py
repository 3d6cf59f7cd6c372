"""Engine: the whole runtime in-process, no HTTP.

A background thread drives the one Scheduler step by step; ``generate`` may be
called from many threads at once and their requests are batched together.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
import uuid
from typing import Any, AsyncIterator, Iterator

from radixlang.runtime.config import ServerArgs
from radixlang.runtime.detokenizer import DetokenizerManager
from radixlang.runtime.io import BatchStrOut, TokenizedGenerateReq
from radixlang.runtime.request_output import RequestOutput, expand_requests, is_batched
from radixlang.runtime.scheduler import Scheduler

logger = logging.getLogger(__name__)


class _Pending(RequestOutput):
    """One request's accumulated output; `events` receives a copy after every update."""

    def __init__(self, rid: str, stream: bool) -> None:
        super().__init__(rid)
        self.stream = stream
        self.events: queue.Queue = queue.Queue()

    def update(self, out: BatchStrOut, i: int) -> None:
        super().update(out, i)
        self.events.put(self.snapshot())


class Engine:
    """In-process runtime. ``Engine(model_path=None, **ServerArgs fields)``."""

    def __init__(self, **kwargs: Any) -> None:
        self.server_args = ServerArgs(**kwargs)  # a misspelled option is a TypeError
        self.scheduler = Scheduler(self.server_args)
        self.server_args = self.scheduler.args
        self.tokenizer = self.scheduler.tokenizer
        self.detokenizer = DetokenizerManager(self.tokenizer)
        self._inbox: queue.Queue = queue.Queue()
        self._pending: dict[str, _Pending] = {}
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = False
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name="radixlang-scheduler", daemon=True)
        self._thread.start()

    # ---- the scheduler thread -----------------------------------------------------------------
    def _loop(self) -> None:
        sched = self.scheduler
        while not self._stop:
            try:
                self._drain_inbox()
            except BaseException as e:  # add_request crashing must fail callers, not strand them
                logger.exception("scheduler request handling failed")
                self._error = e
                self._fail_all(e)
                return
            if sched.is_idle():
                self._wake.wait(0.05)
                self._wake.clear()
                continue
            try:
                out = sched.step()
            except BaseException as e:  # a crash must not leave callers waiting forever
                logger.exception("scheduler step failed")
                self._error = e
                self._fail_all(e)
                return
            if out is not None:
                self._deliver(self.detokenizer.handle(out))

    def _drain_inbox(self) -> None:
        while True:
            try:
                fn = self._inbox.get_nowait()
            except queue.Empty:
                return
            out = fn()
            if out is not None:
                self._deliver(self.detokenizer.handle(out))

    def _deliver(self, out: BatchStrOut) -> None:
        for i, rid in enumerate(out.rids):
            with self._lock:
                p = self._pending.get(rid)
            if p is None:
                continue
            p.update(out, i)
            if p.done:
                with self._lock:
                    self._pending.pop(rid, None)

    def _fail_all(self, e: BaseException) -> None:
        with self._lock:
            pending, self._pending = list(self._pending.values()), {}
        for p in pending:
            p.fail(f"engine error: {e}")
            p.events.put(p.snapshot())

    def _call(self, fn) -> Any:
        """Run fn on the scheduler thread and wait for its result."""
        box: queue.Queue = queue.Queue()

        def wrapped():
            try:
                box.put((True, fn()))
            except BaseException as e:
                box.put((False, e))
            return None
        self._inbox.put(wrapped)
        self._wake.set()
        ok, value = box.get()
        if not ok:
            raise value
        return value

    # ---- submitting ---------------------------------------------------------------------------
    def _submit(self, input_ids: list[int], params: dict[str, Any], *, text: str | None, return_logprob: bool,
                logprob_start_len: int | None, top_logprobs_num: int, stream: bool, rid: str | None) -> _Pending:
        if self._error is not None:
            raise RuntimeError(f"the engine has failed: {self._error}")
        rid = rid or uuid.uuid4().hex
        p = _Pending(rid, stream)
        p.return_logprob = return_logprob
        with self._lock:
            if rid in self._pending:
                raise ValueError(f"duplicate request id {rid!r}")
            self._pending[rid] = p
        req = TokenizedGenerateReq(rid=rid, input_ids=input_ids, sampling_params=params, input_text=text,
                                   return_logprob=return_logprob,
                                   logprob_start_len=-1 if logprob_start_len is None else logprob_start_len,
                                   top_logprobs_num=top_logprobs_num, stream=stream)

        def add():
            self.scheduler.add_request(req)
            return self.scheduler.outputs.flush(self.tokenizer)  # immediate errors
        self._inbox.put(add)
        self._wake.set()
        return p

    def _expand(self, prompt, sampling_params, input_ids) -> list[tuple[list[int], str | None, dict]]:
        return expand_requests(self.tokenizer, prompt, sampling_params, input_ids)

    def generate(self, prompt: str | list[str] | None = None, sampling_params: dict | list[dict] | None = None,
                 input_ids: list[int] | list[list[int]] | None = None, return_logprob: bool = False,
                 logprob_start_len: int | None = None, top_logprobs_num: int = 0, stream: bool = False,
                 rid: str | None = None) -> dict | list[dict] | Iterator[dict]:
        """Generate for one prompt (a dict) or many (a list of dicts, n expanded in order)."""
        items = self._expand(prompt, sampling_params, input_ids)
        batched = is_batched(prompt, input_ids, len(items))
        if stream:
            if len(items) != 1:
                raise ValueError("stream=True takes a single prompt with n=1")
            ids, text, params = items[0]
            p = self._submit(ids, params, text=text, return_logprob=return_logprob,
                             logprob_start_len=logprob_start_len, top_logprobs_num=top_logprobs_num,
                             stream=True, rid=rid)
            return self._iterate(p)
        pendings = [self._submit(ids, params, text=text, return_logprob=return_logprob,
                                 logprob_start_len=logprob_start_len, top_logprobs_num=top_logprobs_num,
                                 stream=False, rid=rid if len(items) == 1 else None)
                    for ids, text, params in items]
        results = [self._wait(p) for p in pendings]
        return results if batched else results[0]

    def _wait(self, p: _Pending) -> dict:
        while True:
            snap = p.events.get()
            if snap["meta_info"].get("finish_reason") is not None:
                return snap

    def _iterate(self, p: _Pending) -> Iterator[dict]:
        while True:
            snap = p.events.get()
            yield snap
            if snap["meta_info"].get("finish_reason") is not None:
                return

    async def async_generate(self, prompt: str | list[str] | None = None, sampling_params: dict | list | None = None,
                             **kwargs: Any) -> dict | list[dict] | AsyncIterator[dict]:
        if kwargs.get("stream"):
            it = self.generate(prompt, sampling_params, **kwargs)
            return _aiter_from_thread(it)
        return await asyncio.to_thread(self.generate, prompt, sampling_params, **kwargs)

    # ---- control ------------------------------------------------------------------------------
    def abort_request(self, rid: str) -> None:
        self._call(lambda: self.scheduler.abort_request(rid))
        self._wake.set()

    def flush_cache(self) -> bool:
        out = self._call(self.scheduler.flush_cache)
        if not out.success:
            logger.warning("flush_cache refused: %s", out.message)
        return out.success

    def get_server_info(self) -> dict[str, Any]:
        state = self._call(self.scheduler.get_internal_state)
        return {**self.server_args.to_dict(), **state, "version": _version()}

    def check_memory_leak(self) -> None:
        self._call(self.scheduler.check_memory_leak)

    def shutdown(self) -> None:
        self._stop = True
        self._wake.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout=10)

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()


async def _aiter_from_thread(it: Iterator[dict]) -> AsyncIterator[dict]:
    sentinel = object()
    while True:
        item = await asyncio.to_thread(next, it, sentinel)
        if item is sentinel:
            return
        yield item


def _version() -> str:
    from radixlang import __version__
    return __version__
