"""Engine: the whole runtime in-process, no HTTP.

A background thread drives each Scheduler replica step by step (one replica
unless ``dp_size`` > 1, then a Router spreads requests over them); ``generate``
may be called from many threads at once and their requests are batched together,
and ``async_generate`` serves coroutines. The calls themselves are the request
front's (front/request_front.py), the same code the server's TokenizerManager
runs; the Engine supplies the in-process transport to its replica threads.
"""
from __future__ import annotations

import asyncio
import functools
import logging
from typing import Any

from radixlang.runtime.dp.router import Router
from radixlang.runtime.errors import RequestError
from radixlang.runtime.io_struct import BatchStrOut, TokenizedGenerateReq
from radixlang.runtime.front.request_front import (
    ControlOut, ControlReq, RequestFront, RequestStream, SyncStream,
)
from radixlang.runtime.scheduler.build import build_scheduler
from radixlang.runtime.scheduler.scheduler import Scheduler
from radixlang.runtime.entrypoints.engine_thread import SchedulerThread
from radixlang.runtime.server_args import ServerArgs

logger = logging.getLogger(__name__)


class InProcessTransport:
    """The request front's transport to SchedulerThread replicas in this process."""

    def __init__(self, replicas: list[SchedulerThread]) -> None:
        self.replicas = replicas

    def send(self, replica: int, req: TokenizedGenerateReq) -> None:
        self.replicas[replica].add_request(req)

    def abort(self, replica: int, rid: str) -> None:
        self.replicas[replica].abort_request(rid)

    def control(self, msgs: list[ControlReq]) -> list[ControlOut]:
        return [r.control(m) for r, m in zip(self.replicas, msgs)]

    async def acontrol(self, msgs: list[ControlReq]) -> list[ControlOut]:
        return await asyncio.to_thread(self.control, msgs)


class Engine:
    """In-process runtime. ``Engine(model_path=None, **ServerArgs fields)``.

    With ``dp_size=N`` it runs N scheduler replicas (each its own weights, KV pool and
    radix cache, each on its own thread) and a Router picks the replica per request.
    ``engine.scheduler`` is replica 0's scheduler; ``engine.schedulers`` has them all;
    ``engine.front`` is the request front (front/request_front.py) the server runs too.
    """

    def __init__(self, **kwargs: Any) -> None:
        args = ServerArgs(**kwargs)  # a misspelled option is a TypeError
        names = ["radixlang-scheduler"] if args.dp_size == 1 else \
            [f"radixlang-scheduler-{i}" for i in range(args.dp_size)]
        if args.dp_size > 1:  # two threads importing transformers' lazy modules at once can fail (ImportError)
            from transformers import AutoTokenizer  # noqa: F401
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
        # sized from each replica's report (its KV pool), exactly as the server sizes its front
        self.front = RequestFront.from_reports(InProcessTransport(self.replicas),
                                               [r.report() for r in self.replicas], tokenizer=self.tokenizer,
                                               name="engine")

    @staticmethod
    def _make_scheduler(args: ServerArgs, index: int) -> Scheduler:
        return build_scheduler(args.for_replica(index), replica=index)

    @property
    def router(self) -> Router:
        return self.front.router

    # ---- from the replica threads ----------------------------------------------------------------------
    def _deliver(self, out: BatchStrOut) -> None:
        self.front.deliver(out)

    def _fail(self, replica: int, e: BaseException) -> None:
        """A replica crashed: the engine takes no new requests; that replica's callers get an abort."""
        self.front.fail(str(e), replica=replica, message=f"engine error: {e}")

    # ---- generation ----------------------------------------------------------------------------
    def generate(self, prompt: str | list[str] | None = None, sampling_params: dict | list[dict] | None = None,
                 input_ids: list[int] | list[list[int]] | None = None, return_logprob: bool = False,
                 logprob_start_len: int | None = None, top_logprobs_num: int = 0, stream: bool = False,
                 rid: str | None = None, lora_path: str | None = None) -> dict | list[dict] | SyncStream:
        """Generate for one prompt (a dict) or many (a list of dicts, n expanded in order); thread-safe.

        ``stream=True`` (one prompt, n=1) submits now and returns an iterator of snapshots. ``lora_path``:
        the name of a served LoRA adapter every prompt runs under (None: the base model).
        """
        opts: dict[str, Any] = {"return_logprob": return_logprob, "logprob_start_len": logprob_start_len,
                                "top_logprobs_num": top_logprobs_num, "rid": rid, "lora_path": lora_path}
        if stream:
            return self.front.stream(prompt, sampling_params, input_ids, **opts)  # type: ignore[arg-type]
        return self.front.generate(prompt, sampling_params, input_ids, **opts)

    async def async_generate(self, prompt: str | list[str] | None = None, sampling_params: dict | list | None = None,
                             **kwargs: Any) -> dict | list[dict] | RequestStream:
        """``generate`` for a coroutine (same keywords); ``stream=True`` returns an async iterator."""
        if kwargs.pop("stream", False):
            return await self.front.astream(prompt, sampling_params, **kwargs)  # type: ignore[arg-type]
        return await self.front.agenerate(prompt, sampling_params, **kwargs)

    # ---- control ------------------------------------------------------------------------------
    def abort_request(self, rid: str) -> None:
        self.front.abort_request(rid)

    def flush_cache(self) -> bool:
        return self.front.flush_cache()

    def load_lora_adapter(self, lora_name: str, lora_path: str) -> None:
        """Serve the PEFT adapter folder ``lora_path`` as ``lora_name`` on every replica (ValueError if it cannot
        be served: the message says why)."""
        out = self.front.update_lora(lora_name, lora_path)
        if not out.success:
            raise RequestError(out.message, "lora_path")

    def unload_lora_adapter(self, lora_name: str) -> None:
        """Stop serving ``lora_name``; requests already sent under it finish with it."""
        out = self.front.update_lora(lora_name, None)
        if not out.success:
            raise RequestError(out.message, "lora_name")

    def get_server_info(self) -> dict[str, Any]:
        """ServerArgs, then the replicas' state summed (counters, memory, latency histograms) and per replica."""
        return self.front.get_server_info()

    def check_memory_leak(self) -> None:
        self.front.check_memory_leak()

    def shutdown(self) -> None:
        for r in self.replicas:
            r.stop()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()
