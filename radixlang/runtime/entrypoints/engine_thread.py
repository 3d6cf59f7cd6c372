"""One Scheduler replica driven step by step on its own thread (the Engine holds one per dp rank).

The thread also builds the scheduler (loads the model): torch's OpenMP threads belong to the
thread that first runs a parallel op, and a second thread running the steps next to the team
of the thread that loaded the weights ran oneDNN's packed matmuls slower (docs/cpu.md, "One
OpenMP team per replica"); one thread for both keeps one team.

Other threads never touch the scheduler: they post calls to the replica's
inbox, which the thread runs between steps. Outputs go through the replica's
own detokenizer to the ``deliver`` callback; a crash goes to ``on_error`` and
ends the thread. ``report()``, ``add_request``, ``abort_request`` and ``control``
are what the Engine's in-process transport of the request front calls: the
same messages and replies a scheduler process exchanges over its sockets.
"""
from __future__ import annotations

import logging
import queue
import threading
from typing import Any, Callable

from radixlang.runtime.front.detokenizer import DetokenizerManager
from radixlang.runtime.io_struct import (
    BatchStrOut, CheckMemoryLeakOut, CheckMemoryLeakReq, FlushCacheOut, FlushCacheReq, GetInternalStateOut,
    GetInternalStateReq, LoRAUpdateOut, LoRAUpdateReq, SchedulerReady, TokenizedGenerateReq,
)
from radixlang.runtime.scheduler.scheduler import Scheduler

logger = logging.getLogger(__name__)


class SchedulerThread:
    def __init__(self, make_scheduler: Callable[[], Scheduler], *, index: int, name: str,
                 deliver: Callable[[BatchStrOut], None],
                 on_error: Callable[[int, BaseException], None]) -> None:
        self._make_scheduler = make_scheduler
        self.scheduler: Scheduler | None = None
        self.detokenizer: DetokenizerManager | None = None
        self.index = index
        self._deliver = deliver
        self._on_error = on_error
        self._inbox: queue.Queue = queue.Queue()
        self._wake = threading.Event()
        self._built = threading.Event()
        self._build_error: BaseException | None = None
        self._stop = False
        self.thread = threading.Thread(target=self._main, name=name, daemon=True)

    def start(self) -> None:
        """Start the thread; it builds the scheduler, then steps it. ``wait_built`` waits for the first part."""
        self.thread.start()

    def wait_built(self) -> Scheduler:
        """The built scheduler, or the exception its construction raised."""
        self._built.wait()
        if self._build_error is not None:
            raise self._build_error
        if self.scheduler is None:
            raise RuntimeError("the scheduler thread signalled built without a scheduler or an error")
        return self.scheduler

    def stop(self) -> None:
        self._stop = True
        self._wake.set()
        if self.thread.is_alive() and threading.current_thread() is not self.thread:
            self.thread.join(timeout=10)
        if self.scheduler is not None:
            self.scheduler.runner.shutdown()  # tensor-parallel follower processes, if any
            self.scheduler.grammars.close()  # grammar compile worker processes, if any

    def report(self) -> SchedulerReady:
        """What a scheduler process sends the launcher once it is ready (after ``wait_built``)."""
        sched = self.wait_built()
        return sched.ready_report(self.index)

    def add_request(self, req: TokenizedGenerateReq) -> None:
        """Queue a request (returns at once); a refusal comes back through ``deliver``."""
        sched = self.wait_built()

        def add() -> Any:
            sched.add_request(req)
            return sched.outputs.flush(sched.tokenizer)  # immediate errors
        self.post(add)

    def abort_request(self, rid: str) -> None:
        """Abort a request (returns at once); a waiting one's abort is delivered even if the replica idles."""
        sched = self.wait_built()

        def abort() -> Any:
            sched.abort_request(rid)
            return sched.outputs.flush(sched.tokenizer)
        self.post(abort)

    def control(self, msg: FlushCacheReq | GetInternalStateReq | CheckMemoryLeakReq | LoRAUpdateReq
                ) -> FlushCacheOut | GetInternalStateOut | CheckMemoryLeakOut | LoRAUpdateOut:
        """Answer a control message on the replica's thread, as a scheduler process answers it."""
        sched = self.wait_built()
        if isinstance(msg, LoRAUpdateReq):
            return self.call(lambda: sched.update_lora(msg))
        if isinstance(msg, FlushCacheReq):
            out = self.call(sched.flush_cache)
            return FlushCacheOut(success=out.success, message=out.message, rid=msg.rid)
        if isinstance(msg, GetInternalStateReq):
            return GetInternalStateOut(state=self.call(sched.get_internal_state), rid=msg.rid)
        if isinstance(msg, CheckMemoryLeakReq):
            def check() -> str | None:
                try:
                    sched.check_memory_leak()
                except (RuntimeError, AssertionError) as e:  # the leak check raises RuntimeError
                    return str(e)
                return None
            leak = self.call(check)  # a RuntimeError of call itself (the replica stopped) is no leak: it raises
            return CheckMemoryLeakOut(ok=leak is None, message=leak or "", rid=msg.rid)
        raise TypeError(f"expected a control message, got {type(msg).__name__}")

    def post(self, fn: Callable[[], Any]) -> None:
        """Run fn on the replica's thread; a BatchTokenIDOut it returns is delivered like a step's."""
        self._inbox.put(fn)
        self._wake.set()

    def call(self, fn: Callable[[], Any]) -> Any:
        """Run fn on the replica's thread and wait for its result (its exception is raised here)."""
        if not self.thread.is_alive():
            raise RuntimeError(f"scheduler replica {self.index} is not running")
        box: queue.Queue = queue.Queue()

        def wrapped() -> None:
            try:
                box.put((True, fn()))
            except BaseException as e:
                box.put((False, e))
        self.post(wrapped)
        while True:
            try:
                ok, value = box.get(timeout=0.5)
                break
            except queue.Empty:
                if not self.thread.is_alive() and box.empty():  # it died (or was stopped) before running fn
                    raise RuntimeError(f"scheduler replica {self.index} stopped") from None
        if not ok:
            raise value
        return value

    # ---- the thread ---------------------------------------------------------------------------
    def _main(self) -> None:
        try:
            self.scheduler = self._make_scheduler()
            self.detokenizer = DetokenizerManager(self.scheduler.tokenizer)
        except BaseException as e:
            self._build_error = e
            return
        finally:
            self._built.set()
        self._loop()

    def _loop(self) -> None:
        sched = self.scheduler
        if sched is None or self.detokenizer is None:
            raise RuntimeError("the scheduler loop started before the scheduler was built")
        while not self._stop:
            try:
                self._drain_inbox()
            except BaseException as e:  # add_request crashing must fail callers, not strand them
                logger.exception("scheduler request handling failed")
                self._on_error(self.index, e)
                return
            if sched.is_idle():
                self._wake.wait(0.05)
                self._wake.clear()
                continue
            try:
                out = sched.step()
            except BaseException as e:  # a crash must not leave callers waiting forever
                logger.exception("scheduler step failed")
                self._on_error(self.index, e)
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
