"""Streaming: text_iter / text_async_iter deltas join to the final text."""
from __future__ import annotations

import asyncio

import radixlang.lang as sgl
from fake_backend import FakeBackend


def story():
    @sgl.function
    def prog(s, topic):
        s += "Story about " + topic + ":"
        s += sgl.gen("story", max_tokens=20)
        s += " The end."
        s += sgl.gen("moral")
    return prog


def test_stream_deltas_concatenate_to_final_text():
    be = FakeBackend(lambda t, p: " once upon a time" if t.endswith(":") else " be kind")
    state = story().run(topic="cats", stream=True, backend=be)
    deltas = list(state.text_iter())
    assert len(deltas) > 4  # the fake backend streams two characters at a time
    assert "".join(deltas) == state.text() == "Story about cats: once upon a time The end. be kind"


def test_stream_one_variable():
    be = FakeBackend(lambda t, p: " once upon a time" if t.endswith(":") else " be kind")
    state = story().run(topic="cats", stream=True, backend=be)
    parts = list(state.text_iter("story"))
    assert "".join(parts) == " once upon a time" == state["story"]
    assert len(parts) > 1
    assert "".join(state.text_iter("moral")) == " be kind"


def test_async_iter():
    be = FakeBackend(lambda t, p: "abcdef")
    state = story().run(topic="dogs", stream=True, backend=be)

    async def collect():
        return [d async for d in state.text_async_iter("story")]

    parts = asyncio.run(collect())
    assert "".join(parts) == "abcdef" and len(parts) == 3


def test_text_iter_on_finished_non_stream_state_and_var_scope():
    be = FakeBackend(lambda t, p: "XY")

    @sgl.function
    def prog(s):
        with s.var_scope("v"):
            s += "a" + sgl.gen("g")
    state = prog.run(backend=be)
    assert "".join(state.text_iter()) == "aXY"
    assert list(state.text_iter("v")) == ["aXY"]


def test_stream_error_ends_iteration():
    be = FakeBackend(fail_on="boom")

    @sgl.function
    def prog(s):
        s += "boom" + sgl.gen("x")

    state = prog.run(stream=True, backend=be)
    assert "".join(state.text_iter()) == "boom"
    state.wait()
    assert isinstance(state.error(), RuntimeError)
