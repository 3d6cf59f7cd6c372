"""The scheduler process of the server: one Scheduler driven by a receive -> step -> send loop.

The same ``Scheduler`` class the in-process Engine drives; here it reads requests and
control messages from its PULL socket (sent by the tokenizer manager) and pushes every
step's ``BatchTokenIDOut`` and every control reply to the detokenizer, which passes the
replies on. With ``--dp-size N`` the launcher starts N of these, one per replica.
"""
from __future__ import annotations

import logging
import os
import threading
import traceback
from multiprocessing.connection import Connection
from typing import Any

import orjson
import zmq

from radixlang.runtime.server_args import ServerArgs
from radixlang.runtime.io_struct import (
    AbortReq, CheckMemoryLeakOut, CheckMemoryLeakReq, FlushCacheOut, FlushCacheReq, GetInternalStateOut,
    GetInternalStateReq, LoRAUpdateReq, SchedulerReady, TokenizedGenerateReq, decode, encode,
)
from radixlang.runtime.ipc import (
    IpcNames, ParentWatch, exit_with_parent, ignore_stop_signals, pull_socket, push_socket, remove_private_dir,
)

logger = logging.getLogger(__name__)
_IDLE_POLL_MS = 500  # how long an idle scheduler sleeps on its socket before checking on its parent


def run_scheduler_process(args_json: bytes, replica: int, ipc_folder: str, ready: Connection) -> None:
    """Process entry: load the model, report on ``ready`` (a SchedulerReady), then serve until told to stop."""
    parent = exit_with_parent(ipc_folder)
    ignore_stop_signals(parent, ipc_folder)
    args = ServerArgs(**orjson.loads(args_json))
    logging.basicConfig(level=args.log_level.upper(),
                        format=f"[%(asctime)s scheduler-{replica} %(name)s] %(message)s")
    # The model is loaded and run on one worker thread, as in Engine: the same steps issued from the
    # main thread ran far slower on a busy host, and loading on one thread but stepping on another
    # left two OpenMP teams, which slowed oneDNN's packed matmuls (see entrypoints/engine_thread.py;
    # the figures: docs/cpu.md, "One OpenMP team per replica").
    failed: list[BaseException] = []
    ctx = zmq.Context()
    worker = threading.Thread(target=_serve, args=(args, replica, ipc_folder, ctx, ready, failed, parent),
                              name="radixlang-scheduler", daemon=True)
    worker.start()
    worker.join()
    ctx.destroy(linger=0)
    if not parent.parent_alive():  # the server was killed: nobody else will remove the sockets
        remove_private_dir(ipc_folder)
    if failed:  # the launcher sees the exit code and stops the server
        raise SystemExit(1)


def _serve(args: ServerArgs, replica: int, ipc_folder: str, ctx: zmq.Context,
           ready: Connection, failed: list[BaseException], parent: ParentWatch) -> None:
    try:  # the import too: a broken one must reach the launcher as this replica's error, not exit 0
        from radixlang.runtime.scheduler.build import build_scheduler  # the heavy import: torch and the model code
        scheduler = build_scheduler(args, replica=replica)
    except BaseException as e:
        logger.exception("the scheduler failed to start")
        ready.send_bytes(encode(SchedulerReady(replica=replica, pid=os.getpid(),
                                               error=f"{type(e).__name__}: {e}\n{traceback.format_exc()}")))
        failed.append(e)
        return
    ipc = IpcNames(ipc_folder)
    loop = SchedulerLoop(scheduler, recv=pull_socket(ctx, ipc.scheduler(replica)),
                         send=push_socket(ctx, ipc.detokenizer), parent=parent)
    ready.send_bytes(encode(scheduler.ready_report(replica)))
    ready.close()
    _run_loop(loop, failed)


def _run_loop(loop: SchedulerLoop, failed: list[BaseException]) -> None:
    try:
        loop.run()
    except BaseException as e:
        logger.exception("the scheduler loop failed")
        failed.append(e)


class SchedulerLoop:
    """recv every waiting message -> one ``step()`` -> send its outputs; sleeps on the socket when idle."""

    def __init__(self, scheduler: Any, *, recv: zmq.Socket, send: zmq.Socket,
                 parent: ParentWatch | None = None) -> None:
        self.scheduler = scheduler
        self.recv = recv
        self.send = send
        self.parent = parent or ParentWatch()

    def run(self) -> None:
        while True:
            self.receive(timeout_ms=_IDLE_POLL_MS if self.scheduler.is_idle() else 0)
            if self.scheduler.is_idle():
                out = self.scheduler.outputs.flush(self.scheduler.tokenizer)  # refusals and aborts
            else:
                out = self.scheduler.step()
            if out is not None:
                self.send.send(encode(out))
            # every step (one getppid call): a long prefill stops at its next chunk, not at its end
            if not self.parent.parent_alive():
                logger.warning("the server process is gone; the scheduler exits")
                return

    def receive(self, *, timeout_ms: int) -> None:
        if not self.recv.poll(timeout_ms):
            return
        while True:
            try:
                data = self.recv.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            reply = self.handle(decode(data))
            if reply is not None:
                self.send.send(encode(reply))

    def handle(self, msg: Any) -> Any:
        """Apply one incoming message; a control message returns its reply (with the call's id)."""
        sched = self.scheduler
        if isinstance(msg, TokenizedGenerateReq):
            sched.add_request(msg)
        elif isinstance(msg, AbortReq):
            sched.abort_request(msg.rid)
        elif isinstance(msg, FlushCacheReq):
            out = sched.flush_cache()
            return FlushCacheOut(success=out.success, message=out.message, rid=msg.rid)
        elif isinstance(msg, GetInternalStateReq):
            return GetInternalStateOut(state=sched.get_internal_state(), rid=msg.rid)
        elif isinstance(msg, LoRAUpdateReq):
            return sched.update_lora(msg)
        elif isinstance(msg, CheckMemoryLeakReq):
            try:
                sched.check_memory_leak()
            except (RuntimeError, AssertionError) as e:  # the leak check raises RuntimeError
                return CheckMemoryLeakOut(ok=False, message=str(e), rid=msg.rid)
            return CheckMemoryLeakOut(ok=True, rid=msg.rid)
        else:
            raise TypeError(f"the scheduler expected a request or control message, got {type(msg).__name__}")
        return None
