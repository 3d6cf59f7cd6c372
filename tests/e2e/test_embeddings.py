"""/v1/embeddings and /v1/rerank (issue #41 item 3) on tiny random embedding models that sentence-transformers
itself saves (a transformers Llama wrapped in Pooling + Normalize), one per pooling mode, checked against
``SentenceTransformer(folder).encode`` in float32 through the real ``openai`` client."""
from __future__ import annotations

import base64
import json
import os
import struct

import httpx
import pytest
import torch
from fastapi.testclient import TestClient

from radixlang.runtime.entrypoints.engine_front import EngineFront
from radixlang.runtime.entrypoints.http_server import create_app
from radixlang.runtime.io_struct import TokenizedGenerateReq
from radixlang.runtime.sampling.sampling_params import SamplingParams
from radixlang.runtime.scheduler.build import build_scheduler
from radixlang.runtime.scheduler.scheduler import Scheduler
from radixlang.runtime.server_args import ServerArgs
from tests.live_server import live_server
from tests.tiny_model import make_tiny_safetensors_dir

pytestmark = pytest.mark.e2e

MODES = ("mean", "cls", "lasttoken")
HIDDEN = 64
PREFIX = "The quick brown fox jumps over the lazy dog"
TEXTS = ["hello", "a somewhat longer sentence about embeddings and caches", "x y z", PREFIX]
COSINE = 0.9999


@pytest.fixture(scope="module")
def st_dirs(tmp_path_factory) -> dict[str, str]:
    """One sentence-transformers folder per pooling mode over the same tiny Llama; the mean one says it is a
    Matryoshka model."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Normalize, Pooling, Transformer

    root = tmp_path_factory.mktemp("st")
    base = make_tiny_safetensors_dir(str(root / "base"), tie=True)
    # without a chat template, sentence-transformers embeds a text as it is (it would render it as a message)
    os.remove(os.path.join(base, "chat_template.jinja"))
    dirs = {}
    for mode in MODES:
        dirs[mode] = str(root / mode)
        SentenceTransformer(modules=[Transformer(base), Pooling(HIDDEN, mode), Normalize()]).save(dirs[mode])
    config_path = os.path.join(dirs["mean"], "config.json")
    with open(config_path) as f:
        config = json.load(f)
    with open(config_path, "w") as f:
        json.dump({**config, "is_matryoshka": True}, f)
    return dirs


@pytest.fixture(scope="module")
def references(st_dirs):
    from sentence_transformers import SentenceTransformer
    return {mode: SentenceTransformer(path, device="cpu") for mode, path in st_dirs.items()}


def reference(references, mode: str, texts: list[str]) -> torch.Tensor:
    """[len(texts), hidden] float32; one text per batch, so that no padding enters the reference."""
    return references[mode].encode(texts, batch_size=1, convert_to_tensor=True).float().cpu()


@pytest.fixture(scope="module")
def clients(st_dirs):
    from radixlang import Engine
    # a chat template, so that a chat request gets as far as the refusal of generation
    engines = {mode: Engine(model_path=path, is_embedding=True, max_total_tokens=4096, chat_template="chatml",
                             dtype="float32")
               for mode, path in st_dirs.items()}
    with TestClient(create_app(EngineFront(engines["mean"]))) as mean, \
            TestClient(create_app(EngineFront(engines["cls"]))) as cls, \
            TestClient(create_app(EngineFront(engines["lasttoken"]))) as last:
        yield {"mean": mean, "cls": cls, "lasttoken": last}
    for engine in engines.values():
        engine.shutdown()


def openai_client(http):
    from openai import OpenAI
    return OpenAI(base_url=f"{http.base_url}/v1", api_key="unused", http_client=http, max_retries=0)


def cosines(got: list[list[float]], want: torch.Tensor) -> list[float]:
    return torch.nn.functional.cosine_similarity(torch.tensor(got), want, dim=-1).tolist()


def _ok(r) -> dict:
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.parametrize("mode", MODES)
def test_embeddings_match_sentence_transformers(clients, references, mode):
    client = openai_client(clients[mode])
    want = reference(references, mode, TEXTS)
    floats = client.embeddings.create(model="default", input=TEXTS, encoding_format="float")
    assert [d.index for d in floats.data] == list(range(len(TEXTS)))
    assert min(cosines([d.embedding for d in floats.data], want)) >= COSINE
    # the client's default asks for base64 and decodes it (last-token pooling now reuses cached KV: a
    # forward of other shapes, so equal to float32 rounding)
    decoded = client.embeddings.create(model="default", input=TEXTS)
    assert torch.allclose(torch.tensor([d.embedding for d in decoded.data]),
                          torch.tensor([d.embedding for d in floats.data]), atol=1e-6)
    ids = references[mode].tokenizer(TEXTS)["input_ids"]
    assert floats.usage.prompt_tokens == floats.usage.total_tokens == sum(len(x) for x in ids)


@pytest.mark.parametrize("mode", MODES)
def test_a_repeated_prefix_gives_the_reference(clients, references, mode):
    """The second text extends the first: last-token pooling reuses its cached KV; mean and CLS pooling need
    every position's hidden state and compute the prompt whole (docs/embeddings.md)."""
    client = openai_client(clients[mode])
    texts = [PREFIX + " and then it runs far away", PREFIX + " twice"]
    client.embeddings.create(model="default", input=PREFIX)
    before = _ok(clients[mode].get("/get_server_info"))["cached_tokens"]
    got = client.embeddings.create(model="default", input=texts, encoding_format="float")
    cached = _ok(clients[mode].get("/get_server_info"))["cached_tokens"] - before
    assert min(cosines([d.embedding for d in got.data], reference(references, mode, texts))) >= COSINE
    prefix_len = len(references[mode].tokenizer(PREFIX)["input_ids"])
    assert cached >= (2 * (prefix_len - 1) if mode == "lasttoken" else 0)
    assert cached == 0 or mode == "lasttoken"


def test_base64_is_the_float32_bytes(clients):
    """One input per call: the same forward both times (mean pooling reads no cache), so the same numbers."""
    http = clients["mean"]
    floats = _ok(http.post("/v1/embeddings", json={"input": TEXTS[1], "encoding_format": "float"}))
    b64 = _ok(http.post("/v1/embeddings", json={"input": [TEXTS[1]], "encoding_format": "base64"}))
    for f, b in zip(floats["data"], b64["data"]):
        raw = base64.b64decode(b["embedding"])
        assert list(struct.unpack(f"<{len(raw) // 4}f", raw)) == f["embedding"]
        assert len(f["embedding"]) == HIDDEN
    assert floats["object"] == "list" and floats["model"] and floats["data"][0]["object"] == "embedding"


def test_token_id_inputs_equal_text_inputs(clients, references):
    http = clients["lasttoken"]
    ids = references["lasttoken"].tokenizer(TEXTS[:2])["input_ids"]
    by_text = _ok(http.post("/v1/embeddings", json={"input": TEXTS[:2]}))["data"]
    by_ids = _ok(http.post("/v1/embeddings", json={"input": ids}))["data"]
    one = _ok(http.post("/v1/embeddings", json={"input": ids[0]}))["data"]
    for got in (by_ids, one):
        for g, t in zip(got, by_text):
            assert torch.allclose(torch.tensor(g["embedding"]), torch.tensor(t["embedding"]), atol=1e-6)


def test_dimensions_cut_and_renormalize_on_a_matryoshka_model(clients, references):
    got = openai_client(clients["mean"]).embeddings.create(model="default", input=TEXTS, dimensions=16,
                                                           encoding_format="float")
    want = torch.nn.functional.normalize(reference(references, "mean", TEXTS)[:, :16], dim=-1)
    vectors = [d.embedding for d in got.data]
    assert all(len(v) == 16 for v in vectors)
    assert torch.allclose(torch.tensor(vectors).norm(dim=-1), torch.ones(len(TEXTS)), atol=1e-5)
    assert min(cosines(vectors, want)) >= COSINE


@pytest.mark.parametrize("mode,dimensions", [("cls", 16), ("mean", HIDDEN + 1)])
def test_dimensions_the_model_cannot_give_are_refused(clients, mode, dimensions):
    r = clients[mode].post("/v1/embeddings", json={"input": "hi", "dimensions": dimensions})
    assert r.status_code == 400 and r.json()["error"]["param"] == "dimensions", r.text


def test_rerank_orders_by_the_reference_cosine(clients, references):
    query = "a fast brown animal"
    docs = ["quantum chromodynamics", PREFIX, "slow green turtles", "the fox", "brown bread"]
    vectors = reference(references, "lasttoken", [query, *docs])
    want = torch.nn.functional.cosine_similarity(vectors[1:], vectors[:1], dim=-1)
    order = sorted(range(len(docs)), key=lambda i: -float(want[i]))
    got = _ok(clients["lasttoken"].post("/v1/rerank", json={"query": query, "documents": docs}))
    assert [r["index"] for r in got["results"]] == order
    for r in got["results"]:
        assert abs(r["relevance_score"] - float(want[r["index"]])) < 1e-4
        assert r["document"] == {"text": docs[r["index"]]}
    top = _ok(clients["lasttoken"].post("/v1/rerank", json={"query": query, "documents": docs, "top_n": 2,
                                                           "return_documents": False}))
    assert [r["index"] for r in top["results"]] == order[:2] and "document" not in top["results"][0]
    assert top["usage"]["total_tokens"] > 0


@pytest.mark.parametrize("route,body,param", [
    ("/v1/embeddings", {}, "input"),
    ("/v1/embeddings", {"input": []}, "input"),
    ("/v1/embeddings", {"input": [[]]}, "input"),
    ("/v1/embeddings", {"input": [1, "a"]}, "input"),
    ("/v1/embeddings", {"input": [[5, 49152]]}, "input"),
    ("/v1/embeddings", {"input": "hi", "encoding_format": "float16"}, "encoding_format"),
    ("/v1/embeddings", {"input": "hi", "dimensions": 0}, "dimensions"),
    ("/v1/embeddings", {"input": "hi", "colour": 1}, "colour"),
    ("/v1/rerank", {"documents": ["a"]}, "query"),
    ("/v1/rerank", {"query": "q", "documents": []}, "documents"),
    ("/v1/rerank", {"query": "q", "documents": ["a", ""]}, "documents"),
    ("/v1/rerank", {"query": "q", "documents": ["a"], "top_n": 0}, "top_n"),
])
def test_bad_input_names_the_field(clients, route, body, param):
    r = clients["mean"].post(route, json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error" and error["message"]


def test_an_unknown_model_is_a_404(clients):
    r = clients["mean"].post("/v1/embeddings", json={"input": "hi", "model": "nope"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"


@pytest.mark.parametrize("route,body", [("/v1/embeddings", {"input": "hi"}),
                                        ("/v1/rerank", {"query": "q", "documents": ["a"]})])
def test_a_generation_server_refuses_embeddings(tiny_engine, route, body):
    with TestClient(create_app(EngineFront(tiny_engine))) as http:
        r = http.post(route, json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "model" and "not an embedding model" in error["message"]


@pytest.mark.parametrize("route,body", [
    ("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 2}}),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}),
])
def test_an_embedding_server_refuses_generation(clients, route, body):
    r = clients["mean"].post(route, json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "model" and "is an embedding model" in error["message"]
    assert _ok(clients["mean"].get("/get_model_info"))["is_generation"] is False


def _embed_all(scheduler: Scheduler, prompts: list[list[int]]) -> tuple[dict[str, list[float]], int]:
    """Each prompt's embedding, by rid, and the steps the scheduler took."""
    for i, ids in enumerate(prompts):
        scheduler.add_request(TokenizedGenerateReq(rid=str(i), input_ids=ids, embedding=True,
                                                   sampling_params=SamplingParams.from_dict({"max_new_tokens": 0})))
    got: dict[str, list[float]] = {}
    steps = 0
    while not scheduler.is_idle():
        out = scheduler.step()
        steps += 1
        for row in out.rows if out is not None else ():
            if row.embedding is not None:
                got[row.rid] = row.embedding
    scheduler.check_memory_leak()
    return got, steps


@pytest.mark.parametrize("mode", MODES)
def test_one_batch_and_chunked_prefills_pool_as_the_reference(st_dirs, references, mode):
    """Prompts of different lengths run as one extend batch; prefilled in chunks of 4 tokens, each chunk
    adds its rows to the pooled sum (mean), or holds the pooled position (CLS, last token)."""
    texts = TEXTS + [PREFIX + " again and again"]
    ids = references[mode].tokenizer(texts)["input_ids"]
    want = reference(references, mode, texts)
    whole = build_scheduler(ServerArgs(model_path=st_dirs[mode], is_embedding=True, max_total_tokens=1024,
                                       dtype="float32"))
    got, steps = _embed_all(whole, ids)
    assert steps == 1
    assert min(cosines([got[str(i)] for i in range(len(texts))], want)) >= COSINE
    chunked = build_scheduler(ServerArgs(model_path=st_dirs[mode], is_embedding=True, max_total_tokens=1024,
                                         chunked_prefill_size=4, dtype="float32"))
    got, steps = _embed_all(chunked, ids)
    assert steps >= max(len(x) for x in ids) // 4
    assert min(cosines([got[str(i)] for i in range(len(texts))], want)) >= COSINE


def test_the_server_process_serves_embeddings(st_dirs, references):
    """The launched server (--is-embedding): the embedding crosses the scheduler and detokenizer processes."""
    from openai import OpenAI
    with live_server(st_dirs["lasttoken"], is_embedding=True, load_format="safetensors", dtype="float32") as url:
        client = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        got = client.embeddings.create(model="default", input=TEXTS, encoding_format="float")
        assert httpx.get(f"{url}/health_generate", timeout=60).status_code == 200
    assert min(cosines([d.embedding for d in got.data], reference(references, "lasttoken", TEXTS))) >= COSINE


@pytest.fixture(scope="module")
def headless_dir(tmp_path_factory) -> str:
    """An e5-mistral style checkpoint: a LlamaModel with untied embeddings, saved (by sentence-transformers,
    through transformers) without any lm_head, last-token pooled."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Normalize, Pooling, Transformer

    root = tmp_path_factory.mktemp("headless")
    base = make_tiny_safetensors_dir(str(root / "base"), tie=False, seed=3)
    os.remove(os.path.join(base, "chat_template.jinja"))
    path = str(root / "st")
    SentenceTransformer(modules=[Transformer(base), Pooling(HIDDEN, "lasttoken"), Normalize()]).save(path)
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    assert config["architectures"] == ["LlamaModel"] and config["tie_word_embeddings"] is False
    from safetensors import safe_open
    with safe_open(os.path.join(path, "model.safetensors"), framework="pt") as f:
        assert not any("lm_head" in name for name in f.keys())
    return path


def test_an_untied_checkpoint_without_a_head_serves_embeddings(headless_dir):
    """--is-embedding needs no lm_head: the pooled hidden states match sentence-transformers."""
    from sentence_transformers import SentenceTransformer

    from radixlang import Engine
    want = SentenceTransformer(headless_dir, device="cpu").encode(TEXTS, batch_size=1, convert_to_tensor=True)
    engine = Engine(model_path=headless_dir, is_embedding=True, max_total_tokens=2048, dtype="float32")
    try:
        with TestClient(create_app(EngineFront(engine))) as http:
            got = openai_client(http).embeddings.create(model="default", input=TEXTS, encoding_format="float")
    finally:
        engine.shutdown()
    assert min(cosines([d.embedding for d in got.data], want.float().cpu())) >= COSINE


def test_a_checkpoint_without_a_head_cannot_generate(headless_dir, tmp_path):
    """Loaded for generation, the missing head is named before any tensor is read (not a crash deep in
    loading); loaded without saying, a sentence-transformers folder loads headless and its logits name it,
    and the same weights without modules.json are refused."""
    import shutil

    from radixlang.runtime.models.loader.model_loader import load_checkpoint, open_checkpoint
    with pytest.raises(ValueError, match=r"no lm_head\.weight.*--is-embedding"):
        load_checkpoint(open_checkpoint(headless_dir), model_path=headless_dir, embedding=False)
    model = load_checkpoint(open_checkpoint(headless_dir), model_path=headless_dir).model
    with pytest.raises(RuntimeError, match=r"lm_head\.weight.*--is-embedding"):
        model.compute_logits(torch.zeros(1, HIDDEN))
    bare = str(tmp_path / "bare")
    shutil.copytree(headless_dir, bare)
    os.remove(os.path.join(bare, "modules.json"))
    with pytest.raises(ValueError, match=r"no lm_head\.weight"):
        load_checkpoint(open_checkpoint(bare), model_path=bare)
    assert load_checkpoint(open_checkpoint(bare), model_path=bare, embedding=True).model.headless
