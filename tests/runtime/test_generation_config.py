"""Sampling defaults from the model's generation_config.json (``--generation-config``), as vLLM takes them."""
from __future__ import annotations

import shutil

import httpx
import pytest
from transformers import GenerationConfig

from radixlang.runtime.generation_config import check_generation_config, sampling_defaults
from tests.live_server import live_server

AUTHORS = {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05}


@pytest.fixture(scope="module")
def model_with_defaults(tiny_model_dir, tmp_path_factory) -> str:
    folder = tmp_path_factory.mktemp("gen_cfg") / "model"
    shutil.copytree(tiny_model_dir, folder)
    GenerationConfig(do_sample=True, max_new_tokens=300, **AUTHORS).save_pretrained(folder)  # transformers writes it
    return str(folder)


def test_defaults_come_from_the_named_source(model_with_defaults, tmp_path):
    assert sampling_defaults("auto", model_with_defaults) == AUTHORS  # max_new_tokens is not taken
    assert sampling_defaults("vllm", model_with_defaults) == {}
    assert sampling_defaults("auto", str(tmp_path)) == {}  # no file: the built-in defaults
    GenerationConfig(temperature=0.3, do_sample=True).save_pretrained(tmp_path)
    assert sampling_defaults(str(tmp_path), model_with_defaults) == {"temperature": 0.3}
    for good in ("auto", "vllm", str(tmp_path)):
        check_generation_config(good)
    with pytest.raises(ValueError, match="generation_config"):
        check_generation_config(str(tmp_path / "missing"))


def _sampled(engine, **params) -> list[int]:
    out = engine.generate(input_ids=[5, 6, 7, 8], sampling_params={"max_new_tokens": 12, "sampling_seed": 7,
                                                                     "ignore_eos": True, **params})
    return out["output_ids"]


def test_a_request_takes_the_models_defaults_for_what_it_leaves_unset(model_with_defaults):
    from radixlang import Engine
    with Engine(model_path=model_with_defaults, load_format="dummy", max_total_tokens=512) as engine:
        assert engine.front.sampling_defaults == AUTHORS
        implicit = _sampled(engine)
        assert implicit == _sampled(engine, **AUTHORS)
        assert implicit != _sampled(engine, temperature=1.0, top_p=1.0, top_k=-1, repetition_penalty=1.0)
        # a field the request sets wins; the others keep the model's
        params = engine.front.expand(None, {"temperature": 0.0}, [1, 2])[0][2]
        assert (params.temperature, params.top_k, params.top_p) == (0.0, 20, 0.8)
        assert params.max_new_tokens is None  # the budget stays "not asked for": capped, never refused
    with Engine(model_path=model_with_defaults, load_format="dummy", max_total_tokens=512,
                generation_config="vllm") as plain:
        assert plain.front.sampling_defaults == {}
        assert _sampled(plain) == _sampled(plain, temperature=1.0, top_p=1.0, top_k=-1, repetition_penalty=1.0)


def test_the_server_shows_its_defaults(model_with_defaults):
    with live_server(model_with_defaults) as url:
        info = httpx.get(f"{url}/get_model_info", timeout=30).json()
    assert info["default_sampling_params"] == AUTHORS
