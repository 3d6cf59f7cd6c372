"""Multi-LoRA against PEFT: adapters PEFT itself saves (random A and B, every projection targeted, ranks 8 /
16 / 64, rslora and an alpha pattern) on tiny checkpoints transformers saves, served by one Engine each:
prompt and output logprobs within 1e-4 of ``PeftModel`` on the same weights; a batch mixing adapters and
the base model gives each request what it gets alone; a prefix cached under one adapter is never served
to another; an adapter evicted under ``max_loaded_loras`` comes back with the same results."""
from __future__ import annotations

import asyncio

import pytest
import torch

from radixlang import Engine
from radixlang.runtime.errors import RequestError
from lora_adapters import ADAPTERS, reference_logprobs, save_peft_adapters
from tiny_model import FAMILIES, save_tiny_hf_model

PROMPT = [1, 400, 2000, 7, 31000, 12, 99, 5, 48000, 3, 17, 250, 4096, 88]
NEW_TOKENS = 6
GREEDY = {"max_new_tokens": NEW_TOKENS, "min_new_tokens": NEW_TOKENS, "temperature": 0}


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3", "gemma3"])
def served(request, tmp_path_factory):
    """(family, base folder, adapter folders, an Engine serving them all)."""
    root = tmp_path_factory.mktemp(f"lora-{request.param}")
    arch, overrides = FAMILIES[request.param]
    base = save_tiny_hf_model(str(root / "base"), arch, seed=5, **overrides)
    paths = save_peft_adapters(base, root)
    with Engine(model_path=base, lora_paths=[f"{n}={p}" for n, p in paths.items()],
                max_total_tokens=4096) as engine:
        yield request.param, base, paths, engine


def _run(engine: Engine, adapter: str | None, ids: list[int] = PROMPT) -> dict:
    return engine.generate(input_ids=ids, sampling_params=GREEDY, return_logprob=True, logprob_start_len=0,
                           lora_path=adapter)


@pytest.mark.parametrize("adapter", [None, *ADAPTERS])
def test_logprobs_equal_peft(served, adapter):
    _, base, paths, engine = served
    out = _run(engine, adapter)
    meta = out["meta_info"]
    ours = [lp for lp, _, _ in meta["input_token_logprobs"][1:]] + [lp for lp, _, _ in meta["output_token_logprobs"]]
    generated = [t for _, t, _ in meta["output_token_logprobs"]]
    assert len(generated) == NEW_TOKENS
    ref = reference_logprobs(base, paths.get(adapter or ""), PROMPT + generated)
    torch.testing.assert_close(torch.tensor(ours), ref, atol=1e-4, rtol=0)
    # the adapter is really applied: its output logprobs are not the base model's
    if adapter is not None:
        plain = reference_logprobs(base, None, PROMPT + generated)
        assert (plain - ref).abs().max() > 0.1


def test_prompt_longer_than_a_row_slice(served):
    """A prefill past packed.CHUNK_ROWS (256), whose layers otherwise run their rows a slice at a time."""
    _, base, paths, engine = served
    ids = [1 + (i * 7919) % 40000 for i in range(300)]
    out = engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 1}, return_logprob=True,
                          logprob_start_len=0, lora_path="r64")
    ours = torch.tensor([lp for lp, _, _ in out["meta_info"]["input_token_logprobs"][1:]])
    torch.testing.assert_close(ours, reference_logprobs(base, paths["r64"], ids), atol=1e-4, rtol=0)


def test_mixed_batch_gives_each_request_its_own_result(served):
    _, _, _, engine = served
    adapters = [None, *ADAPTERS, "r8", None]
    alone = {a: _run(engine, a) for a in set(adapters)}

    async def together():
        return await asyncio.gather(*(engine.async_generate(input_ids=PROMPT, sampling_params=GREEDY,
                                                            return_logprob=True, lora_path=a) for a in adapters))
    engine.flush_cache()
    outs = asyncio.run(together())
    for a, out in zip(adapters, outs):
        assert out["output_ids"] == alone[a]["output_ids"], a
        got = [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]]
        want = [lp for lp, _, _ in alone[a]["meta_info"]["output_token_logprobs"]]
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want), atol=1e-4, rtol=0)


def test_prefix_cached_under_one_adapter_is_not_served_to_another(served):
    _, _, _, engine = served
    engine.flush_cache()
    ids = PROMPT + [61, 62, 63, 64, 65, 66]
    first = engine.generate(input_ids=ids, sampling_params=GREEDY, lora_path="r8")
    assert first["meta_info"]["cached_tokens"] == 0
    # the same prompt under another adapter and under the base model finds nothing cached
    for other in ("r64", None):
        out = engine.generate(input_ids=ids, sampling_params=GREEDY, lora_path=other)
        assert out["meta_info"]["cached_tokens"] == 0, other
        assert out["output_ids"] == _run(engine, other, ids)["output_ids"]
    # while the same adapter reuses its own prefix, with the same tokens
    again = engine.generate(input_ids=ids, sampling_params=GREEDY, lora_path="r8")
    assert again["meta_info"]["cached_tokens"] >= len(ids) - 1
    assert again["output_ids"] == first["output_ids"]


def test_unknown_adapter_is_a_request_error(served):
    _, _, _, engine = served
    with pytest.raises(RequestError, match="no LoRA adapter named 'nope'") as e:
        engine.generate(input_ids=PROMPT, sampling_params=GREEDY, lora_path="nope")
    assert e.value.param == "lora_path"


def test_load_and_unload_at_run_time(served, tmp_path):
    """An adapter loaded while serving answers as PEFT does; unloaded, its name is refused; a folder that is
    not an adapter (or one for another base) is refused with the reason."""
    _, base, paths, engine = served
    engine.load_lora_adapter("late", paths["r16"])
    assert _run(engine, "late")["output_ids"] == _run(engine, "r16")["output_ids"]
    with pytest.raises(RequestError, match="already loaded"):
        engine.load_lora_adapter("late", paths["r8"])
    engine.unload_lora_adapter("late")
    with pytest.raises(RequestError, match="no LoRA adapter named 'late'"):
        engine.generate(input_ids=PROMPT, sampling_params=GREEDY, lora_path="late")
    with pytest.raises(RequestError, match="no adapter_config.json"):
        engine.load_lora_adapter("bad", str(tmp_path))
    with pytest.raises(RequestError, match="no LoRA adapter named 'never'"):
        engine.unload_lora_adapter("never")


def test_evicted_adapter_comes_back_with_the_same_results(tmp_path):
    """max_loaded_loras 1: alternating adapters evict each other; every answer stays PEFT's."""
    arch, overrides = FAMILIES["llama"]
    base = save_tiny_hf_model(str(tmp_path / "base"), arch, seed=5, **overrides)
    paths = save_peft_adapters(base, tmp_path, seed=3)
    with Engine(model_path=base, lora_paths=[f"{n}={p}" for n, p in paths.items()], max_loaded_loras=1,
                max_loras_per_batch=1, max_total_tokens=4096) as engine:
        results: dict[str, list[list[int]]] = {}
        for name in ["r8", "r64", "r8", "r16", "r64"]:
            results.setdefault(name, []).append(_run(engine, name)["output_ids"])
        for name, outs in results.items():
            assert all(o == outs[0] for o in outs), name
            ref = reference_logprobs(base, paths[name], PROMPT + outs[0])
            meta = _run(engine, name)["meta_info"]
            ours = [lp for lp, _, _ in meta["input_token_logprobs"][1:]]
            torch.testing.assert_close(torch.tensor(ours), ref[:len(PROMPT) - 1], atol=1e-4, rtol=0)
        state = engine.get_server_info()["replicas"][0]["lora"]
        assert state["loaded"] == 1 and state["evictions"] >= 3


def test_lora_refused_with_tensor_parallelism():
    with pytest.raises(ValueError, match="not supported with tp_size > 1"):
        Engine(lora_paths=["a=/nowhere"], tp_size=2)


@pytest.fixture(scope="module")
def http(served):
    from fastapi.testclient import TestClient

    from radixlang.runtime.entrypoints.engine_front import EngineFront
    from radixlang.runtime.entrypoints.http_server import create_app
    with TestClient(create_app(EngineFront(served[3]))) as client:
        yield client


def test_http_routes_select_adapters(served, http):
    """/generate's lora_path and the OpenAI model (``adapter`` or ``<base>:adapter``, with the `openai` client)
    run the same adapter; /v1/models lists the adapters under their base; unknown names are refused."""
    from openai import NotFoundError, OpenAI
    client = OpenAI(base_url=f"{http.base_url}/v1", api_key="unused", http_client=http, max_retries=0)
    models = {m.id: m for m in client.models.list().data}
    base = next(m for m in models if m not in ADAPTERS)
    assert set(models) == {base, *ADAPTERS}
    assert all(models[a].model_dump()["parent"] == base for a in ADAPTERS)
    native = http.post("/generate", json={"input_ids": PROMPT, "sampling_params": GREEDY, "lora_path": "r64"})
    assert native.status_code == 200, native.text
    assert native.json()["output_ids"] == _run(served[3], "r64")["output_ids"]
    for model in ("r64", f"{base}:r64", "default:r64"):
        out = client.completions.create(model=model, prompt=PROMPT, max_tokens=NEW_TOKENS, temperature=0,
                                        extra_body={"min_tokens": NEW_TOKENS})
        assert out.choices[0].text == native.json()["text"], model
        assert out.model == model
    plain = client.completions.create(model=base, prompt=PROMPT, max_tokens=NEW_TOKENS, temperature=0,
                                      extra_body={"min_tokens": NEW_TOKENS})
    assert plain.choices[0].text == _run(served[3], None)["text"]
    with pytest.raises(NotFoundError, match="LoRA adapters: `r16`, `r64`, `r8`"):
        client.completions.create(model=f"{base}:nope", prompt="hi", max_tokens=1)
    bad = http.post("/generate", json={"text": "hi", "lora_path": "nope"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "lora_path"


def test_http_load_and_unload(served, http, tmp_path):
    _, _, paths, _ = served
    r = http.post("/load_lora_adapter", json={"lora_name": "extra", "lora_path": paths["r8"]})
    assert r.status_code == 200, r.text
    assert r.json()["loaded_adapters"]["extra"] == paths["r8"]
    assert "extra" in [m["id"] for m in http.get("/v1/models").json()["data"]]
    out = http.post("/v1/completions", json={"model": "extra", "prompt": PROMPT, "max_tokens": 3, "temperature": 0})
    assert out.status_code == 200, out.text
    assert http.post("/unload_lora_adapter", json={"lora_name": "extra"}).status_code == 200
    assert "extra" not in [m["id"] for m in http.get("/v1/models").json()["data"]]
    for route, body, param in (("/load_lora_adapter", {"lora_name": "x", "lora_path": str(tmp_path)}, "lora_path"),
                               ("/load_lora_adapter", {"lora_name": "x"}, "lora_path"),
                               ("/unload_lora_adapter", {"lora_name": "extra"}, "lora_name")):
        r = http.post(route, json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_server_without_lora_refuses_adapters(tiny_engine):
    with pytest.raises(RequestError, match="not enabled") as e:
        tiny_engine.generate(input_ids=PROMPT, sampling_params=GREEDY, lora_path="r8")
    assert e.value.param == "lora_path"
