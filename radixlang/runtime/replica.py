"""One Scheduler replica driven step by step on its own thread (the Engine holds one per dp rank).

Other threads never touch the scheduler: they post calls to the replica's
inbox, which the thread runs between steps. Outputs go through the replica's
own detokenizer to the ``deliver`` callback; a crash goes to ``on_error`` and
ends the thread.
"""
from __future__ import annotations

import logging
import queue
import threading
from typing import Any, Callable

from radixlang.runtime.detokenizer import DetokenizerManager
from radixlang.runtime.io import BatchStrOut
from radixlang.runtime.scheduler import Scheduler

logger = logging.getLogger(__name__)


class SchedulerThread:
    def __init__(self, scheduler: Scheduler, *, index: int, name: str,
                 deliver: Callable[[BatchStrOut], None],
                 on_error: Callable[[int, BaseException], None]) -> None:
        self.scheduler = scheduler
        self.index = index
        self.detokenizer = DetokenizerManager(scheduler.tokenizer)
        self._deliver = deliver
        self._on_error = on_error
        self._inbox: queue.Queue = queue.Queue()
        self._wake = threading.Event()
        self._stop = False
        self.thread = threading.Thread(target=self._loop, name=name, daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self._stop = True
        self._wake.set()
        if self.thread.is_alive() and threading.current_thread() is not self.thread:
            self.thread.join(timeout=10)
        self.scheduler.runner.shutdown()  # tensor-parallel follower processes, if any

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
    def _loop(self) -> None:
        sched = self.scheduler
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
