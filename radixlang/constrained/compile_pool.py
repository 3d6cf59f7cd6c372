"""CompileWorkers: grammar compiles in child processes that are killed when a compile outlasts its limit.

Each of ``num_workers`` slots is a thread that owns one worker process (compile_worker.py),
started on the slot's first compile and kept warm. A slot takes the next queued compile, sends it
to its worker and waits up to ``timeout_s`` (counted from the send, so a worker's start-up and
the wait in the queue are not charged to the grammar) for the answer. Past the limit it kills the
worker (SIGKILL: a compile in native code cannot be interrupted otherwise), fails the compile with
GrammarCompileTimeout and starts a fresh worker, so nothing keeps burning CPU for a request that
already failed. A worker that dies (a library crash) fails only the grammar it was compiling.
"""

from __future__ import annotations

import json
import math
import os
import queue
import select
import subprocess
import sys
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from radixlang.constrained.compile_worker import WorkerConfig, read_frame, write_frame
from radixlang.constrained.errors import UnsupportedGrammar

# the request field each kind comes from (SamplingParams), named in a refusal
KIND_PARAM = {"regex": "regex", "json": "json_schema", "ebnf": "ebnf", "structural_tag": "structural_tag"}
# a worker's start (imports, the tokenizer tables: seconds for xgrammar) is not a compile's; this only
# catches a worker that never comes up
START_TIMEOUT_S = 300.0


class GrammarCompileTimeout(TimeoutError, UnsupportedGrammar):
    """A grammar took longer than the compiler's timeout_s (a ValueError naming the request field,
    so the request fails as bad input)."""

    def __init__(self, message: str, param: str) -> None:
        TimeoutError.__init__(self, message)
        self.param = param


@dataclass(eq=False)
class _Job:
    kind: str
    spec: Any
    future: Future[Any] = field(default_factory=Future)


class _Slot:
    """One worker process and the thread that feeds it."""

    def __init__(self, pool: CompileWorkers, index: int) -> None:
        self.pool = pool
        self.proc: subprocess.Popen[bytes] | None = None
        self.job: _Job | None = None  # the compile this slot took
        self.compiling = False  # its worker has the job (not starting up, not done)
        self.thread = threading.Thread(target=self._run, name=f"grammar-{index}", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while (job := self.pool._jobs.get()) is not None:
            if not job.future.set_running_or_notify_cancel():
                continue
            self.job = job
            try:
                job.future.set_result(self._compile(job))
            except BaseException as e:  # noqa: BLE001 -- every failure belongs to the compile's future
                job.future.set_exception(e)
            finally:
                self.job = None
            if self.proc is None and not self.pool.closed:  # killed or crashed: keep a fresh worker warm
                self._start_quietly()
        self.stop()

    def _compile(self, job: _Job) -> Any:
        pool = self.pool
        proc = self._ensure_started()
        fd_in, fd_out = proc.stdin.fileno(), proc.stdout.fileno()  # type: ignore[union-attr]
        self.compiling = True
        try:
            try:
                write_frame(fd_in, (job.kind, job.spec))
                reply = read_frame(fd_out) if _readable(fd_out, pool.timeout_s) else None
            except (EOFError, OSError):
                reply = ()
            if reply is None:  # past the limit: kill the compile (_run starts a fresh worker)
                self.stop()
        finally:
            self.compiling = False  # after the kill: nothing of this compile runs once it reads False
        if reply is None:
            raise GrammarCompileTimeout(f"grammar compile took longer than {pool.timeout_s:g}s "
                                        f"({job.kind}: {str(job.spec)[:80]!r})", KIND_PARAM[job.kind])
        if pool.closed:
            raise ValueError(f"grammar compiler was shut down before compiling {job.kind}")
        if not reply:  # the worker died under this grammar (a library crash)
            code = self.stop()
            raise UnsupportedGrammar(f"the {pool.config.backend} grammar compiler crashed on this {job.kind} "
                                     f"grammar (exit status {code})", KIND_PARAM[job.kind])
        if reply[0] == "ok":
            return pool.load(job.kind, job.spec, reply[1])
        _, message, param, is_value_error = reply
        if param is not None:
            raise UnsupportedGrammar(message, param)
        raise ValueError(message) if is_value_error else RuntimeError(f"grammar compile failed: {message}")

    def _ensure_started(self) -> subprocess.Popen[bytes]:
        if self.proc is None or self.proc.poll() is not None:
            self.stop()
            self._start()
        return self.proc  # type: ignore[return-value]

    def _start_quietly(self) -> None:
        try:
            self._start()
        except RuntimeError:
            self.stop()  # the next compile tries again and reports why

    def _start(self) -> None:
        # the parent's import path: the worker imports the radixlang (and libraries) this process runs
        boot = ("import json, sys; sys.path[:] = json.loads(sys.argv[2]); "
                "from radixlang.constrained.compile_worker import main; main()")
        self.proc = subprocess.Popen([sys.executable, "-c", boot, str(os.getpid()), json.dumps(sys.path)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0)
        fd_out = self.proc.stdout.fileno()  # type: ignore[union-attr]
        try:
            write_frame(self.proc.stdin.fileno(), self.pool.config)  # type: ignore[union-attr]
            ready = read_frame(fd_out) if _readable(fd_out, START_TIMEOUT_S) else None
        except (EOFError, OSError):
            ready = None
        if ready != ("ready",):
            self.stop()
            raise RuntimeError(f"the {self.pool.config.backend} grammar compile worker did not start "
                               f"(see its stderr)")

    def stop(self) -> int | None:
        """Kill the worker (if any) and reap it; its exit status."""
        proc = self.proc
        if proc is None:
            return None
        if proc.poll() is None:
            proc.kill()
        code = proc.wait()
        for pipe in (proc.stdin, proc.stdout):
            if pipe is not None:
                pipe.close()
        self.proc = None  # only once reaped: a pid no longer listed is gone
        return code


def _readable(fd: int, timeout_s: float) -> bool:
    """Whether ``fd`` has data (or EOF) within ``timeout_s`` (poll: select can't watch fds past 1023)."""
    poller = select.poll()
    poller.register(fd, select.POLLIN | select.POLLHUP | select.POLLERR)
    return bool(poller.poll(math.ceil(max(0.0, timeout_s) * 1000)))


class CompileWorkers:
    """Compiles on up to ``num_workers`` worker processes; ``load(kind, spec, payload)`` (run on a slot
    thread) turns a worker's payload into what the future resolves to."""

    def __init__(self, config: WorkerConfig, *, load: Callable[[str, Any, Any], Any], timeout_s: float,
                 num_workers: int = 2) -> None:
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        self.config = config
        self.load = load
        self.timeout_s = timeout_s
        self.closed = False
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._num_workers = num_workers
        self._slots: list[_Slot] = []

    def submit(self, kind: str, spec: Any) -> Future[Any]:
        job = _Job(kind, spec)
        with self._lock:
            if self.closed:
                job.future.set_exception(ValueError(f"grammar compiler was shut down before compiling {kind}"))
                return job.future
            busy = sum(s.job is not None for s in self._slots) + self._jobs.qsize()
            if busy >= len(self._slots) and len(self._slots) < self._num_workers:  # a worker more: all are busy
                self._slots.append(_Slot(self, len(self._slots)))
            self._jobs.put(job)
        return job.future

    def worker_pids(self) -> list[int]:
        """The worker processes alive now."""
        return [proc.pid for s in list(self._slots) if (proc := s.proc) is not None and proc.poll() is None]

    def num_compiling(self) -> int:
        """Compiles running on a worker now."""
        return sum(s.compiling for s in list(self._slots))

    def compiling_pids(self) -> list[int]:
        """The worker processes running a compile now."""
        return [proc.pid for s in list(self._slots) if s.compiling and (proc := s.proc) is not None]

    def shutdown(self) -> None:
        """Fail queued compiles, kill the workers (compiles in flight fail), stop the slot threads."""
        with self._lock:
            if self.closed:
                return
            self.closed = True
            slots = list(self._slots)
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                break
            if job is not None and job.future.set_running_or_notify_cancel():
                job.future.set_exception(ValueError(f"grammar compiler was shut down before compiling {job.kind}"))
        procs = [proc for slot in slots if (proc := slot.proc) is not None]
        for _ in slots:
            self._jobs.put(None)
        for proc in procs:
            if proc.poll() is None:
                proc.kill()  # its slot thread sees the pipe close and fails the compile
        for proc in procs:
            try:
                proc.wait(timeout=10)  # reaped now, not when the slot thread gets to it
            except subprocess.TimeoutExpired:
                pass
