"""Engine: the whole runtime in-process, no HTTP.

A background thread drives each Scheduler replica step by step (one replica
unless ``dp_size`` > 1, then a Router spreads requests over them); ``generate``
may be called from many threads at once and their requests are batched together.
"""
from __future__ import annotations

import asyncio
import functools
import logging
import queue
import threading
import uuid
from typing import Any, AsyncIterator, Iterator

from radixlang.runtime.server_args import ServerArgs
from radixlang.runtime.managers.io_struct import BatchStrOut, TokenizedGenerateReq
from radixlang.runtime.managers.scheduler_thread import SchedulerThread
from radixlang.runtime.dp.replica_states import merge_states
from radixlang.runtime.managers.request_output import RequestOutput, expand_requests, is_batched
from radixlang.runtime.dp.router import Router
from radixlang.runtime.managers.scheduler import Scheduler
from radixlang.runtime.errors import RequestError

logger = logging.getLogger(__name__)


class _Pending(RequestOutput):
    """One request's accumulated output; `events` receives a copy after every update."""

    def __init__(self, rid: str, stream: bool) -> None:
        super().__init__(rid)
        self.stream = stream
        self.events: queue.Queue = queue.Queue()
        self.replica = 0

    def update(self, out: BatchStrOut, i: int) -> None:
        super().update(out, i)
        self.events.put(self.snapshot())


class Engine:
    """In-process runtime. ``Engine(model_path=None, **ServerArgs fields)``.

    With ``dp_size=N`` it runs N scheduler replicas (each its own weights, KV pool and
    radix cache, each on its own thread) and a Router picks the replica per request.
    ``engine.scheduler`` is replica 0's scheduler; ``engine.schedulers`` has them all.
    """

    def __init__(self, **kwargs: Any) -> None:
        args = ServerArgs(**kwargs)  # a misspelled option is a TypeError
        self._pending: dict[str, _Pending] = {}
        self._lock = threading.Lock()
        self._error: BaseException | None = None
        names = ["radixlang-scheduler"] if args.dp_size == 1 else \
            [f"radixlang-scheduler-{i}" for i in range(args.dp_size)]
        # each replica's thread loads its own model (replicas load side by side) and then runs it
        self.replicas = [SchedulerThread(functools.partial(self._make_scheduler, args, i), index=i, name=names[i],
                                         deliver=self._deliver, on_error=self._fail)
                         for i in range(args.dp_size)]
        for r in self.replicas:
            r.start()
        try:
            self.schedulers = [r.wait_built() for r in self.replicas]
        except BaseException:
            for r in self.replicas:
                r.stop()
            raise
        self.scheduler = self.schedulers[0]
        self.server_args = self.scheduler.args
        self.tokenizer = self.scheduler.tokenizer
        policy = self.server_args.load_balance_method if args.dp_size > 1 else "round_robin"
        self.router = Router(args.dp_size, policy=policy, max_tree_tokens=self.scheduler.kv_pool.size)

    @staticmethod
    def _make_scheduler(args: ServerArgs, index: int) -> Scheduler:
        sched = Scheduler(args)  # same random_seed: same weights on every replica
        if index:
            sched.generator.manual_seed(sched.args.random_seed + index)  # but not the same unseeded samples
        return sched

    @property
    def _thread(self) -> threading.Thread:
        return self.replicas[0].thread

    # ---- outputs from the replica threads ------------------------------------------------------
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
                self.router.finished(p.replica)

    def _fail(self, replica: int, e: BaseException) -> None:
        """A replica crashed: the engine takes no new requests; that replica's callers get an abort."""
        self._error = e
        with self._lock:
            pending = [p for p in self._pending.values() if p.replica == replica]
            for p in pending:
                del self._pending[p.rid]
        for p in pending:
            p.fail(f"engine error: {e}")
            p.events.put(p.snapshot())
            self.router.finished(replica)

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
                raise RequestError(f"duplicate request id {rid!r}", "rid")
            p.replica = self.router.select(input_ids)
            self._pending[rid] = p
        sched = self.schedulers[p.replica]
        req = TokenizedGenerateReq(rid=rid, input_ids=input_ids, sampling_params=params, input_text=text,
                                   return_logprob=return_logprob,
                                   logprob_start_len=-1 if logprob_start_len is None else logprob_start_len,
                                   top_logprobs_num=top_logprobs_num, stream=stream)

        def add():
            sched.add_request(req)
            return sched.outputs.flush(self.tokenizer)  # immediate errors
        self.replicas[p.replica].post(add)
        return p

    def generate(self, prompt: str | list[str] | None = None, sampling_params: dict | list[dict] | None = None,
                 input_ids: list[int] | list[list[int]] | None = None, return_logprob: bool = False,
                 logprob_start_len: int | None = None, top_logprobs_num: int = 0, stream: bool = False,
                 rid: str | None = None) -> dict | list[dict] | Iterator[dict]:
        """Generate for one prompt (a dict) or many (a list of dicts, n expanded in order)."""
        items = expand_requests(self.tokenizer, prompt, sampling_params, input_ids)
        batched = is_batched(prompt, input_ids, len(items))
        if stream:
            if len(items) != 1:
                raise RequestError("stream=True takes a single prompt with n=1", "stream")
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
        with self._lock:
            p = self._pending.get(rid)
        if p is not None:  # else it has finished already (or never was)
            self.replicas[p.replica].call(lambda: self.schedulers[p.replica].abort_request(rid))

    def flush_cache(self) -> bool:
        outs = [r.call(r.scheduler.flush_cache) for r in self.replicas]
        for i, out in enumerate(outs):
            if out.success:
                self.router.flush(i)
            else:
                logger.warning("flush_cache refused on replica %d: %s", i, out.message)
        return all(out.success for out in outs)

    def get_server_info(self) -> dict[str, Any]:
        """ServerArgs, then the replicas' state summed (counters, memory, latency histograms) and per replica."""
        states = [r.call(r.scheduler.get_internal_state) for r in self.replicas]
        total = merge_states(states)
        return {**self.server_args.to_dict(), **total, "replicas": states, "router": self.router.stats(),
                "version": _version()}

    def check_memory_leak(self) -> None:
        for r in self.replicas:
            r.call(r.scheduler.check_memory_leak)

    def shutdown(self) -> None:
        for r in self.replicas:
            r.stop()

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
