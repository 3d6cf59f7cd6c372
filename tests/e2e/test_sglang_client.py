"""SGLang's own frontend (``import sglang as sgl``, its RuntimeEndpoint) driving our server.

The Makefile installs sglang's wheel without its dependencies (its frontend needs only a few
pure-Python packages: aiohttp, pybase64, ipython, listed in the dev extras). Each program is one a
user of SGLang writes; the answers are checked against our own /generate."""
from __future__ import annotations

import math
import re

import httpx
import pytest

from tests.live_server import live_server

sgl = pytest.importorskip("sglang")
pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def backend(tiny_model_dir):
    with live_server(tiny_model_dir) as url:
        endpoint = sgl.RuntimeEndpoint(url)
        endpoint.url = url
        yield endpoint


def _greedy(url: str, text: str, max_new_tokens: int) -> str:
    r = httpx.post(url + "/generate", json={"text": text, "sampling_params": {"max_new_tokens": max_new_tokens,
                                                                                "temperature": 0}}, timeout=60)
    r.raise_for_status()
    return r.json()["text"]


@sgl.function
def _qa(s, question):
    s += "Question: " + question + "\nAnswer:"
    s += sgl.gen("answer", max_tokens=6, temperature=0)


def test_gen_matches_our_generate(backend):
    state = _qa.run(question="What is 2+2?", backend=backend)
    assert state["answer"] == _greedy(backend.url, "Question: What is 2+2?\nAnswer:", 6)
    assert state.get_meta_info("answer")["completion_tokens"] == 6


@pytest.mark.parametrize("method", ["token_length_normalized", "greedy_token_selection",
                                    "unconditional_likelihood_normalized"])
def test_select_every_choices_method(backend, method):
    choices = ["red", "green apple", "blue sky today"]

    @sgl.function
    def pick(s):
        s += "My favourite colour is"
        s += sgl.select("colour", choices=[" " + c for c in choices], choices_method=getattr(sgl, method))

    state = pick.run(backend=backend)
    decision = state["colour"]
    assert decision.strip() in choices
    meta = state.get_meta_info("colour")
    scores = meta["normalized_prompt_logprobs"]
    assert len(scores) == 3 and all(math.isfinite(x) and x < 0 for x in scores)
    # the token texts came back (return_text_in_logprobs): each choice's tokens spell the choice
    for c, entries in zip(choices, meta["input_token_logprobs"]):
        assert all(isinstance(e[2], str) for e in entries)
        assert "".join(e[2] for e in entries).endswith(c)
        # every entry is the real logprob of its token, as a request for the whole prompt's logprobs says
        whole = httpx.post(backend.url + "/generate", json={
            "text": "My favourite colour is " + c, "sampling_params": {"max_new_tokens": 0},
            "return_logprob": True, "logprob_start_len": 0}, timeout=60).json()["meta_info"]["input_token_logprobs"]
        tail = whole[len(whole) - len(entries):]
        assert [e[1] for e in tail] == [e[1] for e in entries]
        assert [e[0] for e in tail] == pytest.approx([e[0] for e in entries], abs=1e-4)
    if method == "token_length_normalized":
        assert decision == " " + choices[max(range(3), key=lambda i: scores[i])]
    if method == "unconditional_likelihood_normalized":
        assert len(meta["unconditional_token_logprobs"]) == 3


def test_regex_gen(backend):
    @sgl.function
    def digits(s):
        s += "The code is "
        s += sgl.gen("code", regex=r"[0-9]{3}-[a-z]{2}", max_tokens=16, temperature=1.0)

    for _ in range(3):
        assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", digits.run(backend=backend)["code"])


def test_fork_and_run_batch(backend):
    @sgl.function
    def branches(s):
        s += "List two tips:\n"
        forks = s.fork(2)
        for i, f in enumerate(forks):
            f += f"Tip {i + 1}:" + sgl.gen("tip", max_tokens=4, temperature=0)
        forks.join()
        s += "Tip A:" + forks[0]["tip"] + "\nTip B:" + forks[1]["tip"]

    state = branches.run(backend=backend)
    for i in range(2):
        assert _greedy(backend.url, f"List two tips:\nTip {i + 1}:", 4) in state.text()
    states = _qa.run_batch([{"question": "One?"}, {"question": "Two?"}, {"question": "Three?"}], backend=backend)
    assert [s["answer"] for s in states] == [_greedy(backend.url, f"Question: {q}\nAnswer:", 6)
                                             for q in ("One?", "Two?", "Three?")]


def test_streaming(backend):
    state = _qa.run(question="Stream me", backend=backend, stream=True)
    pieces = list(state.text_iter("answer"))
    assert len(pieces) > 1
    assert "".join(pieces) == state["answer"] == _greedy(backend.url, "Question: Stream me\nAnswer:", 6)


def _two_turns(lang):
    @lang.function
    def chat(s, q1, q2):
        s += lang.system("You are a helpful assistant.")
        s += lang.user(q1)
        s += lang.assistant(lang.gen("a1", max_tokens=32))
        s += lang.user(q2)
        s += lang.assistant(lang.gen("a2", max_tokens=32))
    return chat


def test_multi_turn_chat_on_smollm(smollm_path):
    """SGLang's client picks its chat template by the model's name; SmolLM2 (ChatML) has no entry there, so a
    user names it (docs: README, "SGLang's client"). With it, a two-turn chat's messages are its answers, and
    the answers are what radixlang's own DSL gets from the same server with the model's own template."""
    import radixlang

    questions = [{"q1": "What is 2+2?", "q2": "And 3+3?"}, {"q1": "Tell me a joke", "q2": "Another one"}]
    with live_server(smollm_path, load_format="auto") as url:
        ours = _two_turns(radixlang).run_batch(questions, backend=radixlang.RuntimeEndpoint(url), temperature=0)
        for temperature in (0, 1.0):
            endpoint = sgl.RuntimeEndpoint(url, chat_template_name="chatml")
            states = _two_turns(sgl).run_batch(questions, backend=endpoint, temperature=temperature)
            for state, own in zip(states, ours):
                messages = state.messages()
                assert [m["role"] for m in messages] == ["system", "user", "assistant", "user", "assistant"]
                assert messages[2]["content"] == state["a1"] and messages[4]["content"] == state["a2"]
                assert "<|im_" not in state["a1"] + state["a2"]
                if temperature == 0:
                    assert (state["a1"], state["a2"]) == (own["a1"], own["a2"])
