"""Serve radixlang on an existing Ray cluster: N replicas behind one HTTP endpoint.

    ray start --head                                  # once, then `ray start --address=HEAD:6379` per machine
    python -m radixlang.launch_ray --num-replicas 3 [--num-cpus-per-replica 4] [launch_server options ...]

Every launch_server option is a ServerArgs field and means the same here (each replica runs an Engine with
them); --host / --port are where Ray Serve's HTTP proxy listens. Routing is prefix-aware by default
(--routing round_robin for the baseline). See docs/scaling.md.
"""
from __future__ import annotations

import argparse
import logging
import signal
import socket
import threading
from typing import Any

from radixlang.runtime.server_args import ServerArgs

APP_NAME = "radixlang"
NO_CLUSTER = ("no Ray cluster reachable at {address!r} ({error}): start one with `ray start --head` (and "
              "`ray start --address=<head>:6379` on each other machine), or pass --ray-address")


def add_ray_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("Ray")
    group.add_argument("--num-replicas", type=int, default=1, help="replicas, each an Engine (default: 1)")
    group.add_argument("--ray-address", default="auto", help="the Ray cluster to join (default: auto, the local "
                       "cluster `ray start` made)")
    group.add_argument("--num-cpus-per-replica", type=float, default=1.0, help="CPUs Ray reserves per replica")
    group.add_argument("--num-gpus-per-replica", type=float, default=None, help="GPUs Ray reserves per replica "
                       "(default: --tp-size when the cluster has GPUs and --device is auto or cuda, else 0)")
    group.add_argument("--routing", choices=("cache_aware", "round_robin"), default="cache_aware",
                       help="how requests are spread over the replicas")


def check_resources(nodes: list[dict[str, Any]], *, num_cpus: float, num_gpus: float) -> None:
    """Fail at start, not as a replica pending forever, when no node can hold one replica."""
    alive = [n.get("Resources", {}) for n in nodes if n.get("Alive")]
    for name, asked, flag in (("CPU", num_cpus, "--num-cpus-per-replica"), ("GPU", num_gpus, "--num-gpus-per-replica")):
        largest = max((r.get(name, 0.0) for r in alive), default=0.0)
        if asked > largest:
            raise SystemExit(f"a replica asks for {asked:g} {name}s but the largest node of the Ray cluster has "
                             f"{largest:g}: lower {flag} or add a node with more (`ray start --num-{name.lower()}s`)")


def connect(address: str) -> None:
    """Join the cluster at ``address``, or exit saying how to start one. An explicit host:port is probed
    first: Ray itself retries an unreachable GCS for a minute and then ends the process."""
    import ray
    if address not in ("auto", "local") and not address.startswith("ray://"):
        _check_reachable(address)
    try:
        ray.init(address=address, logging_level=logging.WARNING, log_to_driver=False)
    except (ConnectionError, RuntimeError) as e:
        raise SystemExit(NO_CLUSTER.format(address=address, error=e)) from None


def _check_reachable(address: str) -> None:
    host, _, port = address.rpartition(":")
    try:
        socket.create_connection((host or "127.0.0.1", int(port)), timeout=5).close()
    except (OSError, ValueError) as e:
        raise SystemExit(NO_CLUSTER.format(address=address, error=e)) from None


def deploy(args: ServerArgs, *, num_replicas: int, num_cpus: float, num_gpus: float | None,
           routing: str = "cache_aware") -> str:
    """Deploy onto the Ray cluster this process is connected to; return the HTTP endpoint's URL."""
    import ray
    from ray import serve

    from radixlang.runtime.entrypoints.ray_app import build_app

    if num_replicas < 1:
        raise SystemExit(f"--num-replicas must be >= 1, got {num_replicas}")
    on_gpus = args.device == "cuda" or (args.device == "auto" and ray.cluster_resources().get("GPU", 0) > 0)
    gpus = num_gpus if num_gpus is not None else (args.tp_size if on_gpus else 0)
    check_resources(ray.nodes(), num_cpus=num_cpus, num_gpus=gpus)
    # one HTTP endpoint, on the head node with the ingress: the address clients use survives any other node
    serve.start(http_options={"host": args.host, "port": args.port}, proxy_location="HeadOnly")
    app = build_app(args, num_replicas=num_replicas, num_cpus=num_cpus, num_gpus=gpus, policy=routing)
    serve.run(app, name=APP_NAME, route_prefix="/")
    return f"http://{args.host}:{args.port}"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m radixlang.launch_ray", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    ServerArgs.add_cli_args(parser)
    add_ray_args(parser)
    ns = parser.parse_args(argv)
    args = ServerArgs.from_cli_args(ns)
    logging.basicConfig(level=args.log_level.upper(), format="[%(asctime)s %(name)s] %(message)s")
    connect(ns.ray_address)
    from ray import serve

    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        url = deploy(args, num_replicas=ns.num_replicas, num_cpus=ns.num_cpus_per_replica,
                     num_gpus=ns.num_gpus_per_replica, routing=ns.routing)
        logging.getLogger("radixlang.launch_ray").info("serving %d replica(s) on %s", ns.num_replicas, url)
        stop.wait()
    except KeyboardInterrupt:
        pass
    finally:
        serve.delete(APP_NAME)


if __name__ == "__main__":
    main()
