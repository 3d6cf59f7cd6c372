"""The routes SGLang's gateway (SMG, the ``smg`` wheel) reads from a worker, beyond the ones every client uses.

SMG registers an HTTP worker in steps: ``/health``; ``/v1/models`` then ``/server_info`` (with no ``/version``,
the worker counts as SGLang); ``/server_info`` and ``/model_info`` for its labels (http_server.py serves both
under SGLang's old ``get_`` names too); then, while a load-aware policy runs, it polls ``/v1/loads`` every
``--load-monitor-interval`` seconds. This module serves that load report, one entry per data-parallel replica,
in SGLang's shape. Requests themselves go through the ordinary native and OpenAI routes.
"""
from __future__ import annotations

import os
import shutil
import sys
import time
from typing import Any

from fastapi import FastAPI

from radixlang.runtime.entrypoints.http_common import Front


def smg_executable() -> str:
    """The ``smg`` gateway's command: on PATH, or beside this Python (a virtual environment not activated)."""
    found = shutil.which("smg") or shutil.which("smg", path=os.path.dirname(sys.executable))
    if found is None:
        raise FileNotFoundError("the smg gateway is not installed: `pip install smg==1.13.0` puts its `smg` command "
                                "beside this Python; then `smg launch --worker-urls http://<worker>:<port> ...`")
    return found


def add_smg_routes(app: FastAPI, engine: Front) -> None:
    @app.get("/v1/loads")
    async def loads() -> dict[str, Any]:
        return load_report(await engine.get_server_info())

    # SMG's fleet-wide /loads (and SGLang's own) answers the same report for one worker
    app.add_api_route("/loads", loads, methods=["GET"])


def load_report(info: dict[str, Any]) -> dict[str, Any]:
    """SGLang's ``/v1/loads`` body from ``get_server_info``: per replica its queue and KV use.

    ``token_usage`` counts the KV slots requests hold, not the prefix cache's evictable ones, as SGLang's does:
    a warm cache is free memory, and SMG's overload guard (``--worker-overload-token-usage``) must not see it
    as load.
    """
    ranks = [_rank_load(rank, state, info["max_running_requests"]) for rank, state in enumerate(info["replicas"])]
    return {"timestamp": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "dp_rank_count": len(ranks),
            "loads": ranks}


def _rank_load(rank: int, state: dict[str, Any], max_running: int) -> dict[str, Any]:
    memory = state["memory"]
    total = memory["kv_total_tokens"]
    used = total - memory["kv_free_tokens"] - memory["kv_evictable_tokens"]
    running, waiting = state["num_running_reqs"], state["num_waiting_reqs"]
    return {"dp_rank": rank, "num_running_reqs": running, "num_waiting_reqs": waiting,
            "num_total_reqs": running + waiting, "num_used_tokens": used, "max_total_num_tokens": total,
            "token_usage": used / total if total else 0.0, "cache_hit_rate": state["cache_hit_rate"],
            "gen_throughput": 0.0, "utilization": min(1.0, running / max_running) if max_running else 0.0,
            "max_running_requests": max_running}
