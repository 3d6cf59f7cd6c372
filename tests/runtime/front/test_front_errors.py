"""A sink or a control reply of the wrong kind, and a forced tag without a tool parser, raise named
errors in the request front and the chat output, never bare asserts (which ``python -O`` strips)."""
from __future__ import annotations

import asyncio

import pytest

from radixlang.runtime.entrypoints.openai.chat_output import ChatOutput
from radixlang.runtime.front.request_front import LoopSink, Pending, RequestFront, SyncStream
from radixlang.runtime.io_struct import FlushCacheOut, SchedulerReady
from radixlang.runtime.server_args import ServerArgs


class _WrongReplies:
    """Answers every control message of either replica with a FlushCacheOut."""

    def send(self, replica, req):
        raise AssertionError("no request is sent in these tests")

    def abort(self, replica, rid):
        pass

    def control(self, msgs):
        return [FlushCacheOut(success=True, message="", rid=m.rid) for m in msgs]


def _front() -> RequestFront:
    args = ServerArgs(dp_size=2).to_dict()
    readies = [SchedulerReady(replica=i, pid=1, server_args=args, kv_pool_size=64) for i in range(2)]
    return RequestFront.from_reports(_WrongReplies(), readies, tokenizer=None, name="engine")


@pytest.mark.parametrize(("call", "expected"), [
    ("get_server_info", "replica 0's get_internal_state reply: expected a GetInternalStateOut, got FlushCacheOut"),
    ("check_memory_leak", "replica 0's check_memory_leak reply: expected a CheckMemoryLeakOut, got FlushCacheOut"),
])
def test_a_control_reply_of_the_wrong_kind_is_a_type_error(call, expected):
    with pytest.raises(TypeError, match=expected):
        getattr(_front(), call)()


def test_a_sync_stream_over_an_asyncio_sink_is_a_type_error():
    loop = asyncio.new_event_loop()
    try:
        pending = Pending("r1", return_logprob=False, replica=0, sink=LoopSink(loop))
        with pytest.raises(TypeError, match="the sink of stream r1: expected a ThreadSink, got LoopSink"):
            next(SyncStream(_front(), pending))
    finally:
        loop.close()


def test_a_forced_tag_without_a_tool_parser_is_a_runtime_error():
    out = ChatOutput(tool_parser=None, reasoning_parser=None, chat_template=None, tool_names=set(), forced=False,
                     parallel=True)
    with pytest.raises(RuntimeError, match="forced_tag needs a tool-call parser"):
        out.forced_tag([("add", {"type": "object"})])
