"""A replica's scheduler over its model: the process-wide torch settings, the ``ModelRunner`` (the model
loaded here), then the ``Scheduler`` that drives it. The scheduler itself imports no model code."""
from __future__ import annotations

import torch

from radixlang.runtime.model_executor.model_runner import ModelRunner
from radixlang.runtime.scheduler.scheduler import Scheduler
from radixlang.runtime.server_args import ServerArgs


def build_scheduler(server_args: ServerArgs, *, replica: int = 0) -> Scheduler:
    """The Engine's replica threads and the server's scheduler processes build theirs here. Data-parallel
    replica ``replica`` (its args already ``ServerArgs.for_replica``'s) loads the same weights as the others
    (one random_seed) but draws its own unseeded samples: its runner's generator is seeded with
    random_seed + replica, on both transports alike."""
    args = server_args.resolve()
    if args.device == "cpu" and args.num_threads:
        torch.set_num_threads(args.num_threads)
    torch.manual_seed(args.random_seed)
    runner = ModelRunner(args)
    if replica:
        runner.generator.manual_seed(args.random_seed + replica)
    return Scheduler(args, runner=runner)
