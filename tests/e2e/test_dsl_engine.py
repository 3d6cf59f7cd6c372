"""DSL programs on the in-process Engine (tiny random model), and the same over HTTP."""
from __future__ import annotations

import importlib.util
import json

import pytest

import radixlang.lang as sgl
from radixlang.lang.backends.engine import EngineBackend

pytestmark = pytest.mark.e2e
PREFIX = "You are a careful assistant. Answer each question with one word.\nExample: sky -> blue\n"


@pytest.fixture(scope="module")
def backend(tiny_engine):
    return EngineBackend(tiny_engine)


def _ids(backend, text):
    return backend.tokenizer.encode(text, add_special_tokens=False)


def test_gen_select_roles_run(backend):
    @sgl.function
    def prog(s, q):
        s += sgl.system("Be brief.")
        s += sgl.user(q)
        s += sgl.assistant(sgl.gen("answer", max_tokens=6))
        s += sgl.user("yes or no?") + sgl.assistant(sgl.select("yn", ["yes", "no"]))

    state = prog.run(q="Is water wet?", backend=backend, temperature=0)
    assert state.error() is None
    assert state["yn"] in ("yes", "no")
    meta = state.get_meta_info("answer")
    assert meta["completion_tokens"] <= 6 and meta["prompt_tokens"] > 0
    msgs = state.messages()
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "user", "assistant"]
    assert msgs[2]["content"] == state["answer"] and msgs[4]["content"] == state["yn"]
    assert state.text().startswith("<|im_start|>system\nBe brief.<|im_end|>\n")  # SmolLM's template


def test_raw_engine_as_backend(tiny_engine):
    @sgl.function
    def prog(s):
        s += "Hello" + sgl.gen("x", max_tokens=3)

    a = prog.run(backend=tiny_engine, temperature=0)["x"]
    b = prog.run(backend=tiny_engine, temperature=0)["x"]
    assert a == b and len(a) > 0


def test_run_batch_prefix_computed_once(backend):
    @sgl.function
    def qa(s, word):
        s += PREFIX
        s += word + " ->" + sgl.gen("answer", max_tokens=2)

    assert qa.trace(backend=backend).prefix == PREFIX
    prefix_len = len(_ids(backend, PREFIX))
    states = qa.run_batch([{"word": w} for w in [f"thing{i}" for i in range(16)]], backend=backend,
                          temperature=0)
    assert all(s.error() is None for s in states)
    cached = [s.get_meta_info("answer")["cached_tokens"] for s in states]
    assert all(c >= prefix_len for c in cached), (cached, prefix_len)
    assert [s.text().split("\n")[-1].split(" ->")[0] for s in states] == [f"thing{i}" for i in range(16)]


def test_fork_prefix_computed_once(backend):
    prefix = PREFIX + "Tips:\n"
    metas = []

    @sgl.function
    def tips(s):
        s += prefix
        forks = s.fork(4)
        forks += lambda i: f"{i + 1}."
        forks += sgl.gen("tip", max_tokens=2)
        metas.extend(f.get_meta_info("tip") for f in forks)
        forks.join()

    state = tips.run(backend=backend, temperature=0)
    assert state.error() is None and len(state["tip"]) == 4
    n = len(_ids(backend, prefix))
    assert all(m["cached_tokens"] >= n for m in metas), ([m["cached_tokens"] for m in metas], n)


@pytest.mark.parametrize("method", [sgl.token_length_normalized, sgl.greedy_token_selection,
                                    sgl.unconditional_likelihood_normalized])
def test_select_matches_separately_computed_scores(backend, tiny_engine, method):
    prefix = "The weather today is"
    choices = [" sunny", " rainy and cold", " windy"]
    decision = backend.select(prefix, choices, 0.0, method)
    p_ids = _ids(backend, prefix)
    means = []
    for c in choices:
        ids = _ids(backend, prefix + c)
        out = tiny_engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 0}, return_logprob=True,
                                   logprob_start_len=0)
        lps = [lp for lp, _, _ in out["meta_info"]["input_token_logprobs"]]
        common = next(i for i, (a, b) in enumerate(zip(p_ids + [-1], ids)) if a != b)
        means.append(sum(lps[common:]) / len(lps[common:]))
    assert decision.meta_info["normalized_prompt_logprobs"] == pytest.approx(means, abs=1e-4)
    if method is sgl.token_length_normalized:
        assert decision.decision == choices[max(range(3), key=lambda i: means[i])]
    assert decision.decision in choices


def test_streaming_on_engine(backend):
    @sgl.function
    def prog(s):
        s += "Once upon a time" + sgl.gen("story", max_tokens=12, ignore_eos=True)

    state = prog.run(backend=backend, stream=True, temperature=0)
    deltas = list(state.text_iter("story"))
    assert "".join(deltas) == state["story"] and len(deltas) > 1
    assert state.get_meta_info("story")["completion_tokens"] == 12


def _value(state, name):
    assert state.error() is None, state.error()
    return state[name]


def test_regex_and_json_gens(backend):
    @sgl.function
    def prog(s):
        s += "Number:" + sgl.gen_int("n", max_tokens=6)

    value = _value(prog.run(backend=backend, temperature=0), "n")
    assert value.strip().lstrip("+-").isdigit()

    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}}, "required": ["name"]}

    @sgl.function
    def js(s):
        s += "JSON:" + sgl.gen("j", max_tokens=40, json_schema=schema)

    out = _value(js.run(backend=backend, temperature=0), "j")
    assert isinstance(json.loads(out)["name"], str)


@pytest.mark.skipif(importlib.util.find_spec("radixlang.launch_server") is None, reason="no launch_server")
def test_runtime_endpoint_matches_engine(tiny_model_dir):
    from radixlang import Engine

    @sgl.function
    def prog(s, q):
        s += sgl.user(q) + sgl.assistant(sgl.gen("a", max_tokens=5) + sgl.select("c", [" yes", " no"]))

    with sgl.Runtime(model_path=tiny_model_dir, load_format="dummy", max_total_tokens=4096,
                     log_level="warning") as runtime:
        remote = prog.run(q="hi", backend=runtime, temperature=0)
        assert runtime.get_server_info()["max_total_tokens"] == 4096
    with Engine(model_path=tiny_model_dir, load_format="dummy", max_total_tokens=4096) as engine:
        local = prog.run(q="hi", backend=engine, temperature=0)
    assert remote.error() is None and local.error() is None
    assert (remote["a"], remote["c"]) == (local["a"], local["c"])
    assert remote.text() == local.text()
