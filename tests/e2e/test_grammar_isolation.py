"""A grammar that takes its backend long to compile stalls no one and dies with its request (issue #42.6).

Each backend gets a grammar it needs well over 10 s for on an idle 2-core machine (outlines-core
took 3.6 s for a repetition counted to 3,000 and grows linearly with the count: 20,000 here;
xgrammar ~50 s; llguidance took 2.6 s to parse 400,000 alternatives before its size limit refused
them: 1,000,000 here), and far longer on a loaded one; the engine's compile timeout is 2 s, so each
case takes about that long.
"""
from __future__ import annotations

import os
import threading
import time

import pytest

pytestmark = pytest.mark.e2e

COMPILE_TIMEOUT_S = 2.0
PLAIN_BOUND_S = 5.0  # the bound for a plain request while a grammar compiles


def _hostile_regex(backend: str) -> str:
    if backend == "outlines":  # a large counted repetition: outlines-core's index grows with every count
        return "([a-z]{2}[0-9]){1,20000}"
    if backend == "xgrammar":  # 200 alternatives of growing counted classes (xgrammar: cubic-ish)
        return "(" + "|".join(f"[a-z]{{{i}}}w{i:04d}x" for i in range(200)) + ")"
    # llguidance is linear in the grammar's size: 1,000,000 alternatives (a 20 MB regex)
    return "(" + "|".join(f"w{i:06d}x{i * 7919 % 1000003:07d}" for i in range(1_000_000)) + ")"


def _wait_for(condition, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.01)


@pytest.fixture(params=["outlines", "xgrammar", "llguidance"])
def backend_engine(request, tiny_engine, monkeypatch):
    """The shared tiny engine with its grammars on ``backend`` and a short compile timeout (what
    ``Engine(grammar_backend=..., grammar_compile_timeout=...)`` builds; a new engine per backend
    would cost seconds of start-up each)."""
    from radixlang.runtime.scheduler.grammar_wait import GrammarWaits

    scheduler = tiny_engine.scheduler
    waits = GrammarWaits(tokenizer=scheduler.tokenizer, vocab_size=scheduler.runner.vocab_size,
                         eos_ids=scheduler.eos_ids, timeout_s=COMPILE_TIMEOUT_S, whitespace_pattern=None,
                         backend=request.param)
    monkeypatch.setattr(scheduler, "grammars", waits)
    yield request.param, tiny_engine
    waits.close()


def test_slow_grammar_neither_stalls_the_server_nor_outlives_its_request(backend_engine):
    backend, engine = backend_engine
    engine.generate("warm", {"regex": "ab", "max_new_tokens": 2})  # the compile worker is up
    workers = engine.scheduler.grammar_compiler.workers
    result: dict = {}
    hostile = threading.Thread(target=lambda: result.update(
        out=engine.generate("x", {"regex": _hostile_regex(backend), "max_new_tokens": 4})))
    hostile.start()
    _wait_for(lambda: workers.num_compiling() == 1)
    [pid] = workers.compiling_pids()

    started = time.monotonic()
    plain = engine.generate("plain", {"max_new_tokens": 4, "temperature": 0})
    assert time.monotonic() - started < PLAIN_BOUND_S
    assert plain["meta_info"]["finish_reason"]["type"] == "length"
    assert "out" not in result  # answered while the slow grammar was still compiling

    hostile.join(timeout=120)
    reason = result["out"]["meta_info"]["finish_reason"]
    assert reason["type"] == "abort" and reason["status_code"] == 400, reason
    assert f"longer than {COMPILE_TIMEOUT_S:g}s" in reason["message"], reason
    # nothing compiles on after the request failed: the worker that held the grammar is gone
    assert workers.num_compiling() == 0
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    ok = engine.generate("again", {"regex": "[ab]{3}", "max_new_tokens": 8})  # a fresh worker serves
    assert ok["meta_info"]["finish_reason"]["type"] == "stop" and len(ok["text"]) == 3
