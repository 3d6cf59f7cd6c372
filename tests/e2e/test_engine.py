"""The Engine end to end on the tiny random model (and SmolLM2 for the greedy reference)."""
from __future__ import annotations

import random

import pytest
import torch

from radixlang.runtime.sampling.sampling_params import SamplingParams
from radixlang import Engine

pytestmark = pytest.mark.e2e

GREEDY = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 49000) for _ in range(rng.randrange(1, 120))] for _ in range(n)]


@pytest.fixture(autouse=True)
def _no_leak(request):
    yield
    if "tiny_engine" in request.fixturenames:
        engine = request.getfixturevalue("tiny_engine")
        engine.check_memory_leak()


def test_batch_equals_alone(tiny_engine):
    prompts = _prompts(16)
    together = tiny_engine.generate(input_ids=prompts, sampling_params=GREEDY)
    for ids, out in zip(prompts, together):
        alone = tiny_engine.generate(input_ids=ids, sampling_params=GREEDY)
        assert alone["output_ids"] == out["output_ids"]
        assert out["meta_info"]["completion_tokens"] == 12
        assert out["meta_info"]["prompt_tokens"] == len(ids)


def test_chunked_prefill_matches_whole(tiny_model_dir):
    prompt = _prompts(1, seed=5)[0] + _prompts(1, seed=6)[0] * 3
    params = {**GREEDY, "max_new_tokens": 4}
    kw = {"model_path": tiny_model_dir, "load_format": "dummy", "max_total_tokens": 4096}
    with Engine(**kw, chunked_prefill_size=-1) as whole, Engine(**kw, chunked_prefill_size=16) as chunked:
        a = whole.generate(input_ids=prompt, sampling_params=params, return_logprob=True, logprob_start_len=0)
        b = chunked.generate(input_ids=prompt, sampling_params=params, return_logprob=True, logprob_start_len=0)
        chunked.check_memory_leak()
    assert a["output_ids"] == b["output_ids"]
    la = [x[0] for x in a["meta_info"]["input_token_logprobs"][1:]]
    lb = [x[0] for x in b["meta_info"]["input_token_logprobs"][1:]]
    assert len(la) == len(prompt) - 1
    assert torch.allclose(torch.tensor(la), torch.tensor(lb), atol=1e-4)


def test_seed_reproducible_in_any_batch(tiny_engine):
    params = {"temperature": 1.0, "max_new_tokens": 10, "sampling_seed": 1234, "ignore_eos": True}
    prompt = [5, 6, 7, 8]
    alone = tiny_engine.generate(input_ids=prompt, sampling_params=params)["output_ids"]
    others = [{"temperature": 1.0, "max_new_tokens": 10, "ignore_eos": True} for _ in range(5)]
    batch = tiny_engine.generate(input_ids=[prompt] + _prompts(5, seed=9), sampling_params=[params] + others)
    assert batch[0]["output_ids"] == alone
    other_seed = tiny_engine.generate(input_ids=prompt, sampling_params={**params, "sampling_seed": 99})
    assert other_seed["output_ids"] != alone


def test_max_new_tokens_n_and_logprobs(tiny_engine):
    outs = tiny_engine.generate("hello world", {"max_new_tokens": 5, "n": 3, "temperature": 1.0, "ignore_eos": True})
    assert len(outs) == 3 and all(len(o["output_ids"]) == 5 for o in outs)
    assert all(o["meta_info"]["finish_reason"] == {"type": "length", "length": 5} for o in outs)
    out = tiny_engine.generate("a b c d e f", {"max_new_tokens": 3, "temperature": 0}, return_logprob=True,
                               logprob_start_len=2, top_logprobs_num=2)
    meta = out["meta_info"]
    assert meta["prompt_tokens"] == 2 + len(meta["input_token_logprobs"])
    # position 2 has a left context: its token is scored, as over HTTP (only position 0 reports None)
    assert all(lp is not None and lp <= 0 for lp, _, _ in meta["input_token_logprobs"])
    assert all(lp <= 0 for lp, _, _ in meta["output_token_logprobs"])
    # greedy: the chosen token is the top-1 of its row
    for (lp, tid, _), top in zip(meta["output_token_logprobs"], meta["output_top_logprobs"]):
        assert top[0][1] == tid and abs(top[0][0] - lp) < 1e-5


def test_prefill_only(tiny_engine):
    out = tiny_engine.generate("score me please", {"max_new_tokens": 0}, return_logprob=True, logprob_start_len=0)
    assert out["output_ids"] == [] and out["meta_info"]["finish_reason"]["type"] == "length"
    assert len(out["meta_info"]["input_token_logprobs"]) == out["meta_info"]["prompt_tokens"]


def test_stop_string_and_token(tiny_engine):
    base = tiny_engine.generate("1 2 3", {"max_new_tokens": 20, "temperature": 0, "ignore_eos": True})
    text = base["text"]
    assert len(text) > 6
    stop = text[3:6]  # almost surely spans a token boundary in random-weight output
    out = tiny_engine.generate("1 2 3", {"max_new_tokens": 20, "temperature": 0, "ignore_eos": True, "stop": stop})
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert out["text"] == text[:text.find(stop)]
    keep = tiny_engine.generate("1 2 3", {"max_new_tokens": 20, "temperature": 0, "ignore_eos": True, "stop": stop,
                                          "no_stop_trim": True})
    assert keep["text"].startswith(text[:text.find(stop)] + stop)
    tok = base["output_ids"][4]
    out = tiny_engine.generate("1 2 3", {"max_new_tokens": 20, "temperature": 0, "stop_token_ids": [tok]})
    assert out["output_ids"][-1] == tok and out["meta_info"]["finish_reason"] == {"type": "stop", "matched": tok}


def test_streaming_concatenates_and_utf8(tiny_engine):
    params = {"max_new_tokens": 24, "temperature": 1.0, "sampling_seed": 7, "ignore_eos": True}
    full = tiny_engine.generate("héllo 世界", params)
    chunks = list(tiny_engine.generate("héllo 世界", params, stream=True))
    texts = [c["text"] for c in chunks]
    assert texts[-1] == full["text"]
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:]))  # cumulative, never rewritten
    assert all("\ufffd" not in t for t in texts[:-1])


def test_ignore_eos_and_eos(tiny_engine):
    eos = tiny_engine.tokenizer.eos_token_id
    out = tiny_engine.generate(input_ids=[1, 2, 3], sampling_params={"max_new_tokens": 6, "temperature": 0,
                                                                     "stop_token_ids": [], "ignore_eos": True})
    assert len(out["output_ids"]) == 6
    assert isinstance(eos, int)


def test_bad_input_is_an_error_not_a_crash(tiny_engine):
    with pytest.raises(ValueError, match="top_p"):
        tiny_engine.generate("x", {"top_p": 1.5})
    with pytest.raises(ValueError, match="unknown sampling parameter"):
        tiny_engine.generate("x", {"max_tokens": 3})
    out = tiny_engine.generate(input_ids=[10 ** 9], sampling_params={"max_new_tokens": 2})
    assert out["meta_info"]["finish_reason"]["type"] == "abort"
    assert "input_ids" in out["meta_info"]["finish_reason"]["message"]
    with pytest.raises(TypeError):
        Engine(model_pathh="x")
    assert tiny_engine.generate("still alive", {"max_new_tokens": 2})["meta_info"]["completion_tokens"] == 2


def test_kv_exhaustion_retracts_and_finishes(tiny_model_dir):
    prompts = _prompts(12, seed=3)
    params = {"temperature": 0, "max_new_tokens": 40, "ignore_eos": True}
    with Engine(model_path=tiny_model_dir, load_format="dummy", max_total_tokens=8192) as big:
        ref = big.generate(input_ids=prompts, sampling_params=params)
    with Engine(model_path=tiny_model_dir, load_format="dummy", max_total_tokens=400) as small:
        outs = small.generate(input_ids=prompts, sampling_params=params)
        info = small.get_server_info()
        small.check_memory_leak()
    assert info["num_retractions"] > 0
    assert [o["output_ids"] for o in outs] == [r["output_ids"] for r in ref]


def test_chunked_prefill_under_kv_pressure_keeps_its_place(tiny_model_dir):
    # A decodes until the 400-token pool cannot also hold B's 250-token prompt; B's 32-token chunks
    # then stall mid-prompt. B must wait as the chunked request (it was once dropped from every
    # queue) and finish once A's KV frees up, with the same tokens as on a big pool.
    from radixlang.runtime.server_args import ServerArgs
    from radixlang.runtime.io_struct import TokenizedGenerateReq
    from radixlang.runtime.scheduler.build import build_scheduler

    prompt_a, prompt_b = list(range(10, 70)), list(range(100, 350))
    params_a = {"temperature": 0, "max_new_tokens": 150, "ignore_eos": True}
    params_b = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}
    kw = dict(model_path=tiny_model_dir, load_format="dummy")
    with Engine(**kw, max_total_tokens=8192) as big:
        ref_a = big.generate(input_ids=prompt_a, sampling_params=params_a)["output_ids"]
        ref_b = big.generate(input_ids=prompt_b, sampling_params=params_b)["output_ids"]
    s = build_scheduler(ServerArgs(**kw, max_total_tokens=400, chunked_prefill_size=32))
    s.add_request(TokenizedGenerateReq(rid="a", input_ids=prompt_a, sampling_params=SamplingParams.from_dict(params_a)))
    while not s.running or len(s.running[0].output_ids) < 100:
        s.step()
    s.add_request(TokenizedGenerateReq(rid="b", input_ids=prompt_b, sampling_params=SamplingParams.from_dict(params_b)))
    stalled, outputs = 0, {}
    for _ in range(2000):
        if s.is_idle():
            break
        b = s.chunked_req
        before = b.kv_len if b is not None else None
        out = s.step()
        if b is not None and b.rid == "b" and s.chunked_req is b and b.kv_len == before:
            stalled += 1  # a step went by (A decoded) while B's next chunk waited for room
        for row in out.rows if out else []:
            outputs.setdefault(row.rid, []).extend(row.output_ids)
    assert s.is_idle()
    s.check_memory_leak()
    assert stalled > 0
    assert outputs["b"] == ref_b and len(outputs["a"]) == 150 and outputs["a"] == ref_a


def test_abort(tiny_engine):
    it = tiny_engine.generate("abort me", {"max_new_tokens": 200, "ignore_eos": True}, stream=True, rid="to-abort")
    first = next(it)
    tiny_engine.abort_request("to-abort")
    last = list(it)[-1] if True else first
    assert last["meta_info"]["finish_reason"]["type"] == "abort"
    assert len(last["output_ids"]) < 200


def test_flush_cache_when_idle(tiny_engine):
    assert tiny_engine.flush_cache() is True
