"""The server's process plumbing without processes: the private socket folder, the scheduler loop's replies."""
from __future__ import annotations

import os
import stat

import pytest
import zmq

from radixlang.runtime.sampling.sampling_params import SamplingParams
from radixlang.runtime.io_struct import (
    AbortReq, CheckMemoryLeakOut, CheckMemoryLeakReq, FlushCacheOut, FlushCacheReq, GetInternalStateReq,
    TokenizedGenerateReq, decode, encode,
)
from radixlang.runtime.ipc import IpcNames, make_private_dir, pull_socket, push_socket, remove_private_dir
from radixlang.runtime.scheduler.process import SchedulerLoop


def test_private_dir_is_0700_and_removed():
    folder = make_private_dir()
    try:
        assert stat.S_IMODE(os.stat(folder).st_mode) == 0o700
        names = IpcNames(folder)
        assert names.scheduler(1).startswith("ipc://" + folder) and names.scheduler(0) != names.scheduler(1)
        ctx = zmq.Context()
        recv, send = pull_socket(ctx, names.detokenizer), push_socket(ctx, names.detokenizer)
        send.send(encode(AbortReq(rid="x")))
        assert decode(recv.recv()) == AbortReq(rid="x")
        ctx.destroy(linger=0)
    finally:
        remove_private_dir(folder)
    assert not os.path.exists(folder)


class _FakeScheduler:
    def __init__(self) -> None:
        self.added, self.aborted, self.leak = [], [], None

    def add_request(self, req): self.added.append(req.rid)
    def abort_request(self, rid): self.aborted.append(rid)
    def flush_cache(self): return FlushCacheOut(success=False, message="busy")
    def get_internal_state(self): return {"num_requests": len(self.added)}

    def check_memory_leak(self):
        if self.leak:
            raise AssertionError(self.leak)


def test_scheduler_loop_applies_requests_and_answers_control_calls_by_id():
    sched = _FakeScheduler()
    loop = SchedulerLoop(sched, recv=None, send=None)
    assert loop.handle(TokenizedGenerateReq(rid="r1", input_ids=[1], sampling_params=SamplingParams())) is None
    assert loop.handle(AbortReq(rid="r1")) is None and sched.aborted == ["r1"]
    assert loop.handle(FlushCacheReq(rid="c1")) == FlushCacheOut(success=False, message="busy", rid="c1")
    assert loop.handle(GetInternalStateReq(rid="c2")).state == {"num_requests": 1}
    assert loop.handle(CheckMemoryLeakReq(rid="c3")) == CheckMemoryLeakOut(ok=True, rid="c3")
    sched.leak = "memory leak detected"
    assert loop.handle(CheckMemoryLeakReq(rid="c4")) == CheckMemoryLeakOut(ok=False, message=sched.leak, rid="c4")
    with pytest.raises(TypeError, match="expected a request or control message, got FlushCacheOut"):
        loop.handle(FlushCacheOut(success=True))
