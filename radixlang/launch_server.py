"""Start the radixlang HTTP server.

    python -m radixlang.launch_server [--model-path PATH] [--port 30000] [--api-key KEY] ...

Every option is a ServerArgs field (see --help). Without --model-path the
embedded SmolLM2-135M-Instruct is served.
"""
from __future__ import annotations

import argparse
import logging
import os

from radixlang.runtime.config import ServerArgs


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
        from radixlang.runtime.tp_worker import run_node
        run_node(args)
        return
    import uvicorn

    from radixlang.runtime.engine import Engine
    from radixlang.runtime.http_server import create_app

    import dataclasses
    engine = Engine(**dataclasses.asdict(args))
    app = create_app(engine)
    log.info("serving %s on http://%s:%d", engine.scheduler.runner.model_path, args.host, args.port)
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, loop="uvloop"
                    if os.name == "posix" else "asyncio")
    finally:
        engine.shutdown()


if __name__ == "__main__":
    main()
