"""Start the server's processes, serve HTTP until told to stop, and stop them again.

Three kinds of process: this one (the FastAPI app and the TokenizerManager), one
scheduler process per data-parallel replica, and one detokenizer process. They talk
over ZMQ ``ipc://`` sockets in a private folder (mode 0700) removed at exit.

Faults: a child that exits makes /health answer 503 and the server exit non-zero at
once. SIGTERM (or Ctrl-C) drains: new requests get 503, running ones may finish for
``graceful_shutdown_timeout`` seconds and are then aborted, and the server exits 0.
"""
from __future__ import annotations

import asyncio
import logging
import multiprocessing
import signal
import time
from multiprocessing.connection import Connection, wait
from typing import Any

import orjson
import uvicorn

from radixlang.runtime.server_args import ServerArgs
from radixlang.runtime.io_struct import SchedulerReady, decode
from radixlang.runtime.ipc import IpcNames, make_private_dir, remove_private_dir

logger = logging.getLogger(__name__)
_WATCH_INTERVAL_S = 0.2


class ServerProcesses:
    """The scheduler replicas and the detokenizer, started with the spawn method."""

    def __init__(self, args: ServerArgs, ipc: IpcNames) -> None:
        from radixlang.runtime.front.detokenizer_process import run_detokenizer_process
        from radixlang.runtime.scheduler.process import run_scheduler_process

        ctx = multiprocessing.get_context("spawn")
        self.schedulers: list[multiprocessing.Process] = []
        self._ready: list[Connection] = []
        for replica in range(args.dp_size):
            recv, send = ctx.Pipe(duplex=False)
            args_json = orjson.dumps(args.for_replica(replica).to_dict())  # replica i's GPUs: dp placement
            proc = ctx.Process(target=run_scheduler_process, args=(args_json, replica, ipc.folder, send),
                               name=f"radixlang-scheduler-{replica}",
                               daemon=args.tp_size == 1)  # a daemonic process may not start its tp ranks
            proc.start()
            send.close()
            self.schedulers.append(proc)
            self._ready.append(recv)
        recv, self._detok_setup = ctx.Pipe(duplex=False)
        self.detokenizer = ctx.Process(target=run_detokenizer_process, args=(ipc.folder, args.log_level, recv),
                                       name="radixlang-detokenizer", daemon=True)
        self.detokenizer.start()
        recv.close()

    @property
    def all(self) -> list[multiprocessing.Process]:
        return [*self.schedulers, self.detokenizer]

    def wait_ready(self) -> list[SchedulerReady]:
        """Block until every scheduler has loaded its model; raise if one failed or a child died first."""
        readies: dict[int, SchedulerReady] = {}
        pending = {conn: i for i, conn in enumerate(self._ready)}
        sentinels = {p.sentinel: p for p in self.all}
        while pending:
            for obj in wait([*pending, *sentinels]):
                if obj in sentinels:
                    proc = sentinels[obj]
                    if proc in self.schedulers and self._ready[self.schedulers.index(proc)] not in pending:
                        continue  # reported ready, then exited: the watch after startup will see it
                    raise RuntimeError(f"{proc.name} (pid {proc.pid}) exited with code {proc.exitcode} "
                                       "before the server was ready")
                try:
                    ready = decode(obj.recv_bytes())
                except EOFError:
                    continue  # its process exited: the sentinel says how
                del pending[obj]
                if ready.error:
                    raise RuntimeError(f"scheduler {ready.replica} failed to start: {ready.error}")
                readies[ready.replica] = ready
        return [readies[i] for i in range(len(self.schedulers))]

    def setup_detokenizer(self, tokenizer_path: str) -> None:
        self._detok_setup.send_bytes(orjson.dumps({"tokenizer_path": tokenizer_path}))

    def first_dead(self) -> multiprocessing.Process | None:
        return next((p for p in self.all if not p.is_alive()), None)

    def stop(self) -> None:
        """Kill the children (they ignore SIGTERM; nothing of theirs needs a clean exit) and reap them."""
        for proc in self.all:
            if proc.is_alive():
                proc.kill()
        for proc in self.all:
            proc.join(timeout=10)


def run_server(args: ServerArgs) -> int:
    """Serve until SIGTERM / Ctrl-C (exit code 0) or until a child process dies (exit code 1)."""
    folder = make_private_dir()
    ipc = IpcNames(folder)
    # until uvicorn takes the signals over: stop the children and remove the folder, not just die
    signal.signal(signal.SIGTERM, _exit_on_signal)
    procs = ServerProcesses(args, ipc)
    try:
        from transformers import AutoTokenizer  # imports while the schedulers load the model

        readies = procs.wait_ready()
        first = readies[0]
        tokenizer_path = first.tokenizer_path
        procs.setup_detokenizer(tokenizer_path)
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
        from radixlang.runtime.front.tokenizer_manager import TokenizerManager, process_pids

        # the router's trees are sized from each replica's report (its KV pool), as in the Engine
        manager = TokenizerManager(readies, tokenizer=tokenizer, ipc=ipc,
                                   process_pids=process_pids([r.pid for r in readies], procs.detokenizer.pid))
        logger.info("serving %s on http://%s:%d (%d scheduler replica(s))", first.model_path, args.host, args.port,
                    len(readies))
        return _run_loop(_serve(args, manager, procs))
    finally:
        procs.stop()
        remove_private_dir(folder)


def _exit_on_signal(sig: int, frame: Any) -> None:
    raise SystemExit(0)


def _run_loop(coro: Any) -> int:
    try:
        import uvloop
    except ImportError:  # not on Windows
        return asyncio.run(coro)
    return uvloop.run(coro)


async def _serve(args: ServerArgs, manager: Any, procs: ServerProcesses) -> int:
    from radixlang.runtime.entrypoints.http_server import create_app

    manager.start()
    config = uvicorn.Config(create_app(manager), host=args.host, port=args.port, log_level=args.log_level,
                            lifespan="off", timeout_graceful_shutdown=5)
    server = DrainingServer(config, manager, drain_timeout=args.graceful_shutdown_timeout)
    watch = asyncio.get_running_loop().create_task(_watch_children(procs, manager, server))
    try:
        await server.serve()
    finally:
        watch.cancel()
        manager.close()
    return 1 if manager.error is not None else 0


async def _watch_children(procs: ServerProcesses, manager: Any, server: Any) -> None:
    while True:
        dead = procs.first_dead()
        if dead is not None:
            message = f"{dead.name} (pid {dead.pid}) exited with code {dead.exitcode}"
            logger.error("%s: the server stops", message)
            manager.fail(message)
            server.should_exit = True
            return
        await asyncio.sleep(_WATCH_INTERVAL_S)


class DrainingServer(uvicorn.Server):
    """uvicorn's Server with a drain before exit: 503 for new requests while running ones finish."""

    def __init__(self, config: uvicorn.Config, manager: Any, *, drain_timeout: float) -> None:
        super().__init__(config)
        self.manager = manager
        self.drain_timeout = drain_timeout
        self.loop = asyncio.get_running_loop()
        self._drain_task: asyncio.Task | None = None

    def handle_exit(self, sig: int, frame: Any) -> None:
        # replaces uvicorn's, which would re-raise the signal after serving (exit code -15, not 0)
        if self.manager.draining:  # a second signal: abort what runs and stop now
            self.loop.call_soon_threadsafe(self.manager.abort_all)
            self.should_exit = True
            return
        self.manager.draining = True
        self.loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        self._drain_task = self.loop.create_task(self._drain())

    async def _drain(self) -> None:
        logger.info("shutting down: %d request(s) running, waiting up to %.0f s", self.manager.num_pending,
                    self.drain_timeout)
        deadline = time.monotonic() + self.drain_timeout
        while self.manager.num_pending and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self.manager.num_pending:
            logger.warning("aborting %d request(s) still running after %.0f s", self.manager.num_pending,
                           self.drain_timeout)
            self.manager.abort_all()
            deadline = time.monotonic() + 5
            while self.manager.num_pending and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
        self.should_exit = True
