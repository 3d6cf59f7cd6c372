"""A prompt's ids equal transformers' (``AutoTokenizer`` on the same source) whatever the model's
metadata says: GGUF add_bos_token / add_eos_token / add_space_prefix, HF tokenizer classes with their
flags, for SentencePiece (byte fallback), BPE with byte fallback and byte-level BPE vocabularies. A text
prompt gets ``tokenizer(text)``'s ids, a chat ``apply_chat_template(tokenize=True)``'s (one BOS, the
template's), on the Engine, /generate, /v1/completions and /v1/chat/completions; every EOS id the model
names stops a reply; a base model's chat is a 400 until --chat-template names a template."""
from __future__ import annotations

import os

import pytest
from fastapi.testclient import TestClient
from transformers import AutoTokenizer

from radixlang.runtime.entrypoints.engine_front import EngineFront
from radixlang.runtime.entrypoints.http_server import create_app
from radixlang.runtime.entrypoints.openai.protocol import ChatRequest, chat_prompt
from radixlang.runtime.front.request_front import RequestFront
from radixlang.runtime.front.request_output import expand_requests
from radixlang.runtime.models.loader.gguf_convert import eos_token_ids
from radixlang.runtime.models.loader.model_loader import resolve_model_dir
from radixlang.runtime.server_args import ServerArgs
from radixlang.runtime.tokenizer_source import BUILTIN_TEMPLATES, encode_chat, resolve_chat_template
from test_gguf_families import _write_gguf
from tiny_model import FAMILIES, private_cache, save_tiny_hf_model
from tokenizer_sources import (
    BOS_ID, CHAT, END_OF_TURN_ID, EOS_ID, TEXTS, add_gguf_tokenizer, save_hf_tokenizer, spm_vocab, write_llama_gguf,
)

GEMMA = resolve_chat_template("gemma")  # writes {{ bos_token }} itself
# (id, source kind, vocabulary, flags): both add-BOS settings of every vocabulary type, add_eos and a
# missing space prefix too
SOURCES = [
    ("gguf-spm-bos", "gguf", "spm", dict(add_bos=True)),
    ("gguf-spm-nobos", "gguf", "spm", dict(add_bos=False)),
    ("gguf-spm-eos-noprefix", "gguf", "spm", dict(add_bos=True, add_eos=True, add_space_prefix=False)),
    ("gguf-bpe-bos", "gguf", "bpe", dict(add_bos=True)),
    ("gguf-bpe-nobos", "gguf", "bpe", dict(add_bos=False)),
    ("hf-spm-bos", "hf", "spm", dict(add_bos=True)),
    ("hf-spm-nobos", "hf", "spm", dict(add_bos=False)),
    ("hf-spm-eos", "hf", "spm", dict(add_bos=False, add_eos=True)),
    ("hf-bpe-bos", "hf", "bpe", dict(add_bos=True)),
    ("hf-bpe-nobos", "hf", "bpe", dict(add_bos=False)),
]


def _make_source(root: str, kind: str, vocab: str, flags: dict) -> tuple[str, object]:
    """(the --model-path, transformers' tokenizer of the same source)."""
    if kind == "gguf":
        path = write_llama_gguf(os.path.join(root, f"{vocab}.gguf"), vocab, chat_template=GEMMA, **flags)
        return path, AutoTokenizer.from_pretrained(root, gguf_file=os.path.basename(path))
    save_hf_tokenizer(root, vocab, chat_template=GEMMA, **flags)
    return root, AutoTokenizer.from_pretrained(root)


@pytest.mark.parametrize("kind,vocab,flags", [s[1:] for s in SOURCES], ids=[s[0] for s in SOURCES])
def test_text_and_chat_ids_equal_transformers(tmp_path, monkeypatch, kind, vocab, flags):
    private_cache(tmp_path / "cache", monkeypatch)
    model_path, ref = _make_source(str(tmp_path / "src"), kind, vocab, flags)
    ours = AutoTokenizer.from_pretrained(resolve_model_dir(model_path))  # what the runtime loads
    items = expand_requests(ours, list(TEXTS), None, None)
    assert [ids for ids, _, _ in items] == [ref(t).input_ids for t in TEXTS]
    if flags["add_bos"]:  # the case the issue found: a model whose tokenizer asks for a BOS got none
        assert all(ids[0] == ref.bos_token_id for ids, _, _ in items)
        # a text that starts with the BOS itself (a template rendered as text) keeps one, not two
        doubled = ref(ref.bos_token + TEXTS[1]).input_ids
        assert doubled[:2] == [ref.bos_token_id] * 2
        assert expand_requests(ours, ref.bos_token + TEXTS[1], None, None)[0][0] == doubled[1:]
    rendered = chat_prompt(ours, ChatRequest(messages=CHAT), [])
    want = ref.apply_chat_template(CHAT, tokenize=True, add_generation_prompt=True)["input_ids"]
    assert encode_chat(ours, rendered) == want and want.count(ref.bos_token_id) == 1


def _recording(monkeypatch) -> list[list[int]]:
    """The input ids of every request the front submits, in order."""
    seen: list[list[int]] = []
    real = RequestFront.submit

    def submit(self, input_ids, *args, **kwargs):
        seen.append(list(input_ids))
        return real(self, input_ids, *args, **kwargs)

    monkeypatch.setattr(RequestFront, "submit", submit)
    return seen


def _ids_per_route(engine, client, seen: list[list[int]], text: str) -> dict[str, list[int]]:
    one = {"max_new_tokens": 1, "temperature": 0}
    calls = {"engine": lambda: engine.generate(prompt=text, sampling_params=one),
             "/generate": lambda: client.post("/generate", json={"text": text, "sampling_params": one}),
             "/v1/completions": lambda: client.post("/v1/completions", json={"prompt": text, "max_tokens": 1}),
             "/v1/chat/completions": lambda: client.post("/v1/chat/completions",
                                                         json={"messages": CHAT, "max_tokens": 1})}
    out = {}
    for route, call in calls.items():
        before = len(seen)
        r = call()
        assert getattr(r, "status_code", 200) == 200, (route, r.json())
        assert len(seen) == before + 1, route
        out[route] = seen[-1]
    return out


def _gemma3_gguf(root: str) -> str:
    """A Gemma 3 GGUF as llama.cpp writes one: SentencePiece vocabulary, add_bos_token true, a chat template
    that writes the BOS itself and ends turns with <end_of_turn> (an end its EOS id does not name)."""
    arch, overrides = FAMILIES["gemma3"]
    folder = save_tiny_hf_model(os.path.join(root, "hf"), arch, vocab_size=len(spm_vocab()[0]), **overrides)
    path = os.path.join(root, "gemma3.gguf")  # beside the HF folder: transformers reads the GGUF from root
    _write_gguf(folder, path, "gemma3", tokenizer=lambda w: add_gguf_tokenizer(w, "spm", add_bos=True,
                                                                              chat_template=GEMMA))
    return path


@pytest.mark.parametrize("kind", ["gguf-gemma3", "hf-spm"])
def test_every_route_sends_transformers_ids_and_every_eos_stops(tmp_path, monkeypatch, kind):
    from radixlang import Engine
    src = str(tmp_path / "src")
    if kind == "gguf-gemma3":
        model_path = _gemma3_gguf(src)
        ref = AutoTokenizer.from_pretrained(src, gguf_file="gemma3.gguf")
        extra: dict = {}
    else:  # the end of turn is an EOS only in generation_config.json
        model_path = src
        save_hf_tokenizer(src, "spm", add_bos=True, chat_template=GEMMA, eos_ids=[EOS_ID, END_OF_TURN_ID])
        ref = AutoTokenizer.from_pretrained(src)
        extra = {"load_format": "dummy"}
    private_cache(tmp_path / "cache", monkeypatch)  # after: save_tiny_hf_model read SmolLM2's from the real one
    seen = _recording(monkeypatch)
    text = TEXTS[0]
    chat = ref.apply_chat_template(CHAT, tokenize=True, add_generation_prompt=True)["input_ids"]
    with Engine(model_path=model_path, max_total_tokens=1024, **extra) as engine:
        with TestClient(create_app(EngineFront(engine))) as client:
            routes = _ids_per_route(engine, client, seen, text)
        assert routes == {"engine": ref(text).input_ids, "/generate": ref(text).input_ids,
                          "/v1/completions": ref(text).input_ids, "/v1/chat/completions": chat}
        assert routes["engine"][0] == BOS_ID and chat[0] == BOS_ID and chat[1] != BOS_ID
        for eos in (EOS_ID, END_OF_TURN_ID):  # pushed to the top: the reply ends at it
            out = engine.generate(prompt=text, sampling_params={"max_new_tokens": 4, "temperature": 0,
                                                                "logit_bias": {str(eos): 100.0}})
            assert out["output_ids"] == [eos] and out["meta_info"]["finish_reason"]["type"] == "stop", eos


def test_base_model_chat_is_a_400_until_a_builtin_template_is_named(tmp_path, monkeypatch):
    from radixlang import Engine
    private_cache(tmp_path / "cache", monkeypatch)
    src = str(tmp_path / "src")
    path = write_llama_gguf(os.path.join(src, "base.gguf"), "spm", add_bos=True)  # no tokenizer.chat_template
    ref = AutoTokenizer.from_pretrained(src, gguf_file="base.gguf")
    with Engine(model_path=path, max_total_tokens=1024) as engine:
        with TestClient(create_app(EngineFront(engine))) as client:
            r = client.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 1})
            assert client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1}).status_code == 200
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    assert "no chat template" in r.json()["error"]["message"] and "--chat-template" in r.json()["error"]["message"]
    seen = _recording(monkeypatch)
    with Engine(model_path=path, max_total_tokens=1024, chat_template="gemma") as engine:
        with TestClient(create_app(EngineFront(engine))) as client:
            r = client.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 1})
            info = client.get("/get_model_info").json()
    assert r.status_code == 200 and info["chat_template"] == GEMMA
    assert seen[-1] == ref.apply_chat_template(CHAT, chat_template=GEMMA, tokenize=True,
                                               add_generation_prompt=True)["input_ids"]
    assert seen[-1].count(BOS_ID) == 1


def test_chat_template_option_takes_a_builtin_name_or_a_file(tmp_path):
    for name in BUILTIN_TEMPLATES:
        assert "add_generation_prompt" in resolve_chat_template(name)
        ServerArgs(chat_template=name)
    own = tmp_path / "t.jinja"
    own.write_text("{{ messages[0]['content'] }}")
    ServerArgs(chat_template=str(own))
    assert resolve_chat_template(str(own)) == "{{ messages[0]['content'] }}"
    with pytest.raises(ValueError, match="chat_template must be .*chatml, gemma, llama-3.*'nope'"):
        ServerArgs(chat_template="nope")


def test_gguf_eos_ids_add_the_end_of_turn_its_template_writes():
    class Vocab:
        def get_vocab(self) -> dict[str, int]:
            return {"<end_of_turn>": 106, "<|end|>": 7, "<|return|>": 8, "<|im_end|>": 5}

    gemma = {"tokenizer.ggml.eos_token_id": 1, "tokenizer.chat_template": "{{ m }}<end_of_turn>\n"}
    assert eos_token_ids(gemma, Vocab()) == [1, 106]
    # harmony: <|end|> closes a reasoning message and the reply goes on to the final one
    harmony = {"tokenizer.ggml.eos_token_id": 1, "tokenizer.ggml.eot_token_id": 9,
               "tokenizer.chat_template": "<|channel|>analysis<|message|>x<|end|><|return|>"}
    assert eos_token_ids(harmony, Vocab()) == [1, 9, 8]
    assert eos_token_ids({"tokenizer.ggml.eos_token_id": 5, "tokenizer.chat_template": "<|im_end|>"}, Vocab()) == [5]
