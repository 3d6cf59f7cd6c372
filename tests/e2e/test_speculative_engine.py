"""Speculative decoding (n-gram drafts) end to end: greedy tokens are the same with it on and off.

Two tiny models cover the two paths of the draft check: the dummy-weight one falls into loops, so
its drafts are mostly accepted; the transformers-saved one rarely repeats, so drafts taken from a
prompt with repeated spans are mostly rejected. The embedded SmolLM copies a text, as in an
extraction prompt.
"""
from __future__ import annotations

import random

import pytest

from radixlang import Engine
from tests.tiny_model import make_tiny_safetensors_dir

pytestmark = pytest.mark.e2e

GREEDY = {"temperature": 0, "max_new_tokens": 40, "ignore_eos": True}
SPEC = {"speculative_algorithm": "ngram", "speculative_num_draft_tokens": 4}


def _repeating_prompts(n: int, seed: int) -> list[list[int]]:
    """Prompts that end with a span seen earlier in them, so the first steps already draft."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(n):
        span = [rng.randrange(1000, 30000) for _ in range(rng.randrange(4, 9))]
        filler = [rng.randrange(1000, 30000) for _ in range(rng.randrange(5, 30))]
        prompts.append(filler + span + filler[:3] + span)
    return prompts


@pytest.fixture(scope="module")
def saved_model_dir(tmp_path_factory) -> str:
    return make_tiny_safetensors_dir(str(tmp_path_factory.mktemp("spec_tiny")), num_layers=2, hidden=64, seed=5)


def _run(kw: dict, prompts: list[list[int]], params: dict | list[dict], **engine) -> tuple[list[list[int]], dict]:
    with Engine(**kw, **engine) as e:
        alone = [e.generate(input_ids=p, sampling_params=params if isinstance(params, dict) else params[i])
                 for i, p in enumerate(prompts)]
        batched = e.generate(input_ids=prompts, sampling_params=params)
        info = e.get_server_info()
        e.check_memory_leak()
    ids = [o["output_ids"] for o in alone]
    assert [o["output_ids"] for o in batched] == ids, "batched differs from alone"
    return ids, info


@pytest.mark.parametrize("which", ["dummy", "saved"])
def test_greedy_tokens_identical_alone_and_batched(which, tiny_model_dir, saved_model_dir):
    kw = ({"model_path": tiny_model_dir, "load_format": "dummy"} if which == "dummy"
          else {"model_path": saved_model_dir})
    prompts = _repeating_prompts(6, seed=1)
    ref, _ = _run(kw, prompts, GREEDY, max_total_tokens=4096)
    got, info = _run(kw, prompts, GREEDY, max_total_tokens=4096, **SPEC)
    assert got == ref
    assert info["spec_draft_tokens"] > 0
    if which == "dummy":  # loops: most drafts are right
        assert info["spec_accepted_tokens"] > info["spec_draft_tokens"] // 2
    else:  # a model that rarely repeats: rejections, and the step still appends the right token
        assert info["spec_accepted_tokens"] < info["spec_draft_tokens"]


def test_with_a_cached_prefix_and_mixed_sampling_params(tiny_model_dir):
    kw = {"model_path": tiny_model_dir, "load_format": "dummy"}
    base = _repeating_prompts(1, seed=2)[0]
    prompts = [base, base + [4000, 4001], base + [4000, 4002, 4003], base[:20]]
    # penalties and min_new_tokens take the one-row-at-a-time check; the others the batched argmax
    params = [GREEDY, {**GREEDY, "frequency_penalty": 0.5}, {**GREEDY, "min_new_tokens": 30, "ignore_eos": False},
              {**GREEDY, "repetition_penalty": 1.3}]
    ref, _ = _run(kw, prompts, params, max_total_tokens=4096)
    got, info = _run(kw, prompts, params, max_total_tokens=4096, **SPEC)
    assert got == ref
    assert info["cached_tokens"] > 0 and info["spec_accepted_tokens"] > 0


def test_under_a_regex_constraint(tiny_model_dir):
    kw = {"model_path": tiny_model_dir, "load_format": "dummy"}
    from transformers import AutoTokenizer
    prompt = AutoTokenizer.from_pretrained(tiny_model_dir).encode("codes: 123-456-123-456-123-456-123-")
    params = {"temperature": 0, "max_new_tokens": 40, "regex": r"([0-9]{3}-){6}[0-9]{3}"}
    ref, _ = _run(kw, [prompt], params, max_total_tokens=4096)
    got, info = _run(kw, [prompt], params, max_total_tokens=4096, **SPEC)
    assert got == ref
    assert info["spec_accepted_tokens"] > 0


def test_across_a_retraction(tiny_model_dir):
    kw = {"model_path": tiny_model_dir, "load_format": "dummy"}
    prompts = _repeating_prompts(12, seed=4)
    ref, _ = _run(kw, prompts, GREEDY, max_total_tokens=8192)
    with Engine(**kw, max_total_tokens=400, **SPEC) as e:
        outs = e.generate(input_ids=prompts, sampling_params=GREEDY)
        info = e.get_server_info()
        e.check_memory_leak()
    assert info["num_retractions"] > 0 and info["spec_accepted_tokens"] > 0
    assert [o["output_ids"] for o in outs] == ref


def test_streaming_sends_every_accepted_token(tiny_model_dir):
    prompt = _repeating_prompts(1, seed=6)[0]
    with Engine(model_path=tiny_model_dir, load_format="dummy", max_total_tokens=4096, **SPEC) as e:
        whole = e.generate(input_ids=prompt, sampling_params=GREEDY)
        chunks = list(e.generate(input_ids=prompt, sampling_params=GREEDY, stream=True))
    assert whole["meta_info"]["spec_accepted_tokens"] > 0
    assert chunks[-1]["output_ids"] == whole["output_ids"]
    assert "".join(c["text"][len(p["text"]):] for p, c in zip([{"text": ""}] + chunks, chunks)) == whole["text"]


def test_smollm_copying_a_text(smollm_path):
    doc = ("Invoice 2291 from Acme Tools Ltd, 14 Baker Street, Leeds. Items: 3 hammers at 12.50 each, "
           "2 saws at 30.00 each. Contact: Jane Miller, jane.miller@acmetools.example, phone 0113 496 0321.")
    prompt = (f"<|im_start|>user\nCopy the following text exactly.\n\n{doc}<|im_end|>\n"
              "<|im_start|>assistant\n")
    params = {"temperature": 0, "max_new_tokens": 64}
    outs = {}
    for name, extra in (("off", {}), ("on", SPEC)):
        # a pool of the size the copy needs, not the default (a share of this machine's memory: ~3 GB each)
        with Engine(max_total_tokens=4096, **extra) as e:
            outs[name] = e.generate(prompt, sampling_params=params)
    assert outs["on"]["output_ids"] == outs["off"]["output_ids"]
    meta = outs["on"]["meta_info"]
    assert meta["spec_accepted_tokens"] > meta["completion_tokens"] // 2  # most of the copy came from drafts


# ---- a draft model (--speculative-algorithm standalone) --------------------------------------------

@pytest.fixture(scope="module")
def other_draft_dir(tmp_path_factory) -> str:
    from tests.tiny_model import make_tiny_model_dir
    return make_tiny_model_dir(str(tmp_path_factory.mktemp("spec_draft")), num_layers=1, hidden=32, heads=2,
                               kv_heads=1)


@pytest.mark.parametrize("draft", ["same", "other"])
def test_draft_model_greedy_tokens_identical(draft, tiny_model_dir, other_draft_dir):
    kw = {"model_path": tiny_model_dir, "load_format": "dummy"}
    spec = {"speculative_algorithm": "standalone", "speculative_num_draft_tokens": 3,
            "speculative_draft_model_path": tiny_model_dir if draft == "same" else other_draft_dir}
    prompts = _repeating_prompts(5, seed=7)
    params = [GREEDY, GREEDY, {**GREEDY, "frequency_penalty": 0.4}, GREEDY, {**GREEDY, "max_new_tokens": 7}]
    ref, _ = _run(kw, prompts, params, max_total_tokens=4096)
    with Engine(**kw, max_total_tokens=4096, **spec) as e:
        outs = e.generate(input_ids=prompts, sampling_params=params)
        info = e.get_server_info()
        e.check_memory_leak()
    assert [o["output_ids"] for o in outs] == ref
    meta = [o["meta_info"] for o in outs]
    if draft == "same":  # the same weights (same seed): every greedy draft is right, but the penalized request's
        for i in (0, 1, 3, 4):
            assert meta[i]["spec_draft_tokens"] > 0 and meta[i]["spec_accepted_tokens"] == meta[i]["spec_draft_tokens"]
        assert meta[2]["spec_accepted_tokens"] < meta[2]["spec_draft_tokens"]
    else:
        assert 0 < info["spec_draft_tokens"] and info["spec_accepted_tokens"] < info["spec_draft_tokens"]


def test_draft_model_across_a_retraction(tiny_model_dir, other_draft_dir):
    kw = {"model_path": tiny_model_dir, "load_format": "dummy"}
    spec = {"speculative_algorithm": "standalone", "speculative_draft_model_path": other_draft_dir}
    prompts = _repeating_prompts(12, seed=8)
    ref, _ = _run(kw, prompts, GREEDY, max_total_tokens=8192)
    with Engine(**kw, max_total_tokens=400, **spec) as e:
        outs = e.generate(input_ids=prompts, sampling_params=GREEDY)
        info = e.get_server_info()
        e.check_memory_leak()
    assert info["num_retractions"] > 0 and info["spec_draft_tokens"] > 0
    assert [o["output_ids"] for o in outs] == ref


def test_draft_model_with_another_vocabulary_is_refused(tiny_model_dir, tmp_path):
    import json
    import shutil
    bad = tmp_path / "bad_draft"
    shutil.copytree(tiny_model_dir, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["vocab_size"] = 1000
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(Exception, match="vocabulary"):
        Engine(model_path=tiny_model_dir, load_format="dummy", max_total_tokens=1024,
               speculative_algorithm="standalone", speculative_draft_model_path=str(bad))


def test_through_the_server_with_metrics(tiny_model_dir):
    import httpx

    from tests.live_server import live_server

    prompt = _repeating_prompts(1, seed=9)[0]
    with Engine(model_path=tiny_model_dir, load_format="dummy", max_total_tokens=2048) as e:
        ref = e.generate(input_ids=prompt, sampling_params=GREEDY)["output_ids"]
    with live_server(tiny_model_dir, load_format="dummy", max_total_tokens=2048, **SPEC) as url:
        with httpx.Client(base_url=url, timeout=120) as c:
            out = c.post("/generate", json={"input_ids": prompt, "sampling_params": GREEDY}).json()
            metrics = c.get("/metrics").text
    assert out["output_ids"] == ref and out["meta_info"]["spec_accepted_tokens"] > 0
    counters = {line.split()[0]: float(line.split()[1]) for line in metrics.splitlines()
                if line.startswith("radixlang_spec_")}
    assert counters["radixlang_spec_draft_tokens_total"] == out["meta_info"]["spec_draft_tokens"]
    assert counters["radixlang_spec_accepted_tokens_total"] == out["meta_info"]["spec_accepted_tokens"]
