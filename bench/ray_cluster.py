"""radixlang on Ray Serve over a Ray cluster of several nodes on this machine (``ray.cluster_utils.Cluster``):
the one setup that tests/e2e/test_ray_serve.py and bench/ray_serve.py share.

A head node and ``num_workers`` worker nodes of ``cpus_per_node`` logical CPUs each, so that a replica on a
removed worker node has somewhere to go; the HTTP endpoint sits on the head node (``deploy`` puts the proxy
there), so its address survives the loss of any worker.
"""
from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

# a dead node is noticed within seconds, not Ray's default half minute
FAST_NODE_HEALTH_CHECKS = {"health_check_period_ms": 1000, "health_check_failure_threshold": 3}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class LocalDeployment:
    """``url``: the HTTP endpoint; ``cluster``: the ``ray.cluster_utils.Cluster``; ``workers``: its worker
    nodes (the head is not one of them), any of which a test may remove."""

    url: str
    cluster: Any
    workers: list[Any]
    num_replicas: int

    def replica_node_ids(self) -> set[str]:
        """The Ray node ids the replicas run on now."""
        from ray import serve
        replicas = serve.get_deployment_handle("RadixReplica", app_name="radixlang")
        return {replicas.describe.remote(replica_index=i).result()["node_id"] for i in range(self.num_replicas)}

    def worker_with_a_replica(self) -> Any:
        """A worker node that holds at least one replica (the one to remove to lose a replica)."""
        held = self.replica_node_ids()
        return next(n for n in self.workers if n.node_id in held)


@contextlib.contextmanager
def local_deployment(server_args: dict[str, Any], *, num_replicas: int = 3, num_workers: int = 2,
                     cpus_per_node: int = 2) -> Iterator[LocalDeployment]:
    """Start the cluster, connect this process to it and deploy ``num_replicas`` replicas of 1 CPU each with
    ``server_args`` (ServerArgs fields; the port is a free one). On exit the cluster's shutdown ends every
    process of it: Serve's controller, its proxy and the replicas."""
    import ray
    from ray.cluster_utils import Cluster

    from radixlang.launch_ray import deploy
    from radixlang.runtime.server_args import ServerArgs

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": cpus_per_node, "include_dashboard": False,
                                                            "_system_config": FAST_NODE_HEALTH_CHECKS})
    try:
        workers = [cluster.add_node(num_cpus=cpus_per_node) for _ in range(num_workers)]
        ray.init(address=cluster.address, log_to_driver=False)
        url = deploy(ServerArgs(port=free_port(), **server_args), num_replicas=num_replicas, num_cpus=1,
                     num_gpus=0)
        yield LocalDeployment(url=url, cluster=cluster, workers=workers, num_replicas=num_replicas)
    finally:
        ray.shutdown()
        cluster.shutdown()
