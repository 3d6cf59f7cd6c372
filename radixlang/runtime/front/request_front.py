"""The request front: what a caller of the runtime talks to, written once for every transport.

``RequestFront`` owns the pending map (rid -> ``Pending``), the expansion of a call into
requests (``request_output.expand_requests``), submit -> wait / stream, the Router's
bookkeeping (``select`` on submit, ``finished`` when a request ends or fails, ``flush``
when a replica's cache was flushed) and the control fan-out (flush_cache,
get_server_info, check_memory_leak, abort). It holds no thread and no event loop and
never blocks on its own:

* a ``Transport`` moves the messages: the Engine's in-process one posts them to its
  SchedulerThread replicas, the server's TokenizerManager sends them over ZMQ to the
  scheduler processes. Both deliver the detokenized ``BatchStrOut`` back to
  ``RequestFront.deliver`` (from any thread).
* each request's snapshots go to its own ``Sink``: a ``ThreadSink`` (a queue.Queue)
  for the thread-safe sync API, a ``LoopSink`` (an asyncio.Queue fed thread-safely)
  for asyncio callers. So ``generate`` / ``stream`` and ``agenerate`` / ``astream``
  are the same code but for how the caller waits.

The Router is sized from what each replica reported when it was ready (its
``SchedulerReady``: ``kv_pool_size``), by ``RequestFront.from_reports``, the one
constructor both transports use; so dp routing under memory pressure is the same in
the Engine and in the server.

``AsyncFront`` is the HTTP app's ``Front`` (entrypoints/http_common.py) over a
RequestFront: the TokenizerManager is one, and so is the Engine's EngineFront.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
import uuid
from collections.abc import Callable, Sequence
from typing import Any, Protocol, TypeVar

from radixlang.runtime.dp.replica_states import merge_states
from radixlang.runtime.dp.router import Router
from radixlang.runtime.errors import RequestError
from radixlang.runtime.io_struct import (
    BatchStrOut, CheckMemoryLeakOut, CheckMemoryLeakReq, FlushCacheOut, FlushCacheReq, GetInternalStateOut,
    GetInternalStateReq, LoRAUpdateOut, LoRAUpdateReq, SchedulerReady, TokenizedGenerateReq, check_embedding_match,
    check_lora_name,
)
from radixlang.runtime.generation_config import sampling_defaults
from radixlang.runtime.front.request_output import Item, RequestOutput, expand_requests, is_batched
from radixlang.runtime.sampling.sampling_params import SamplingParams
from radixlang.runtime.server_args import ServerArgs

logger = logging.getLogger(__name__)

ControlReq = FlushCacheReq | GetInternalStateReq | CheckMemoryLeakReq | LoRAUpdateReq
ControlOut = FlushCacheOut | GetInternalStateOut | CheckMemoryLeakOut | LoRAUpdateOut
_T = TypeVar("_T")


def _expect(kind: type[_T], value: object, what: str) -> _T:
    """``value`` as a ``kind``: a sink or a reply of another kind is a bug of the front or its transport."""
    if not isinstance(value, kind):
        raise TypeError(f"{what}: expected a {kind.__name__}, got {type(value).__name__}")
    return value


# ---- sinks: how one request's snapshots reach whoever waits on it ------------------------------
class Sink(Protocol):
    def put(self, snap: dict[str, Any]) -> None:
        """Hand over one snapshot; called from whatever thread delivers the output. Never blocks."""


class ThreadSink:
    """For a caller that blocks a thread on ``get()``."""

    def __init__(self) -> None:
        self._queue: queue.Queue[dict[str, Any]] = queue.Queue()

    def put(self, snap: dict[str, Any]) -> None:
        self._queue.put(snap)

    def get(self) -> dict[str, Any]:
        return self._queue.get()


class LoopSink:
    """For a coroutine that awaits ``get()`` on ``loop``; ``put`` may come from any thread."""

    def __init__(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        self._loop = loop or asyncio.get_running_loop()
        self._queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue()

    def put(self, snap: dict[str, Any]) -> None:
        try:
            on_loop = asyncio.get_running_loop() is self._loop
        except RuntimeError:  # no loop runs in this thread
            on_loop = False
        if on_loop:
            self._queue.put_nowait(snap)
            return
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, snap)
        except RuntimeError:  # the loop is closed: nobody waits for this request any more
            pass

    async def get(self) -> dict[str, Any]:
        return await self._queue.get()


class Pending(RequestOutput):
    """One request in flight: its accumulated output, the replica serving it, and its sink."""

    def __init__(self, rid: str, *, return_logprob: bool, replica: int, sink: Sink) -> None:
        super().__init__(rid, return_logprob=return_logprob)
        self.replica = replica
        self.sink = sink

    def publish(self) -> None:
        self.sink.put(self.snapshot())


def _finished(snap: dict[str, Any]) -> bool:
    return snap["meta_info"].get("finish_reason") is not None


# ---- transports ------------------------------------------------------------------------------------
class Transport(Protocol):
    """Moves requests and control messages to the replicas; outputs come back via ``RequestFront.deliver``."""

    def send(self, replica: int, req: TokenizedGenerateReq) -> None:
        """Queue ``req`` on ``replica``; returns at once."""

    def abort(self, replica: int, rid: str) -> None:
        """Ask ``replica`` to abort ``rid``; returns at once."""

    def control(self, msgs: list[ControlReq]) -> list[ControlOut]:
        """Send ``msgs[i]`` to replica i and wait, blocking this thread; the replies in replica order."""

    async def acontrol(self, msgs: list[ControlReq]) -> list[ControlOut]:
        """``control`` for a coroutine."""


# ---- streams ---------------------------------------------------------------------------------------
class RequestStream:
    """The snapshots of one streamed request, for ``async for``; ``aclose()`` aborts it unless it finished."""

    def __init__(self, front: RequestFront, pending: Pending) -> None:
        self.front = front
        self.state = pending
        self.rid = pending.rid
        self._ended = False

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> dict[str, Any]:
        if self._ended:
            raise StopAsyncIteration
        sink = _expect(LoopSink, self.state.sink, f"the sink of async stream {self.rid}")
        snap = await sink.get()
        self._ended = _finished(snap)
        return snap

    async def aclose(self) -> None:
        self._ended = True
        if not self.state.done:
            self.front.abort_request(self.rid)


class SyncStream:
    """The snapshots of one streamed request, for ``for``; ``close()`` aborts it unless it finished."""

    def __init__(self, front: RequestFront, pending: Pending) -> None:
        self.front = front
        self.state = pending
        self.rid = pending.rid
        self._ended = False

    def __iter__(self) -> SyncStream:
        return self

    def __next__(self) -> dict[str, Any]:
        if self._ended:
            raise StopIteration
        sink = _expect(ThreadSink, self.state.sink, f"the sink of stream {self.rid}")
        snap = sink.get()
        self._ended = _finished(snap)
        return snap

    def close(self) -> None:
        self._ended = True
        if not self.state.done:
            self.front.abort_request(self.rid)


# ---- the front -------------------------------------------------------------------------------------
class RequestFront:
    """Pending requests, routing and control over one ``Transport`` (see the module docstring).

    ``name`` ("engine" or "server") words the errors: once ``fail`` was called, every new
    request or control call raises ``RuntimeError("the <name> has failed: ...")``.
    """

    def __init__(self, transport: Transport, *, tokenizer: Any, server_args: ServerArgs, router: Router,
                 name: str = "server", info_extra: dict[str, Any] | None = None,
                 sampling_defaults: dict[str, Any] | None = None,
                 lora_adapters: dict[str, str] | None = None) -> None:
        self.transport = transport
        self.tokenizer = tokenizer
        self.server_args = server_args
        # what a request's unset sampling fields take (runtime/generation_config.py)
        self.sampling_defaults = dict(sampling_defaults or {})
        self.router = router
        self.num_replicas = router.num_replicas
        self.name = name
        self.info_extra = dict(info_extra or {})
        self.error: str | None = None
        # the LoRA adapters every replica serves: name -> folder (updated by load_lora / unload_lora)
        self.lora_adapters = dict(lora_adapters or {})
        self._pending: dict[str, Pending] = {}
        self._lock = threading.Lock()

    @classmethod
    def from_reports(cls, transport: Transport, readies: Sequence[SchedulerReady], *, tokenizer: Any,
                     name: str = "server", info_extra: dict[str, Any] | None = None) -> RequestFront:
        """The front over the replicas that sent ``readies`` (in replica order): each router tree holds at
        most as many ids as that replica's KV pool has slots."""
        if not readies:
            raise ValueError("a request front needs at least one replica")
        args = ServerArgs(**readies[0].server_args)
        policy = args.load_balance_method if len(readies) > 1 else "round_robin"
        router = Router(len(readies), policy=policy, max_tree_tokens=[r.kv_pool_size for r in readies])
        return cls(transport, tokenizer=tokenizer, server_args=args, router=router, name=name,
                   info_extra=info_extra,
                   sampling_defaults=sampling_defaults(args.generation_config, readies[0].model_dir),
                   lora_adapters=readies[0].lora_adapters)

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    # ---- submitting ----------------------------------------------------------------------------------
    def expand(self, prompt: str | list[str] | None, sampling_params: dict | list[dict] | None,
               input_ids: list[int] | list[list[int]] | None) -> list[Item]:
        return expand_requests(self.tokenizer, prompt, sampling_params, input_ids, self.sampling_defaults)

    def submit(self, input_ids: list[int], text: str | None, params: SamplingParams, *, sink: Sink,
               return_logprob: bool = False, logprob_start_len: int | None = None, top_logprobs_num: int = 0,
               stream: bool = False, rid: str | None = None, embedding: bool = False,
               embedding_dimensions: int | None = None, lora_path: str | None = None) -> Pending:
        """Route one expanded request, register it and send it; its snapshots go to ``sink``.

        ``embedding``: return the prompt's pooled embedding (snapshot key "embedding") instead of
        generating; only an embedding server (--is-embedding) takes it, and takes nothing else."""
        rid = rid or uuid.uuid4().hex
        check_embedding_match(embedding=embedding, is_embedding=self.server_args.is_embedding,
                              model=self.server_args.served_model_name)
        self.check_lora(lora_path)
        with self._lock:
            if self.error is not None:
                raise RuntimeError(f"the {self.name} has failed: {self.error}")
            if rid in self._pending:
                raise RequestError(f"duplicate request id {rid!r}", "rid")
            replica = self.router.select(input_ids)
            p = Pending(rid, return_logprob=return_logprob, replica=replica, sink=sink)
            self._pending[rid] = p
        req = TokenizedGenerateReq(rid=rid, input_ids=input_ids, sampling_params=params, input_text=text,
                                   return_logprob=return_logprob,
                                   logprob_start_len=-1 if logprob_start_len is None else logprob_start_len,
                                   top_logprobs_num=top_logprobs_num, stream=stream, embedding=embedding,
                                   embedding_dimensions=embedding_dimensions, lora_name=lora_path)
        try:
            self.transport.send(replica, req)
        except BaseException:
            self._forget(p)
            raise
        return p

    def _submit_all(self, items: list[Item], make_sink: Callable[[], Sink], opts: dict[str, Any],
                    rid: str | None) -> list[Pending]:
        pendings: list[Pending] = []
        try:
            for ids, text, params in items:
                pendings.append(self.submit(ids, text, params, sink=make_sink(), stream=False,
                                            rid=rid if len(items) == 1 else None, **opts))
        except BaseException:  # refused midway: free what was sent
            self._abort_unfinished(pendings)
            raise
        return pendings

    def _abort_unfinished(self, pendings: list[Pending]) -> None:
        for p in pendings:
            if not p.done:
                self.abort_request(p.rid)

    def _one(self, items: list[Item]) -> Item:
        if len(items) != 1:
            raise RequestError("stream=True takes a single prompt with n=1", "stream")
        return items[0]

    # ---- the sync API (any thread) -------------------------------------------------------------------
    def generate(self, prompt: str | list[str] | None = None, sampling_params: dict | list[dict] | None = None,
                 input_ids: list[int] | list[list[int]] | None = None, *, rid: str | None = None,
                 **opts: Any) -> dict | list[dict]:
        """One prompt (a dict) or many (a list of dicts, n expanded in order); blocks until all finished."""
        items = self.expand(prompt, sampling_params, input_ids)
        pendings = self._submit_all(items, ThreadSink, opts, rid)
        try:
            results = [self._wait(p) for p in pendings]
        finally:  # the caller went away (KeyboardInterrupt): free what is left running
            self._abort_unfinished(pendings)
        return results if is_batched(prompt, input_ids, len(items)) else results[0]

    def stream(self, prompt: str | None = None, sampling_params: dict | None = None,
               input_ids: list[int] | None = None, *, rid: str | None = None, **opts: Any) -> SyncStream:
        """Submit one request now (errors raise here) and return the iterator of its snapshots."""
        ids, text, params = self._one(self.expand(prompt, sampling_params, input_ids))
        return SyncStream(self, self.submit(ids, text, params, sink=ThreadSink(), stream=True, rid=rid, **opts))

    @staticmethod
    def _wait(p: Pending) -> dict[str, Any]:
        sink = _expect(ThreadSink, p.sink, f"the sink of request {p.rid}")
        while True:
            snap = sink.get()
            if _finished(snap):
                return snap

    # ---- the asyncio API (in a running loop) ---------------------------------------------------------
    async def agenerate(self, prompt: str | list[str] | None = None,
                        sampling_params: dict | list[dict] | None = None,
                        input_ids: list[int] | list[list[int]] | None = None, *, rid: str | None = None,
                        **opts: Any) -> dict | list[dict]:
        """``generate`` for a coroutine; cancelling it aborts what is still running."""
        items = self.expand(prompt, sampling_params, input_ids)
        loop = asyncio.get_running_loop()
        pendings = self._submit_all(items, lambda: LoopSink(loop), opts, rid)
        try:
            results = [await self._await(p) for p in pendings]
        finally:
            self._abort_unfinished(pendings)
        return results if is_batched(prompt, input_ids, len(items)) else results[0]

    async def astream(self, prompt: str | None = None, sampling_params: dict | None = None,
                      input_ids: list[int] | None = None, *, rid: str | None = None, **opts: Any) -> RequestStream:
        """``stream`` for a coroutine: submit now, ``async for`` the snapshots."""
        ids, text, params = self._one(self.expand(prompt, sampling_params, input_ids))
        p = self.submit(ids, text, params, sink=LoopSink(), stream=True, rid=rid, **opts)
        return RequestStream(self, p)

    @staticmethod
    async def _await(p: Pending) -> dict[str, Any]:
        sink = _expect(LoopSink, p.sink, f"the sink of async request {p.rid}")
        while True:
            snap = await sink.get()
            if _finished(snap):
                return snap

    # ---- outputs and faults (from the transport, any thread) -----------------------------------------
    def deliver(self, out: BatchStrOut) -> None:
        """Apply one detokenized output batch: update each request, publish its snapshot, end finished ones."""
        for row in out.rows:
            with self._lock:
                p = self._pending.get(row.rid)
                if p is None:
                    continue  # already failed, or not ours
                p.update(row)
                ended = p.done and self._pending.pop(row.rid, None) is p
            if ended:  # before the caller can see the end: it may read the router's loads next
                self.router.finished(p.replica)
            p.publish()

    def fail(self, error: str, *, replica: int | None = None, message: str | None = None) -> None:
        """Replica ``replica`` (None: the whole backend) is gone: refuse new work from now on and end its
        requests with an abort carrying ``message`` (default: ``error``)."""
        with self._lock:
            self.error = error
            gone = [p for p in self._pending.values() if replica is None or p.replica == replica]
            for p in gone:
                del self._pending[p.rid]
        for p in gone:
            p.fail(message or error)
            self.router.finished(p.replica)
            p.publish()

    def _forget(self, p: Pending) -> None:
        with self._lock:
            ended = self._pending.pop(p.rid, None) is p
        if ended:
            self.router.finished(p.replica)

    def abort_request(self, rid: str) -> None:
        """Abort a running or waiting request; an unknown rid is ignored (it may have just finished)."""
        with self._lock:
            p = self._pending.get(rid)
        if p is not None:
            self.transport.abort(p.replica, rid)

    def abort_all(self) -> None:
        with self._lock:
            rids = list(self._pending)
        for rid in rids:
            self.abort_request(rid)

    def check_lora(self, name: str | None) -> None:
        """A RequestError naming ``lora_path`` unless ``name`` is None or a served LoRA adapter."""
        if name is None:
            return
        if not isinstance(name, str):
            raise RequestError(f"lora_path must be the name of a loaded LoRA adapter, got {name!r}", "lora_path")
        check_lora_name(name, enabled=self.server_args.enable_lora, served=self.lora_adapters)

    # ---- control fan-out -------------------------------------------------------------------------------
    def _messages(self, make: Callable[[str], ControlReq]) -> list[ControlReq]:
        if self.error is not None:
            raise RuntimeError(f"the {self.name} has failed: {self.error}")
        return [make(uuid.uuid4().hex) for _ in range(self.num_replicas)]

    def _flushed(self, outs: list[ControlOut]) -> bool:
        refused = []
        for i, reply in enumerate(outs):
            out = _expect(FlushCacheOut, reply, f"replica {i}'s flush_cache reply")
            if out.success:
                self.router.flush(i)  # the replica's tree is empty again: so is its approximate copy
            else:
                refused.append(f"replica {i}: {out.message}")
        if refused:
            logger.warning("flush_cache refused: %s", "; ".join(refused))
        return not refused

    def _info(self, outs: list[ControlOut]) -> dict[str, Any]:
        states = [_expect(GetInternalStateOut, out, f"replica {i}'s get_internal_state reply").state
                  for i, out in enumerate(outs)]
        from radixlang import __version__
        return {**self.server_args.to_public_dict(), **merge_states(states), "replicas": states,
                "num_requests_per_replica": [s["num_requests"] for s in states], "router": self.router.stats(),
                "version": __version__, **self.info_extra}

    @staticmethod
    def _leaks(outs: list[ControlOut]) -> None:
        leaks = []
        for i, reply in enumerate(outs):
            out = _expect(CheckMemoryLeakOut, reply, f"replica {i}'s check_memory_leak reply")
            if not out.ok:
                leaks.append(f"replica {i}: {out.message}")
        if leaks:
            raise RuntimeError("; ".join(leaks))

    def _lora_updated(self, name: str, path: str | None, outs: list[ControlOut]) -> LoRAUpdateOut:
        """Every replica's reply to one load / unload: the first refusal, else the (shared) success."""
        replies = [_expect(LoRAUpdateOut, out, f"replica {i}'s LoRA update reply") for i, out in enumerate(outs)]
        failed = [r for r in replies if not r.success]
        if failed and len(failed) < len(replies):  # replicas disagree: put them back in step
            logger.error("LoRA update of %r failed on %d of %d replicas: %s", name, len(failed), len(replies),
                         failed[0].message)
        if not failed:
            if path is None:
                self.lora_adapters.pop(name, None)
            else:
                self.lora_adapters[name] = path
        return failed[0] if failed else replies[0]

    def _lora_messages(self, name: str, path: str | None) -> list[ControlReq]:
        if not self.server_args.enable_lora:
            raise RequestError("LoRA adapters are not enabled on this server: start it with --enable-lora or "
                               "--lora-paths", "lora_name")
        return self._messages(lambda cid: LoRAUpdateReq(name=name, path=path, rid=cid))

    def update_lora(self, name: str, path: str | None) -> LoRAUpdateOut:
        """Load (``path`` given) or unload a LoRA adapter on every replica."""
        return self._lora_updated(name, path, self.transport.control(self._lora_messages(name, path)))

    async def aupdate_lora(self, name: str, path: str | None) -> LoRAUpdateOut:
        return self._lora_updated(name, path, await self.transport.acontrol(self._lora_messages(name, path)))

    def flush_cache(self) -> bool:
        """Flush every replica's radix cache (and the router's copy of it); False if one refused (busy)."""
        return self._flushed(self.transport.control(self._messages(lambda cid: FlushCacheReq(rid=cid))))

    def get_server_info(self) -> dict[str, Any]:
        """ServerArgs, the replicas' state summed (counters, memory, latency histograms) and per replica."""
        return self._info(self.transport.control(self._messages(lambda cid: GetInternalStateReq(rid=cid))))

    def check_memory_leak(self) -> None:
        """Raise RuntimeError naming each replica whose KV slots do not add up."""
        self._leaks(self.transport.control(self._messages(lambda cid: CheckMemoryLeakReq(rid=cid))))

    async def aflush_cache(self) -> bool:
        return self._flushed(await self.transport.acontrol(self._messages(lambda cid: FlushCacheReq(rid=cid))))

    async def aget_server_info(self) -> dict[str, Any]:
        return self._info(await self.transport.acontrol(self._messages(lambda cid: GetInternalStateReq(rid=cid))))

    async def acheck_memory_leak(self) -> None:
        self._leaks(await self.transport.acontrol(self._messages(lambda cid: CheckMemoryLeakReq(rid=cid))))


class AsyncFront:
    """The HTTP app's ``Front`` over a RequestFront (the server's TokenizerManager, the Engine's EngineFront)."""

    def __init__(self, front: RequestFront, *, model_path: str, tokenizer_path: str) -> None:
        self.front = front
        self.server_args = front.server_args
        self.tokenizer = front.tokenizer
        self.model_path = model_path
        self.tokenizer_path = tokenizer_path
        self.sampling_defaults = front.sampling_defaults
        self.draining = False  # set on SIGTERM: the app answers new requests with 503

    @property
    def router(self) -> Router:
        return self.front.router

    @property
    def error(self) -> str | None:
        return self.front.error

    @property
    def num_pending(self) -> int:
        return self.front.num_pending

    def is_healthy(self) -> bool:
        return self.front.error is None and not self.draining

    def fail(self, message: str) -> None:
        self.front.fail(message)

    async def generate(self, **kwargs: Any) -> dict | list[dict]:
        return await self.front.agenerate(**kwargs)

    async def stream(self, **kwargs: Any) -> RequestStream:
        return await self.front.astream(**kwargs)

    def abort_request(self, rid: str) -> None:
        self.front.abort_request(rid)

    def abort_all(self) -> None:
        self.front.abort_all()

    async def flush_cache(self) -> bool:
        return await self.front.aflush_cache()

    @property
    def lora_adapters(self) -> dict[str, str]:
        return self.front.lora_adapters

    async def update_lora(self, name: str, path: str | None) -> tuple[bool, str]:
        out = await self.front.aupdate_lora(name, path)
        return out.success, out.message

    async def get_server_info(self) -> dict[str, Any]:
        return await self.front.aget_server_info()

    async def check_memory_leak(self) -> None:
        await self.front.acheck_memory_leak()
