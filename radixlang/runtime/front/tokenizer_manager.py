"""TokenizerManager: the asyncio front of the server process, the request front over ZMQ.

Everything a call does (tokenize, route to a replica, wait or stream, the router's
bookkeeping, the control fan-out) is front/request_front.py's, shared with the
in-process Engine. What is the server's own is the transport: ``ZmqTransport`` pushes
each ``TokenizedGenerateReq`` / ``AbortReq`` / control message to the chosen
replica's socket, and one receive task reads what the detokenizer sends back:
``BatchStrOut`` goes to the front, control replies resolve the call that waits on
them (matched by id).
"""
from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Sequence
from typing import Any, cast

import zmq
import zmq.asyncio

from radixlang.runtime.io_struct import (
    AbortReq, BatchStrOut, SchedulerReady, TokenizedGenerateReq, decode, encode,
)
from radixlang.runtime.ipc import IpcNames, pull_socket, push_socket
from radixlang.runtime.front.request_front import (
    AsyncFront, ControlOut, ControlReq, RequestFront, RequestStream,
)

__all__ = ["RequestStream", "TokenizerManager", "ZmqTransport", "process_pids"]

logger = logging.getLogger(__name__)


class ZmqTransport:
    """The request front's transport to the scheduler processes (asyncio only: ``control`` refuses)."""

    def __init__(self, ipc: IpcNames, num_replicas: int) -> None:
        self.ipc = ipc
        self.num_replicas = num_replicas
        self._calls: dict[str, asyncio.Future] = {}
        self._send: list[zmq.Socket] = []

    def open(self) -> zmq.asyncio.Socket:
        """Connect the send sockets; the PULL socket the detokenizer sends to, for the caller to read."""
        self._ctx = zmq.Context()  # sends: PUSH with no high-water mark never blocks the loop
        self._actx = zmq.asyncio.Context()
        self._send = [push_socket(self._ctx, self.ipc.scheduler(i)) for i in range(self.num_replicas)]
        return cast(zmq.asyncio.Socket, pull_socket(self._actx, self.ipc.tokenizer_manager))

    def close(self) -> None:
        if self._send:
            self._send = []
            self._ctx.destroy(linger=0)
            self._actx.destroy(linger=0)

    def send(self, replica: int, req: TokenizedGenerateReq) -> None:
        self._send[replica].send(encode(req))

    def abort(self, replica: int, rid: str) -> None:
        self._send[replica].send(encode(AbortReq(rid=rid)))

    def control(self, msgs: list[ControlReq]) -> list[ControlOut]:
        raise RuntimeError("the server's front is asyncio: use the a* control calls")

    async def acontrol(self, msgs: list[ControlReq]) -> list[ControlOut]:
        loop = asyncio.get_running_loop()
        futures = []
        for replica, msg in enumerate(msgs):
            futures.append(self._calls.setdefault(msg.rid, loop.create_future()))
            self._send[replica].send(encode(msg))
        return list(await asyncio.gather(*futures))

    def resolve(self, reply: Any) -> None:
        fut = self._calls.pop(reply.rid, None)
        if fut is not None and not fut.done():
            fut.set_result(reply)

    def fail_calls(self, message: str) -> None:
        calls, self._calls = list(self._calls.values()), {}
        for fut in calls:
            if not fut.done():
                fut.set_exception(RuntimeError(message))


class TokenizerManager(AsyncFront):
    """What the HTTP app serves (see http_common.Front). ``start()`` inside the running event loop."""

    def __init__(self, readies: Sequence[SchedulerReady], *, tokenizer: Any, ipc: IpcNames,
                 process_pids: dict[str, Any] | None = None) -> None:
        self.transport = ZmqTransport(ipc, len(readies))
        front = RequestFront.from_reports(self.transport, readies, tokenizer=tokenizer, name="server",
                                          info_extra=process_pids)
        super().__init__(front, model_path=readies[0].model_path, tokenizer_path=readies[0].tokenizer_path)
        self.ipc = ipc
        self.num_replicas = len(readies)
        self._recv_task: asyncio.Task | None = None

    def start(self) -> None:
        self._recv = self.transport.open()
        self._recv_task = asyncio.get_running_loop().create_task(self._recv_loop())

    def close(self) -> None:
        if self._recv_task is not None:
            self._recv_task.cancel()
            self._recv_task = None
            self.transport.close()

    def is_healthy(self) -> bool:
        return super().is_healthy() and self._recv_task is not None

    def fail(self, message: str) -> None:
        """A child process died: end every waiting request and call with ``message``."""
        self.front.fail(message)
        self.transport.fail_calls(message)

    async def _recv_loop(self) -> None:
        while True:
            data = await self._recv.recv()
            try:
                msg = decode(data)
                if isinstance(msg, BatchStrOut):
                    self.front.deliver(msg)
                else:
                    self.transport.resolve(msg)
            except Exception:  # one bad message must not stop every other request
                logger.exception("could not handle a message from the detokenizer")


def process_pids(scheduler_pids: list[int], detokenizer_pid: int) -> dict[str, Any]:
    """The pids /get_server_info reports (so a test or an operator can find each process)."""
    return {"scheduler_pids": scheduler_pids, "detokenizer_pid": detokenizer_pid, "server_pid": os.getpid()}
