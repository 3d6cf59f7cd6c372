"""gen / select / roles / variables / nested programs / errors on a scripted backend."""
from __future__ import annotations

import threading

import pytest

import radixlang.lang as sgl
from radixlang.lang import ir
from fake_backend import FakeBackend


def test_gen_appends_and_stores_variable():
    be = FakeBackend(lambda text, p: " Paris")

    @sgl.function
    def prog(s, country):
        s += "The capital of " + country + " is" + sgl.gen("capital", max_tokens=5)

    state = prog.run(country="France", backend=be)
    assert state["capital"] == " Paris"
    assert state.text() == "The capital of France is Paris"
    text, params, _ = be.of_kind("generate")[0]
    assert text == "The capital of France is"
    assert params.sampling_params["max_new_tokens"] == 5
    assert state.error() is None


def test_gen_inherits_run_defaults_and_overrides_them():
    be = FakeBackend()

    @sgl.function
    def prog(s):
        s += sgl.gen("a")
        s += sgl.gen("b", temperature=0.5, stop="\n", top_k=3, return_logprob=True, top_logprobs_num=2)

    prog.run(backend=be, max_new_tokens=7, temperature=0.0, stop=["END"], top_p=0.9)
    (_, a, _), (_, b, _) = be.of_kind("generate")
    assert a.sampling_params == {"max_new_tokens": 7, "temperature": 0.0, "top_p": 0.9, "top_k": -1,
                                 "min_p": 0.0, "frequency_penalty": 0.0, "presence_penalty": 0.0,
                                 "ignore_eos": False, "stop": ["END"]}
    assert not a.return_logprob
    assert b.sampling_params["temperature"] == 0.5 and b.sampling_params["stop"] == ["\n"]
    assert b.sampling_params["top_k"] == 3 and b.sampling_params["max_new_tokens"] == 7
    assert b.return_logprob and b.top_logprobs_num == 2
    assert b.to_payload("x")["return_logprob"] is True


@pytest.mark.parametrize("dtype,regex", [(int, ir.REGEX_INT), ("float", ir.REGEX_FLOAT), (bool, ir.REGEX_BOOL),
                                         (str, ir.REGEX_STR)])
def test_dtype_maps_to_regex(dtype, regex):
    assert sgl.gen("x", dtype=dtype).sampling["regex"] == regex


def test_gen_int_gen_string_and_json_schema():
    assert sgl.gen_int("n").sampling["regex"] == ir.REGEX_INT
    assert sgl.gen_string("n").sampling["regex"] == ir.REGEX_STR
    g = sgl.gen("j", json_schema={"type": "object"})
    assert g.sampling["json_schema"] == '{"type": "object"}'
    with pytest.raises(ValueError, match="dtype"):
        sgl.gen("x", dtype=list)
    with pytest.raises(ValueError, match="at most one"):
        sgl.gen("x", dtype=int, regex="a")


def test_select_picks_best_scored_and_gen_choices_is_select():
    be = FakeBackend(score_fn=lambda text, c, i: -0.1 if c == "blue" else -2.0)

    @sgl.function
    def prog(s):
        s += "Sky: " + sgl.select("color", ["red", "blue", "green"])
        s += " Again: " + sgl.gen("again", choices=["red", "blue"])

    state = prog.run(backend=be)
    assert state["color"] == "blue" and state["again"] == "blue"
    assert state.text() == "Sky: blue Again: blue"
    meta = state.get_meta_info("color")
    assert meta["normalized_prompt_logprobs"] == pytest.approx([-2.0, -0.1, -2.0])
    first = be.of_kind("select")[0]
    assert first[0] == "Sky: " and first[3] is sgl.token_length_normalized
    with pytest.raises(ValueError, match="choices"):
        sgl.select("x", [])


def test_select_method_is_forwarded():
    be = FakeBackend()

    @sgl.function
    def prog(s):
        s += sgl.select("c", ["a", "b"], choices_method=sgl.greedy_token_selection)

    prog.run(backend=be)
    assert be.of_kind("select")[0][3] is sgl.greedy_token_selection


def test_var_scope_and_set_var():
    be = FakeBackend(lambda t, p: "X")

    @sgl.function
    def prog(s):
        with s.var_scope("block"):
            s += "a" + sgl.gen("g") + "b"
        s.set_var("k", 42)

    state = prog.run(backend=be)
    assert state["block"] == "aXb" and state["k"] == 42


def test_nested_function_runs_inline():
    be = FakeBackend(lambda t, p: "!")

    @sgl.function
    def inner(s, word):
        s += word + sgl.gen("inner_out")

    @sgl.function
    def outer(s):
        s += "start "
        s += inner("hello")  # a sub-program expression
        inner(s, " bye")  # called on the state directly
        s += " end"

    state = outer.run(backend=be)
    assert state.text() == "start hello! bye! end"
    assert state["inner_out"] == "!"


def test_bind_and_positional_args():
    be = FakeBackend(lambda t, p: "")

    @sgl.function
    def prog(s, a, b):
        s += f"{a}-{b}"

    assert prog.bind(b="B").run("A", backend=be).text() == "A-B"
    with pytest.raises(TypeError, match="no argument"):
        prog.bind(c=1)


def test_body_runs_ahead_of_generation_and_getitem_waits():
    gate = threading.Event()
    be = FakeBackend(lambda t, p: "late", gate=gate)
    seen = []

    @sgl.function
    def prog(s):
        s += sgl.gen("x")
        seen.append("after submit")  # reached while generate is blocked
        gate.set()
        seen.append(s["x"])

    prog.run(backend=be)
    assert seen == ["after submit", "late"]


def test_backend_error_surfaces_in_error_and_getitem():
    be = FakeBackend(fail_on="boom")

    @sgl.function
    def prog(s):
        s += "boom" + sgl.gen("x") + sgl.gen("y")

    state = prog.run(backend=be)
    assert isinstance(state.error(), RuntimeError)
    with pytest.raises(RuntimeError, match="scripted failure"):
        state["y"]
    assert len(be.of_kind("generate")) == 1  # nodes after the failure are skipped


def test_error_read_inside_body_raises_from_run():
    be = FakeBackend(fail_on="boom")

    @sgl.function
    def prog(s):
        s += "boom" + sgl.gen("x")
        s += s["x"]

    with pytest.raises(RuntimeError, match="scripted failure"):
        prog.run(backend=be)


def test_missing_variable_is_keyerror_not_hang():
    @sgl.function
    def prog(s):
        s += "hi"

    state = prog.run(backend=FakeBackend())
    with pytest.raises(KeyError, match="nope"):
        state["nope"]


def test_no_backend_is_a_clear_error():
    @sgl.function
    def prog(s):
        s += "x"

    old = sgl.get_default_backend()
    sgl.set_default_backend(None)
    try:
        with pytest.raises(ValueError, match="no backend"):
            prog.run()
    finally:
        sgl.set_default_backend(old)


def test_set_default_backend_and_module_helpers():
    be = FakeBackend(lambda t, p: "d")
    old = sgl.get_default_backend()
    sgl.set_default_backend(be)
    try:
        @sgl.function(num_api_spec_tokens=8)
        def prog(s):
            s += sgl.gen("x")
        assert prog.run()["x"] == "d"
        assert sgl.flush_cache() is True
        assert sgl.get_server_info() == {"fake": True}
    finally:
        sgl.set_default_backend(old)


def test_raw_engine_like_object_is_wrapped():
    from radixlang.lang.backends.engine import EngineBackend
    from radixlang.lang.context import as_backend

    class FakeEngine:
        tokenizer = None

        def generate(self, **kw):
            return {"text": "E", "meta_info": {"finish_reason": {"type": "length"}}}

        def flush_cache(self):
            return True

        def get_server_info(self):
            return {}

    wrapped = as_backend(FakeEngine())
    assert isinstance(wrapped, EngineBackend)
    with pytest.raises(TypeError, match="Backend or a radixlang Engine"):
        as_backend(object())


@pytest.mark.parametrize("model_type,reply,reasoning,answer", [
    ("deepseek-r1", "Two plus two.\n</think>\n\n4", "Two plus two.\n", "4"),
    ("qwen3", "<think>Add them.</think>4", "Add them.", "4"),
    ("qwen3", "4", "", "4"),
])
def test_separate_reasoning_splits_the_gen_variable(model_type, reply, reasoning, answer):
    be = FakeBackend(lambda text, p: reply)

    @sgl.function
    def prog(s):
        s += "Q: 2+2?\nA:" + sgl.separate_reasoning(sgl.gen("answer", max_tokens=32), model_type=model_type)
        s += " Then:" + sgl.gen("more", max_tokens=2)

    state = prog.run(backend=be)
    assert state["answer"] == answer
    assert state["answer_reasoning_content"] == reasoning
    assert state.text().startswith("Q: 2+2?\nA:" + answer + " Then:")
    assert be.of_kind("generate")[1][0] == "Q: 2+2?\nA:" + answer + " Then:"


def test_separate_reasoning_refuses_what_it_cannot_split():
    with pytest.raises(TypeError, match="named gen"):
        sgl.separate_reasoning(sgl.gen(max_tokens=3))
    with pytest.raises(ValueError, match="model_type"):
        sgl.separate_reasoning(sgl.gen("x"), model_type="nope")
