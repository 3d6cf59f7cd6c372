"""Start the radixlang HTTP server.

    python -m radixlang.launch_server [--model-path PATH] [--port 30000] [--api-key KEY] ...

Every option is a ServerArgs field (see --help). Without --model-path the
embedded SmolLM2-135M-Instruct is served. Three kinds of process serve it (see
runtime/entrypoints/launcher.py): this one (HTTP), a scheduler per --dp-size replica, a detokenizer.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys

from radixlang.runtime.server_args import ServerArgs


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m radixlang.launch_server", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    ServerArgs.add_cli_args(parser)
    args = ServerArgs.from_cli_args(parser.parse_args(argv))
    logging.basicConfig(level=args.log_level.upper(), format="[%(asctime)s %(name)s] %(message)s")
    log = logging.getLogger("radixlang.launch_server")
    if args.host not in ("127.0.0.1", "localhost", "::1") and not args.api_key:
        log.warning("binding %s without --api-key: anyone who can reach this port can use the server", args.host)
    if args.node_rank > 0:  # a tensor-parallel node without the scheduler: run its ranks only
        from radixlang.runtime.model_executor.model_runner import follower_main
        from radixlang.runtime.model_executor.tp_leader import run_node
        run_node(args, follower_main)
        return
    from radixlang.runtime.entrypoints.launcher import run_server

    try:
        code = run_server(args)
    except RuntimeError as e:  # a child failed to start: the reason is in the message
        log.error("%s", e)
        code = 1
    # children reaped and the socket folder removed: skip the interpreter's teardown (torch, zmq,
    # multiprocessing), which is slow (docs/serving.md) and could only hang a stopping server
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
