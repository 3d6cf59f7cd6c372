"""Tensor-parallel ranks: rank 0 starts its followers; each follower runs the steps rank 0 sends
(the follower loop is ``model_runner.follower_main``, passed in: this module never imports the runner).

Ranks are laid out by node: node k runs ranks [k * per_node, (k + 1) * per_node) with
``per_node = tp_size / nnodes``. Rank 0 lives in the process that builds the Scheduler (the
Engine's or the server's); its ModelRunner starts node 0's other ranks as spawned processes. Every
other node runs ``run_node`` (``launch_server --node-rank K``), which starts that node's ranks and
waits for them. A follower builds the same ModelRunner as rank 0, holding its heads, then loops:
receive a step, copy the req_to_token entries it reads, run the forward, until the stop message.
"""
from __future__ import annotations

import atexit
import logging
import multiprocessing as mp
import os
import threading
import time
from typing import Callable

import torch

from radixlang.runtime.server_args import ServerArgs
from radixlang.runtime.model_executor.distributed import DistComm, free_port, init_group

logger = logging.getLogger(__name__)


def ranks_per_node(args: ServerArgs) -> int:
    return args.tp_size // args.nnodes


def cuda_device_index(args: ServerArgs, local_rank: int, device_count: int) -> int:
    """The GPU of this node's tensor-parallel rank ``local_rank`` of the replica ``args`` belong to (its
    ``base_gpu_id``, set per dp replica by ``ServerArgs.for_replica``): replica i, rank r -> base + r."""
    index = args.base_gpu_id + local_rank
    if index >= device_count:
        per_node = ranks_per_node(args)
        raise ValueError(f"tensor-parallel rank {local_rank} of the replica starting at GPU {args.base_gpu_id} needs "
                         f"GPU {index}, found {device_count} GPU(s): dp_size {args.dp_size} x tp_size {args.tp_size} "
                         f"over {args.nnodes} node(s) needs {args.dp_size * per_node} GPUs per node, from "
                         f"base_gpu_id on")
    return index


def _check_devices(args: ServerArgs) -> None:
    if args.device == "cuda":
        cuda_device_index(args, ranks_per_node(args) - 1, torch.cuda.device_count())


class TPLeader:
    """Rank 0's handle on node 0's follower processes and the group."""

    def __init__(self, comm: DistComm, procs: list) -> None:
        self.comm = comm
        self.procs = procs
        atexit.register(self._terminate)  # the interpreter exiting without Engine.shutdown()

    @classmethod
    def start(cls, args: ServerArgs, follower_main: Callable) -> TPLeader:
        """Spawn ranks 1 .. per_node - 1 of node 0 and join the group with them (and remote nodes)."""
        if args.node_rank != 0:
            raise RuntimeError(f"only node 0 hosts tensor-parallel rank 0, this is node {args.node_rank}")
        _check_devices(args)
        if args.device == "cuda":
            torch.cuda.set_device(cuda_device_index(args, 0, torch.cuda.device_count()))
        init_addr = args.dist_init_addr or f"127.0.0.1:{free_port()}"
        procs = _spawn_ranks(args, range(1, ranks_per_node(args)), init_addr, follower_main)
        try:
            comm = _join_while_alive(args, 0, init_addr, procs)
        except BaseException:
            _terminate_all(procs)
            raise
        logger.info("tensor parallelism: %d ranks over %d node(s), group at %s", args.tp_size, args.nnodes, init_addr)
        return cls(comm, procs)

    def stop(self, timeout_s: float = 10.0) -> None:
        """After the stop message: wait for the followers, kill what is left, leave the group."""
        deadline = time.monotonic() + timeout_s
        for p in self.procs:
            p.join(max(0.0, deadline - time.monotonic()))
        self._terminate()
        self.comm.close()
        atexit.unregister(self._terminate)

    def abort(self) -> None:
        """Rank 0 failed while starting: kill the followers (they wait on a message that never comes)."""
        self._terminate()
        self.comm.close()
        atexit.unregister(self._terminate)

    def _terminate(self) -> None:
        _terminate_all(self.procs)


def _spawn_ranks(args: ServerArgs, ranks, init_addr: str, follower_main: Callable) -> list:
    ctx = mp.get_context("spawn")
    procs = []
    for rank in ranks:
        p = ctx.Process(target=follower_main, args=(args, rank, init_addr, os.getpid()),
                        name=f"radixlang-tp{rank}", daemon=True)
        p.start()
        procs.append(p)
    return procs


def _join_while_alive(args: ServerArgs, rank: int, init_addr: str, procs: list) -> DistComm:
    """Join the group, failing fast if a local follower dies before it joins (a bad config, an import error)."""
    box: dict = {}

    def join() -> None:
        try:
            box["comm"] = init_group(rank=rank, size=args.tp_size, init_addr=init_addr, device=args.device)
        except BaseException as e:
            box["error"] = e
    t = threading.Thread(target=join, name="radixlang-tp-join", daemon=True)
    t.start()
    while t.is_alive():
        t.join(0.2)
        dead = [p for p in procs if p.exitcode is not None]
        if dead and t.is_alive():
            raise RuntimeError(f"tensor-parallel rank process {dead[0].name} exited with code {dead[0].exitcode} "
                               f"before joining the group (see its log above)")
    if "error" in box:
        raise box["error"]
    return box["comm"]


def _terminate_all(procs: list) -> None:
    for p in procs:
        if p.is_alive():
            p.terminate()
    for p in procs:
        p.join(5.0)
        if p.is_alive():
            p.kill()
            p.join(1.0)


def exit_with_parent(parent_pid: int) -> None:
    """A follower must not outlive the process that started it (killed rank 0, crashed node launcher)."""
    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(1.0)
        os._exit(1)
    threading.Thread(target=watch, name="radixlang-tp-parent-watch", daemon=True).start()


def run_node(args: ServerArgs, follower_main: Callable) -> None:
    """Nodes 1 .. nnodes - 1: start this node's ranks and wait for them (they end at rank 0's stop)."""
    args = args.resolve()
    if args.node_rank == 0 or not args.dist_init_addr:
        raise ValueError(f"run_node is for node_rank >= 1 with dist_init_addr set, got node_rank "
                         f"{args.node_rank}, dist_init_addr {args.dist_init_addr!r}")
    _check_devices(args)
    first = args.node_rank * ranks_per_node(args)
    procs = _spawn_ranks(args, range(first, first + ranks_per_node(args)), args.dist_init_addr, follower_main)
    logger.info("node %d: started tp ranks %d..%d, group at %s", args.node_rank, first,
                first + len(procs) - 1, args.dist_init_addr)
    try:
        for p in procs:
            p.join()
    finally:
        _terminate_all(procs)
    bad = [p for p in procs if p.exitcode]
    if bad:
        raise RuntimeError(f"tensor-parallel rank process {bad[0].name} exited with code {bad[0].exitcode}")
