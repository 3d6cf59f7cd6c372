"""fork/join, run_batch (order, prefix precache, progress bar, errors), trace."""
from __future__ import annotations

import pytest

import radixlang.lang as sgl
from fake_backend import FakeBackend


def echo_tail(text, params):
    return "[" + text[-3:] + "]"


def test_fork_branches_share_prefix_and_join_gathers():
    be = FakeBackend(echo_tail)

    @sgl.function
    def tips(s, topic):
        s += f"Tips on {topic}:"
        forks = s.fork(3)
        forks += lambda i: f" #{i}"
        for f in forks:
            f += sgl.gen("tip")
        assert [f["tip"] for f in forks] == ["[ #0]", "[ #1]", "[ #2]"]
        forks.join()
        s += " done"

    state = tips.run(topic="tea", backend=be)
    assert state["tip"] == ["[ #0]", "[ #1]", "[ #2]"]
    assert state.text() == "Tips on tea: done"
    assert be.of_kind("cache_prefix") == ["Tips on tea:"]  # the shared prefix is prefilled once
    prompts = sorted(t for t, _, _ in be.of_kind("generate"))
    assert prompts == ["Tips on tea: #0", "Tips on tea: #1", "Tips on tea: #2"]


def test_fork_iadd_list_and_expr_and_concate_join():
    be = FakeBackend(lambda t, p: "")

    @sgl.function
    def prog(s):
        s += "P"
        f = s.fork(2)
        f += ["a", "b"]
        f += "!"
        f.join("concate_join")

    assert prog.run(backend=be).text() == "Pa!b!"
    with pytest.raises(ValueError, match="one expression per branch"):
        @sgl.function
        def bad(s):
            s.fork(2).__iadd__(["only one"])
        bad.run(backend=be)


def test_fork_of_one_does_not_precache():
    be = FakeBackend()

    @sgl.function
    def prog(s):
        s += "x"
        f = s.fork(1)
        f[0] += sgl.gen("g")
        f.join()

    prog.run(backend=be)
    assert be.of_kind("cache_prefix") == []


def test_branch_error_reaches_parent():
    be = FakeBackend(fail_on="bad")

    @sgl.function
    def prog(s):
        f = s.fork(2)
        f += lambda i: "bad" if i else "good"
        f += sgl.gen("g")
        f.join()

    state = prog.run(backend=be)
    assert isinstance(state.error(), RuntimeError)


def few_shot():
    @sgl.function
    def qa(s, question):
        s += "You answer questions.\nQ: 1+1?\nA: 2\n"
        s += "Q: " + question + "\nA:" + sgl.gen("answer", stop="\n")
    return qa


def test_run_batch_order_prefix_and_dict_or_tuple_items():
    be = FakeBackend(lambda t, p: " " + t.split("Q: ")[-1].split("\n")[0].upper())
    qa = few_shot()
    states = qa.run_batch([{"question": f"q{i}"} for i in range(12)] + [("tuple",)], backend=be, temperature=0)
    assert [s["answer"] for s in states] == [f" Q{i}" for i in range(12)] + [" TUPLE"]
    assert be.of_kind("cache_prefix") == ["You answer questions.\nQ: 1+1?\nA: 2\n"]
    assert all(p.sampling_params["temperature"] == 0 for _, p, _ in be.of_kind("generate"))


def test_run_batch_generator_style_and_threads():
    be = FakeBackend(lambda t, p: "x")
    qa = few_shot()
    it = qa.run_batch([{"question": str(i)} for i in range(5)], backend=be, generator_style=True, num_threads=2)
    assert not isinstance(it, list)
    assert [s.text().split("Q: ")[-1][0] for s in it] == ["0", "1", "2", "3", "4"]
    with pytest.raises(ValueError, match="num_threads"):
        qa.run_batch([{"question": "a"}], backend=be, num_threads=0)
    with pytest.raises(TypeError, match="run_batch items"):
        qa.run_batch(["bare string"], backend=be)


def test_run_batch_progress_bar(capsys):
    be = FakeBackend()
    states = few_shot().run_batch([{"question": "a"}, {"question": "b"}], backend=be, progress_bar=True)
    assert len(states) == 2
    assert "2/2" in capsys.readouterr().err


def test_run_batch_keeps_errors_per_state():
    be = FakeBackend(fail_on="Q: bad")

    @sgl.function
    def prog(s, question):
        if question == "raise":
            raise KeyError("body failed")
        s += "Q: " + question + sgl.gen("a")

    states = prog.run_batch([{"question": "ok"}, {"question": "bad"}, {"question": "raise"}], backend=be)
    assert states[0].error() is None and states[0]["a"]
    assert isinstance(states[1].error(), RuntimeError)
    assert isinstance(states[2].error(), KeyError)


def test_trace_stops_at_first_argument_or_model_call():
    be = FakeBackend()

    @sgl.function
    def prog(s, name, n):
        s += sgl.system("You are terse.")
        s += "Hello"
        s += " " + name
        s += sgl.gen("x")

    res = prog.trace(backend=be)
    assert res.prefix == "SYSTEM:You are terse.\nHello"
    assert res.stopped_at == "argument name"
    assert res.messages == [{"role": "system", "content": "You are terse."}]
    bound = prog.bind(name="Ann").trace(backend=be)
    assert bound.prefix == "SYSTEM:You are terse.\nHello Ann" and bound.stopped_at == "gen"
    assert be.calls == []  # tracing never calls the model


def test_trace_handles_fstring_and_control_flow_on_args():
    @sgl.function
    def prog(s, flag):
        s += "const "
        if flag:
            s += "yes"

    @sgl.function
    def fmt(s, x):
        s += "A "
        s += f"{x}"

    assert prog.trace(backend=FakeBackend()).prefix == "const "
    assert fmt.trace(backend=FakeBackend()).prefix == "A "
