"""TokenizerManager: the asyncio front of the server process: tokenize, send, await, stream.

It tokenizes each call in the HTTP process, picks a scheduler replica per request
(dp/router.py: cache-aware or round robin),
pushes a ``TokenizedGenerateReq`` to that replica's socket, and resolves the waiting
call or stream as ``BatchStrOut`` messages come back from the detokenizer. Control
calls (flush, server info, leak check) go to every replica on the same sockets; the
replies come back through the detokenizer and are matched by id.
"""
from __future__ import annotations

import asyncio
import logging
import os
import uuid
from typing import Any, Callable

import zmq
import zmq.asyncio

from radixlang.runtime.server_args import ServerArgs
from radixlang.runtime.managers.io_struct import (
    AbortReq, BatchStrOut, CheckMemoryLeakReq, FlushCacheReq, GetInternalStateReq, TokenizedGenerateReq, decode,
    encode,
)
from radixlang.runtime.managers.ipc import IpcNames, pull_socket, push_socket
from radixlang.runtime.dp.replica_states import merge_states
from radixlang.runtime.dp.router import Router
from radixlang.runtime.managers.request_output import RequestOutput, expand_requests, is_batched
from radixlang.runtime.errors import RequestError

logger = logging.getLogger(__name__)


class _ReqState(RequestOutput):
    def __init__(self, rid: str, *, return_logprob: bool, replica: int) -> None:
        super().__init__(rid, return_logprob=return_logprob)
        self.replica = replica
        self.events: asyncio.Queue[dict[str, Any]] = asyncio.Queue()


class RequestStream:
    """The snapshots of one streamed request; ``aclose()`` aborts it unless it finished."""

    def __init__(self, manager: TokenizerManager, state: _ReqState) -> None:
        self.manager = manager
        self.state = state
        self.rid = state.rid
        self._ended = False

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> dict[str, Any]:
        if self._ended:
            raise StopAsyncIteration
        snap = await self.state.events.get()
        self._ended = snap["meta_info"].get("finish_reason") is not None
        return snap

    async def aclose(self) -> None:
        self._ended = True
        if not self.state.done:
            self.manager.abort_request(self.rid)


class TokenizerManager:
    """What the HTTP app serves (see http_server.Front). ``start()`` inside the running event loop."""

    def __init__(self, *, server_args: ServerArgs, tokenizer: Any, model_path: str, tokenizer_path: str,
                 ipc: IpcNames, picker: Router | None = None, process_pids: dict[str, Any] | None = None
                 ) -> None:
        self.server_args = server_args
        self.tokenizer = tokenizer
        self.model_path = model_path
        self.tokenizer_path = tokenizer_path
        self.num_replicas = server_args.dp_size
        policy = server_args.load_balance_method if self.num_replicas > 1 else "round_robin"
        self.picker = picker or Router(self.num_replicas, policy=policy)
        self.process_pids = process_pids or {}
        self.ipc = ipc
        self.error: str | None = None  # set once a child process died: every call fails from then on
        self.draining = False  # set on SIGTERM: the app answers new requests with 503
        self._states: dict[str, _ReqState] = {}
        self._calls: dict[str, asyncio.Future] = {}
        self._recv_task: asyncio.Task | None = None

    def start(self) -> None:
        self._ctx = zmq.Context()  # sends: PUSH with no high-water mark never blocks the loop
        self._actx = zmq.asyncio.Context()
        self._send = [push_socket(self._ctx, self.ipc.scheduler(i)) for i in range(self.num_replicas)]
        self._recv = pull_socket(self._actx, self.ipc.tokenizer_manager)
        self._recv_task = asyncio.get_running_loop().create_task(self._recv_loop())

    def close(self) -> None:
        if self._recv_task is not None:
            self._recv_task.cancel()
            self._recv_task = None
            self._ctx.destroy(linger=0)
            self._actx.destroy(linger=0)

    # ---- health -------------------------------------------------------------------------------
    def is_healthy(self) -> bool:
        return self.error is None and not self.draining and self._recv_task is not None

    @property
    def num_pending(self) -> int:
        return len(self._states)

    def fail(self, message: str) -> None:
        """A child process died: end every waiting request and call with ``message``."""
        self.error = message
        states, self._states = list(self._states.values()), {}
        for st in states:
            st.fail(message)
            st.events.put_nowait(st.snapshot())
        calls, self._calls = list(self._calls.values()), {}
        for fut in calls:
            if not fut.done():
                fut.set_exception(RuntimeError(message))

    # ---- generation ---------------------------------------------------------------------------
    async def generate(self, prompt: str | list[str] | None = None, sampling_params: dict | list[dict] | None = None,
                       input_ids: list[int] | list[list[int]] | None = None, return_logprob: bool = False,
                       logprob_start_len: int | None = None, top_logprobs_num: int = 0,
                       rid: str | None = None) -> dict | list[dict]:
        """One prompt (a dict) or many (a list of dicts, n expanded in order); like Engine.generate."""
        items = expand_requests(self.tokenizer, prompt, sampling_params, input_ids)
        states: list[_ReqState] = []
        try:
            for ids, text, params in items:
                states.append(self._submit(ids, text, params, return_logprob=return_logprob,
                                           logprob_start_len=logprob_start_len, top_logprobs_num=top_logprobs_num,
                                           stream=False, rid=rid if len(items) == 1 else None))
            results = [await self._wait(st) for st in states]
        finally:  # refused midway, or the caller went away (cancelled): free what is left running
            for st in states:
                if not st.done:
                    self.abort_request(st.rid)
        return results if is_batched(prompt, input_ids, len(items)) else results[0]

    async def stream(self, prompt: str | None = None, sampling_params: dict | None = None,
                     input_ids: list[int] | None = None, return_logprob: bool = False,
                     logprob_start_len: int | None = None, top_logprobs_num: int = 0,
                     rid: str | None = None) -> RequestStream:
        """Submit one request now (errors raise here) and return the iterator of its snapshots."""
        items = expand_requests(self.tokenizer, prompt, sampling_params, input_ids)
        if len(items) != 1:
            raise RequestError("stream=True takes a single prompt with n=1", "stream")
        ids, text, params = items[0]
        st = self._submit(ids, text, params, return_logprob=return_logprob, logprob_start_len=logprob_start_len,
                          top_logprobs_num=top_logprobs_num, stream=True, rid=rid)
        return RequestStream(self, st)

    def _submit(self, input_ids: list[int], text: str | None, params: dict[str, Any], *, return_logprob: bool,
                logprob_start_len: int | None, top_logprobs_num: int, stream: bool, rid: str | None) -> _ReqState:
        if self.error is not None:
            raise RuntimeError(f"the server has failed: {self.error}")
        rid = rid or uuid.uuid4().hex
        if rid in self._states:
            raise RequestError(f"duplicate request id {rid!r}", "rid")
        replica = self.picker.select(input_ids)
        st = _ReqState(rid, return_logprob=return_logprob, replica=replica)
        self._states[rid] = st
        self._send[replica].send(encode(TokenizedGenerateReq(
            rid=rid, input_ids=input_ids, sampling_params=params, input_text=text, return_logprob=return_logprob,
            logprob_start_len=-1 if logprob_start_len is None else logprob_start_len,
            top_logprobs_num=top_logprobs_num, stream=stream)))
        return st

    async def _wait(self, st: _ReqState) -> dict:
        while True:
            snap = await st.events.get()
            if snap["meta_info"].get("finish_reason") is not None:
                return snap

    def abort_request(self, rid: str) -> None:
        """Abort a running or waiting request; an unknown rid is ignored (it may have just finished)."""
        if self.error is not None:
            return
        st = self._states.get(rid)
        for replica in [st.replica] if st is not None else range(self.num_replicas):
            self._send[replica].send(encode(AbortReq(rid=rid)))

    def abort_all(self) -> None:
        for rid in list(self._states):
            self.abort_request(rid)

    # ---- control ------------------------------------------------------------------------------
    async def flush_cache(self) -> bool:
        outs = await self._control(lambda cid: FlushCacheReq(rid=cid))
        for i, o in enumerate(outs):
            if o.success:
                self.picker.flush(i)  # the replica's tree is empty again: so is its approximate copy
        refused = [o.message for o in outs if not o.success]
        if refused:
            logger.warning("flush_cache refused: %s", "; ".join(refused))
        return not refused

    async def get_server_info(self) -> dict[str, Any]:
        outs = await self._control(lambda cid: GetInternalStateReq(rid=cid))
        state = merge_states([o.state for o in outs])
        from radixlang import __version__
        return {**self.server_args.to_dict(), **state, "version": __version__, **self.process_pids,
                "num_requests_per_replica": [o.state["num_requests"] for o in outs], "router": self.picker.stats()}

    async def check_memory_leak(self) -> None:
        outs = await self._control(lambda cid: CheckMemoryLeakReq(rid=cid))
        leaks = [f"replica {i}: {o.message}" for i, o in enumerate(outs) if not o.ok]
        if leaks:
            raise AssertionError("; ".join(leaks))

    async def _control(self, make: Callable[[str], Any]) -> list[Any]:
        """Send one control message to every replica; their replies, in replica order."""
        if self.error is not None:
            raise RuntimeError(f"the server has failed: {self.error}")
        loop = asyncio.get_running_loop()
        futures = []
        for replica in range(self.num_replicas):
            cid = uuid.uuid4().hex
            futures.append(self._calls.setdefault(cid, loop.create_future()))
            self._send[replica].send(encode(make(cid)))
        return list(await asyncio.gather(*futures))

    # ---- outputs from the detokenizer ---------------------------------------------------------
    async def _recv_loop(self) -> None:
        while True:
            data = await self._recv.recv()
            try:
                self._handle(decode(data))
            except Exception:  # one bad message must not stop every other request
                logger.exception("could not handle a message from the detokenizer")

    def _handle(self, msg: Any) -> None:
        if isinstance(msg, BatchStrOut):
            for i, rid in enumerate(msg.rids):
                st = self._states.get(rid)
                if st is None:
                    continue  # already failed or unknown
                st.update(msg, i)
                st.events.put_nowait(st.snapshot())
                if st.done:
                    del self._states[rid]
                    self.picker.finished(st.replica)
            return
        fut = self._calls.pop(msg.rid, None)
        if fut is not None and not fut.done():
            fut.set_result(msg)


def process_pids(scheduler_pids: list[int], detokenizer_pid: int) -> dict[str, Any]:
    """The pids /get_server_info reports (so a test or an operator can find each process)."""
    return {"scheduler_pids": scheduler_pids, "detokenizer_pid": detokenizer_pid, "server_pid": os.getpid()}
