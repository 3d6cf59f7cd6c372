"""The request front over a scripted transport (no model): routing bookkeeping, sync and asyncio waits,
streams and their abort, faults, and the control fan-out, the same for every transport."""
from __future__ import annotations

import asyncio
import threading

import pytest

from radixlang.runtime.errors import RequestError
from radixlang.runtime.io_struct import (
    BatchStrOut, CheckMemoryLeakOut, CheckMemoryLeakReq, FlushCacheOut, FlushCacheReq, GetInternalStateOut,
    GetInternalStateReq, SchedulerReady, TextRow,
)
from radixlang.runtime.front.request_front import RequestFront
from radixlang.runtime.server_args import ServerArgs


class _Tokenizer:
    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [ord(c) for c in text]


def _state(n: int) -> dict:
    return {"num_requests": n, "prompt_tokens": 10 * n, "cached_tokens": n, "memory": {"kv_total_tokens": 64}}


class _Transport:
    """Answers each request with one output piece, then a finished one, from its own thread."""

    def __init__(self) -> None:
        self.front: RequestFront | None = None
        self.sent: list[tuple[int, str]] = []
        self.aborted: list[tuple[int, str]] = []
        self.hold = False  # True: requests stay running until aborted
        self.flush_ok = [True, True]
        self.leak = [None, None]

    def send(self, replica, req):
        self.sent.append((replica, req.rid))
        if not self.hold:
            threading.Thread(target=self._answer, args=(req.rid, "length")).start()

    def _answer(self, rid: str, reason: str) -> None:
        assert self.front is not None
        self.front.deliver(_out(rid, "a", None))
        self.front.deliver(_out(rid, "b", {"type": reason}))

    def abort(self, replica, rid):
        self.aborted.append((replica, rid))
        assert self.front is not None
        self.front.deliver(_out(rid, "", {"type": "abort", "message": "aborted by request"}))

    def control(self, msgs):
        outs = []
        for i, msg in enumerate(msgs):
            if isinstance(msg, FlushCacheReq):
                outs.append(FlushCacheOut(success=self.flush_ok[i], message="busy", rid=msg.rid))
            elif isinstance(msg, GetInternalStateReq):
                outs.append(GetInternalStateOut(state=_state(i + 1), rid=msg.rid))
            elif isinstance(msg, CheckMemoryLeakReq):
                outs.append(CheckMemoryLeakOut(ok=self.leak[i] is None, message=self.leak[i] or "", rid=msg.rid))
        return outs

    async def acontrol(self, msgs):
        return self.control(msgs)


def _out(rid: str, text: str, reason: dict | None) -> BatchStrOut:
    return BatchStrOut(rows=[TextRow(rid=rid, text_delta=text, output_ids=[ord(text)] if text else [],
                                     finished_reason=reason, prompt_tokens=3, completion_tokens=1, cached_tokens=0)])


def _front(kv_sizes=(64, 32), policy: str = "round_robin") -> tuple[RequestFront, _Transport]:
    transport = _Transport()
    args = ServerArgs(dp_size=len(kv_sizes), load_balance_method=policy).to_dict()
    readies = [SchedulerReady(replica=i, pid=1, server_args=args, kv_pool_size=n) for i, n in enumerate(kv_sizes)]
    front = RequestFront.from_reports(transport, readies, tokenizer=_Tokenizer(), name="engine")
    transport.front = front
    return front, transport


def test_router_trees_are_sized_from_the_reports():
    front, _ = _front((64, 32), policy="cache_aware")
    assert [t.max_tokens for t in front.router.trees] == [64, 32]
    front.router.select(list(range(100)))
    assert max(front.router.stats()["tree_tokens"]) <= 64


def test_sync_generate_routes_waits_and_finishes_in_the_router():
    front, transport = _front()
    outs = front.generate(["ab", "cde"], {"max_new_tokens": 2})
    assert [o["text"] for o in outs] == ["ab", "ab"]
    assert all(o["meta_info"]["finish_reason"] == {"type": "length"} for o in outs)
    assert [r for r, _ in transport.sent] == [0, 1]  # round robin
    assert front.router.stats()["in_flight"] == [0, 0] and front.num_pending == 0
    single = front.generate("x", {"n": 2})
    assert isinstance(single, list) and len(single) == 2
    assert isinstance(front.generate(input_ids=[1, 2]), dict)


def test_asyncio_generate_and_stream_are_the_same_front():
    front, _ = _front()

    async def main():
        out = await front.agenerate("ab", {"max_new_tokens": 2}, rid="r1")
        snaps = [s async for s in await front.astream(input_ids=[5, 6])]
        return out, snaps
    out, snaps = asyncio.run(main())
    assert out["meta_info"]["id"] == "r1" and out["text"] == "ab"
    assert [s["text"] for s in snaps] == ["a", "ab"] and snaps[-1]["meta_info"]["finish_reason"]["type"] == "length"
    assert front.router.stats()["in_flight"] == [0, 0]


def test_closing_an_unfinished_stream_aborts_it_on_its_replica():
    front, transport = _front()
    transport.hold = True
    it = front.stream(input_ids=[1, 2], rid="s1")
    it.close()
    assert transport.aborted == [(0, "s1")]
    assert front.router.stats()["in_flight"] == [0, 0]

    async def main():
        stream = await front.astream(input_ids=[1, 2], rid="s2")
        await stream.aclose()
    asyncio.run(main())
    assert transport.aborted[-1] == (1, "s2")
    front.abort_request("unknown")  # ignored: may have just finished
    assert len(transport.aborted) == 2


def test_bad_calls_and_duplicate_ids_are_request_errors():
    front, transport = _front()
    with pytest.raises(RequestError) as e:
        front.stream(["a", "b"])
    assert e.value.param == "stream"
    transport.hold = True
    front.stream(input_ids=[1], rid="dup")
    with pytest.raises(RequestError) as e:
        front.stream(input_ids=[1], rid="dup")
    assert e.value.param == "rid"
    assert front.router.stats()["in_flight"] == [1, 0]  # the refused duplicate was never routed


def test_a_failed_replica_ends_its_requests_and_refuses_new_ones():
    front, transport = _front()
    transport.hold = True
    keep, lost = front.stream(input_ids=[1]), front.stream(input_ids=[2])
    front.fail("replica 1 exploded", replica=1, message="engine error: replica 1 exploded")
    last = list(lost)[-1]
    assert last["meta_info"]["finish_reason"] == {"type": "abort", "message": "engine error: replica 1 exploded"}
    assert front.router.stats()["in_flight"] == [1, 0] and front.num_pending == 1
    with pytest.raises(RuntimeError, match="the engine has failed: replica 1 exploded"):
        front.generate(input_ids=[3])
    with pytest.raises(RuntimeError, match="the engine has failed"):
        front.get_server_info()
    keep.close()


def test_control_fan_out():
    front, transport = _front(policy="cache_aware")
    front.generate(input_ids=[[1, 2, 3], [7, 8, 9]])
    info = front.get_server_info()
    assert info["num_requests"] == 3 and info["replicas"] == [_state(1), _state(2)]
    assert info["num_requests_per_replica"] == [1, 2] and info["dp_size"] == 2
    assert info["cache_hit_rate"] == pytest.approx(3 / 30)
    transport.flush_ok = [True, False]
    assert front.flush_cache() is False
    assert front.router.stats()["tree_tokens"][0] == 0 and front.router.stats()["tree_tokens"][1] > 0
    transport.leak = [None, "memory leak detected"]
    with pytest.raises(RuntimeError, match="replica 1: memory leak detected"):
        front.check_memory_leak()
    transport.flush_ok = [True, True]
    assert asyncio.run(front.aflush_cache()) is True and front.router.stats()["tree_tokens"] == [0, 0]
