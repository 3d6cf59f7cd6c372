"""radixlang on Ray Serve: N replicas, each an in-process Engine, behind one HTTP endpoint.

Two deployments make one Serve application (``build_app``):

* ``RadixReplica`` (N replicas, placed by Ray over the cluster's nodes): an ``Engine`` built from the same
  ServerArgs as ``launch_server``; it answers generate / stream / control calls from the ingress.
* ``RadixIngress`` (one replica): the very HTTP app of ``launch_server`` (native, OpenAI, Anthropic routes),
  over ``RayFront``, a ``Front`` that sends each request to a replica through a Serve handle.

Routing: ``PrefixRouter``, a Serve ``RequestRouter``, keeps per replica an approximate tree of the token ids
it has sent there (dp/router.py's ``ApproxTree``) and applies the in-process router's cache_aware rule
(longest match unless the match is short or that replica is overloaded); ``policy="round_robin"`` is the
baseline. The ingress tokenizes a text prompt so that the router sees token ids.

Failures: a replica whose actor dies is replaced by Serve. A call that had produced nothing yet is retried on
another replica; a stream that had started ends with ``finish_reason`` abort and a message saying to retry;
a call that cannot be placed again is a 503 (``ReplicaLost``), so nothing hangs and nothing is lost silently.
"""
from __future__ import annotations

import asyncio
import contextvars
import dataclasses
import itertools
import logging
import uuid
from typing import Any, AsyncIterator

from radixlang.runtime.dp.router import ApproxTree
from radixlang.runtime.errors import RequestError
from radixlang.runtime.server_args import ServerArgs

logger = logging.getLogger(__name__)

RETRIES = 2  # another replica per call that died before producing anything
LOST = "the replica serving this request died before it finished; retry the request"


class ReplicaLost(RuntimeError):
    """A request's replica died and no other could take it: a 503 the client may retry."""


# -- the router ------------------------------------------------------------------------------------------------

def _load_router_base() -> type:
    from ray.serve.request_router import RequestRouter
    return RequestRouter


class PrefixPolicy:
    """The in-process router's cache_aware rule over replicas that come and go (keyed by replica id)."""

    def __init__(self, *, policy: str = "cache_aware", cache_threshold: float = 0.5, balance_abs_threshold: int = 8,
                 balance_rel_threshold: float = 1.5, max_tree_tokens: int = 1 << 20) -> None:
        if policy not in ("cache_aware", "round_robin"):
            raise ValueError(f"policy must be cache_aware or round_robin, got {policy!r}")
        self.policy = policy
        self.cache_threshold = cache_threshold
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self.max_tree_tokens = max_tree_tokens
        self.trees: dict[str, ApproxTree] = {}
        self.in_flight: dict[str, int] = {}
        self._turn = itertools.count()

    def rank(self, replica_ids: list[str], ids: list[int] | None) -> list[str]:
        """``replica_ids`` best first: the chosen one, then the rest by load."""
        ordered = sorted(replica_ids)
        by_load = sorted(ordered, key=lambda r: self.in_flight.get(r, 0))
        if self.policy == "round_robin" or not ids:
            first = ordered[next(self._turn) % len(ordered)]
        else:
            first = self._cache_aware(ordered, ids)
        return [first] + [r for r in by_load if r != first]

    def _cache_aware(self, ordered: list[str], ids: list[int]) -> str:
        load = {r: self.in_flight.get(r, 0) for r in ordered}
        match = {r: self._tree(r).match(ids) for r in ordered}
        best = max(ordered, key=lambda r: (match[r], -load[r]))
        least = min(ordered, key=lambda r: (load[r], -match[r], self._tree(r).num_tokens))
        overloaded = (load[best] - load[least] > self.balance_abs_threshold
                      and load[best] > self.balance_rel_threshold * load[least])
        if match[best] < self.cache_threshold * len(ids) or overloaded:
            return least
        return best

    def routed(self, replica_id: str, ids: list[int] | None) -> None:
        self.in_flight[replica_id] = self.in_flight.get(replica_id, 0) + 1
        if ids:
            self._tree(replica_id).insert(ids)

    def completed(self, replica_id: str) -> None:
        self.in_flight[replica_id] = max(0, self.in_flight.get(replica_id, 0) - 1)

    def forget(self, replica_id: str) -> None:
        """A dead replica's cache died with it (its replacement starts empty)."""
        self.trees.pop(replica_id, None)
        self.in_flight.pop(replica_id, None)

    def _tree(self, replica_id: str) -> ApproxTree:
        if replica_id not in self.trees:
            self.trees[replica_id] = ApproxTree(self.max_tree_tokens)
        return self.trees[replica_id]


def _route_ids(pending_request: Any) -> list[int] | None:
    args = pending_request.args if pending_request is not None else []
    return args[1] if len(args) > 1 and isinstance(args[1], list) else None


def _target_index(pending_request: Any) -> int | None:
    kwargs = pending_request.kwargs if pending_request is not None else {}
    return kwargs.get("replica_index")


class PrefixRouter(_load_router_base()):  # type: ignore[misc]
    """Serve's request router for ``RadixReplica``: ``PrefixPolicy`` over the live replicas.

    A control call (flush, server info) names ``replica_index``: the replica at that place in id order."""

    def initialize_state(self, **kwargs: Any) -> None:
        self.prefix_policy = PrefixPolicy(**kwargs)
        self._routed_ids: dict[str, str] = {}  # internal request id -> replica id

    async def choose_replicas(self, candidate_replicas: list, pending_request: Any = None) -> list[list]:
        if pending_request is not None:
            # every replica is ranked already: if none takes the request now, Serve must back off before asking
            # again (without it, its routing loop spins and starves the replies it waits for)
            pending_request.routing_context.should_backoff = True
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        target = _target_index(pending_request)
        if target is not None:
            ordered = sorted(by_id)
            return [[by_id[ordered[target]]]] if target < len(ordered) else []
        ranked = self.prefix_policy.rank(list(by_id), _route_ids(pending_request))
        return [[by_id[r]] for r in ranked]

    def on_request_routed(self, pending_request: Any, replica_id: Any, result: Any) -> None:
        if _target_index(pending_request) is not None:
            return
        self._routed_ids[pending_request.metadata.internal_request_id] = replica_id.unique_id
        self.prefix_policy.routed(replica_id.unique_id, _route_ids(pending_request))

    def on_request_completed(self, replica_id: Any, internal_request_id: str) -> None:
        if self._routed_ids.pop(internal_request_id, None) is not None:
            self.prefix_policy.completed(replica_id.unique_id)

    def on_replica_actor_died(self, replica_id: Any) -> None:
        super().on_replica_actor_died(replica_id)
        self.prefix_policy.forget(replica_id.unique_id)


# -- the replica -----------------------------------------------------------------------------------------------

def _error(e: RequestError) -> dict[str, Any]:
    return {"error": str(e), "param": e.param}


class RadixReplica:
    """One Serve replica: an in-process Engine and its ``AsyncFront``. Bad requests come back as values (a
    ``RequestError`` crossing Ray would arrive wrapped) and become ``RequestError`` again in the ingress."""

    def __init__(self, server_args: dict[str, Any]) -> None:
        from radixlang.runtime.entrypoints.engine import Engine
        from radixlang.runtime.entrypoints.engine_front import EngineFront
        self.engine = Engine(**server_args)
        self.front = EngineFront(self.engine)

    def describe(self, *, replica_index: int | None = None) -> dict[str, Any]:
        import ray
        return {"server_args": self.front.server_args.to_dict(), "model_path": self.front.model_path,
                "tokenizer_path": self.front.tokenizer_path, "sampling_defaults": self.front.sampling_defaults,
                "lora_adapters": dict(self.front.lora_adapters),
                "node_id": ray.get_runtime_context().get_node_id()}

    async def generate(self, kw: dict[str, Any], route_ids: list[int] | None = None) -> dict[str, Any]:
        try:
            return {"out": await self.front.generate(**kw)}
        except RequestError as e:
            return _error(e)

    async def stream(self, kw: dict[str, Any], route_ids: list[int] | None = None) -> AsyncIterator[dict[str, Any]]:
        try:
            it = await self.front.stream(**kw)
        except RequestError as e:
            yield _error(e)
            return
        try:
            async for item in it:
                yield {"out": item}
        finally:  # the ingress cancelled (its client left): abort the request
            await it.aclose()

    async def abort_request(self, rid: str, *, replica_index: int | None = None) -> None:
        self.front.abort_request(rid)

    async def flush_cache(self, *, replica_index: int | None = None) -> bool:
        return await self.front.flush_cache()

    async def get_server_info(self, *, replica_index: int | None = None) -> dict[str, Any]:
        return await self.front.get_server_info()

    def check_health(self) -> None:
        """Serve's health probe: a replica whose scheduler thread died is restarted."""
        if not self.front.is_healthy():
            raise RuntimeError(f"radixlang replica unhealthy: {self.front.error}")

    def __del__(self) -> None:
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()


# -- the ingress -----------------------------------------------------------------------------------------------

def _actor_lost_errors() -> tuple[type[BaseException], ...]:
    from ray.exceptions import ActorUnavailableError, RayActorError
    return (RayActorError, ActorUnavailableError)


def _cancelled_error() -> type[BaseException]:
    from ray.serve.exceptions import RequestCancelledError
    return RequestCancelledError


def send(method: Any, *args: Any, **kwargs: Any) -> Any:
    """``method.remote(*args, **kwargs)`` under a request id of its own.

    Serve stamps every call made while serving one HTTP request with that request's internal id, and its
    router hands a chosen replica to the pending call *by that id*: of several calls in flight at once (a
    batch's prompts, a control call's fan-out) all but one would never be matched and would wait forever.
    """
    return contextvars.copy_context().run(_send_fresh, method, args, kwargs)


def _send_fresh(method: Any, args: tuple, kwargs: dict) -> Any:
    from ray.serve import context
    current = context._get_serve_request_context()
    context._serve_request_context.set(dataclasses.replace(current, _internal_request_id=uuid.uuid4().hex))
    return method.remote(*args, **kwargs)


class RayStream:
    """A replica's stream as the HTTP app's ``RequestStream``: retried elsewhere while nothing has come, ended
    with an abort snapshot that says to retry if its replica dies midway; ``aclose`` cancels the call."""

    def __init__(self, front: RayFront, kw: dict[str, Any], route_ids: list[int] | None) -> None:
        self.front, self.kw, self.route_ids = front, kw, route_ids
        self.last: dict[str, Any] | None = None
        self.response: Any = None
        self.first: dict[str, Any] | None = None  # read ahead by start(); handed out by the first __anext__
        self.done = False

    async def start(self) -> RayStream:
        """Open the call and wait for its first item, so that a bad request raises here, as the Front says."""
        self.first = await self._next_or_retry()
        return self

    def __aiter__(self) -> RayStream:
        return self

    async def __anext__(self) -> dict[str, Any]:
        if self.first is not None:
            item, self.first = self.first, None
            return item
        if self.done:
            raise StopAsyncIteration
        try:
            return self._unwrap(await self.response.__anext__())
        except _cancelled_error():  # aclose() cancelled the call while a reader waited on it
            self.done = True
            raise StopAsyncIteration from None
        except _actor_lost_errors():
            self.done = True
            return self._lost()

    async def _next_or_retry(self) -> dict[str, Any]:
        for attempt in range(RETRIES + 1):
            self.response = send(self.front.replicas.options(stream=True).stream, self.kw, self.route_ids)
            try:
                return self._unwrap(await self.response.__anext__())
            except _actor_lost_errors():
                logger.warning("a replica died before streaming anything (try %d); retrying", attempt + 1)
        raise ReplicaLost(LOST)

    def _unwrap(self, item: dict[str, Any]) -> dict[str, Any]:
        if "error" in item:
            raise RequestError(item["error"], item["param"])
        self.last = item["out"]
        return item["out"]

    def _lost(self) -> dict[str, Any]:
        last = dict(self.last or {"text": "", "output_ids": [], "meta_info": {}})
        last["meta_info"] = {**last.get("meta_info", {}), "finish_reason": {"type": "abort", "message": LOST}}
        return last

    async def aclose(self) -> None:
        if self.response is not None and not self.done:
            self.response.cancel()
        self.done = True


class RayFront:
    """``http_common.Front`` over the ``RadixReplica`` deployment's handle."""

    def __init__(self, replicas: Any, described: dict[str, Any], num_replicas: int) -> None:
        from transformers import AutoTokenizer
        self.replicas = replicas
        self.server_args = ServerArgs(**described["server_args"])
        self.model_path = described["model_path"]
        self.tokenizer_path = described["tokenizer_path"]
        self.sampling_defaults = described["sampling_defaults"]  # for /get_model_info: each replica applies them
        self.tokenizer = AutoTokenizer.from_pretrained(self.tokenizer_path)
        self.num_replicas = num_replicas
        self.draining = False
        self.in_flight: dict[str, Any] = {}  # rid -> the Serve response serving it, for /abort_request
        self.lora_adapters: dict[str, str] = described.get("lora_adapters", {})  # --lora-paths of the replicas

    def is_healthy(self) -> bool:
        return True  # each replica's health is Serve's (check_health): a sick one is replaced

    def _items(self, kw: dict[str, Any]) -> list[dict[str, Any]]:
        """A batch split into one call per prompt, so that each is routed by its own prefix."""
        prompt, ids = kw.get("prompt"), kw.get("input_ids")
        batch = prompt if isinstance(prompt, list) else ids if ids and isinstance(ids[0], list) else None
        if batch is None:
            return [kw]
        params, rids = kw.get("sampling_params"), kw.get("rid")
        key = "prompt" if isinstance(prompt, list) else "input_ids"
        return [{**kw, key: one, "sampling_params": params[i] if isinstance(params, list) else params,
                 "rid": rids[i] if isinstance(rids, list) else rids} for i, one in enumerate(batch)]

    def _route_ids(self, kw: dict[str, Any]) -> list[int] | None:
        if kw.get("input_ids") is not None:
            return list(kw["input_ids"])
        if isinstance(kw.get("prompt"), str):
            from radixlang.runtime.tokenizer_source import encode_prompt
            return encode_prompt(self.tokenizer, kw["prompt"])
        return None

    async def generate(self, **kw: Any) -> dict | list[dict]:
        items = self._items(kw)
        outs = await asyncio.gather(*(self._generate_one(item) for item in items))
        if len(items) == 1 and items[0] is kw:
            return outs[0]
        return [o for out in outs for o in (out if isinstance(out, list) else [out])]

    async def _generate_one(self, kw: dict[str, Any]) -> dict | list[dict]:
        route_ids = self._route_ids(kw)
        for attempt in range(RETRIES + 1):
            response = send(self.replicas.generate, kw, route_ids)
            if isinstance(kw.get("rid"), str):
                self.in_flight[kw["rid"]] = response
            try:
                result = await response
            except _actor_lost_errors():
                logger.warning("a replica died while serving a request (try %d); retrying", attempt + 1)
                continue
            finally:
                self.in_flight.pop(kw.get("rid"), None)  # type: ignore[arg-type]
            if "error" in result:
                raise RequestError(result["error"], result["param"])
            return result["out"]
        raise ReplicaLost(LOST)

    async def stream(self, **kw: Any) -> RayStream:
        return await RayStream(self, kw, self._route_ids(kw)).start()

    def abort_request(self, rid: str) -> None:
        response = self.in_flight.pop(rid, None)
        if response is not None:
            response.cancel()  # the replica's call is cancelled, and its front aborts the request

    async def _each_replica(self, method: str) -> list[Any]:
        calls = [send(getattr(self.replicas, method), replica_index=i) for i in range(self.num_replicas)]
        return await asyncio.gather(*calls)

    async def flush_cache(self) -> bool:
        return all(await self._each_replica("flush_cache"))

    async def update_lora(self, name: str, path: str | None) -> tuple[bool, str]:
        return False, ("loading or unloading LoRA adapters at run time is not supported behind Ray Serve: name "
                       "them in --lora-paths when deploying")

    async def get_server_info(self) -> dict[str, Any]:
        from radixlang.runtime.dp.replica_states import merge_states
        infos = await self._each_replica("get_server_info")
        states = [s for info in infos for s in info["replicas"]]
        return {**self.server_args.to_public_dict(), **merge_states(states), "replicas": states,
                "num_requests_per_replica": [s["num_requests"] for s in states], "version": infos[0]["version"],
                "num_ray_replicas": len(infos)}


class RadixIngress:
    """The HTTP app of ``launch_server`` over ``RayFront``; ``ReplicaLost`` answers 503 with Retry-After."""

    def __init__(self, replicas: Any, num_replicas: int) -> None:
        self.replicas = replicas
        self.num_replicas = num_replicas

    async def __serve_build_asgi_app__(self) -> Any:
        from fastapi import Request
        from fastapi.responses import JSONResponse

        from radixlang.runtime.entrypoints.http_server import create_app
        described = await send(self.replicas.describe)
        app = create_app(RayFront(self.replicas, described, self.num_replicas))

        @app.exception_handler(ReplicaLost)
        async def on_replica_lost(_: Request, exc: ReplicaLost) -> JSONResponse:
            return JSONResponse({"error": {"message": str(exc), "type": "service_unavailable", "param": None,
                                           "code": 503}}, status_code=503, headers={"Retry-After": "1"})

        return app


def build_app(args: ServerArgs, *, num_replicas: int, num_cpus: float, num_gpus: float,
              policy: str = "cache_aware") -> Any:
    """The Serve application: ``num_replicas`` Engines with ``args`` behind one ingress."""
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    replica = serve.deployment(RadixReplica, name="RadixReplica").options(
        num_replicas=num_replicas, max_ongoing_requests=max(args.max_running_requests, 1),
        ray_actor_options={"num_cpus": num_cpus, "num_gpus": num_gpus},
        request_router_config=RequestRouterConfig(
            request_router_class=PrefixRouter,
            request_router_kwargs={"policy": policy, "max_tree_tokens": args.max_total_tokens or 1 << 20}),
        health_check_period_s=2, health_check_timeout_s=30)
    # the ingress lives on the head node, where `ray start --head` ran: losing another node never takes it down
    ingress = serve.deployment(serve.ingress()(RadixIngress), name="RadixIngress").options(
        num_replicas=1, max_ongoing_requests=4096,
        ray_actor_options={"num_cpus": 0, "resources": {"node:__internal_head__": 0.001}})
    return ingress.bind(replica.bind(args.to_dict()), num_replicas)
