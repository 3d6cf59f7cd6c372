"""GGUF files of the supported families (written here with the `gguf` package in llama.cpp's tensor
names and metadata, tokenizer fields copied from the embedded SmolLM2 GGUF) load as the family and
give the original checkpoint's prompt log-probabilities; transformers' own GGUF reader agrees on weights."""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from radixlang.runtime.models.gguf_convert import hf_tensor_name
from radixlang.runtime.models.loader import default_model_path, load_model
from test_model_families import PROMPTS, _hf_logprobs
from test_models import _run_ours
from tiny_model import save_tiny_hf_model

_GGUF_NAMES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
               "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
               "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
               "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm"}


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:  # what llama.cpp's converter does to llama's Q/K
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _write_gguf(hf_folder: str, path: str, arch: str) -> None:
    import gguf
    hf = AutoModelForCausalLM.from_pretrained(hf_folder, dtype=torch.float32)
    cfg = hf.config
    w = gguf.GGUFWriter(path, arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_rope_freq_base(float(cfg.rope_parameters["rope_theta"]))
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    src = gguf.GGUFReader(default_model_path())
    for key, field in src.fields.items():
        if key.startswith("tokenizer."):
            if field.types[0] == gguf.GGUFValueType.ARRAY:
                w.add_key_value(key, field.contents(), field.types[0], sub_type=field.types[-1])
            else:
                w.add_key_value(key, field.contents(), field.types[0])
    for name, t in hf.state_dict().items():
        arr = t.numpy().astype(np.float32)
        if name.startswith("model.layers."):
            _, _, layer, *rest = name.split(".")
            module, leaf = ".".join(rest[:-1]), rest[-1]
            kind = _GGUF_NAMES[module]
            if arch == "llama" and kind in ("attn_q", "attn_k"):
                arr = _permute(arr, cfg.num_attention_heads if kind == "attn_q" else cfg.num_key_value_heads)
            gname = f"blk.{layer}.{kind}.{leaf}"
        else:
            gname = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                     "lm_head.weight": "output.weight"}[name]
        assert hf_tensor_name(gname) == name
        w.add_tensor(gname, np.ascontiguousarray(arr))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("arch,hf_arch", [("qwen2", "Qwen2ForCausalLM"), ("qwen3", "Qwen3ForCausalLM")])
def test_gguf_family_matches_its_checkpoint(tmp_path, monkeypatch, arch, hf_arch):
    monkeypatch.setenv("RADIXLANG_CACHE", str(tmp_path / "cache"))
    folder = save_tiny_hf_model(str(tmp_path / "hf"), hf_arch, seed=5)
    path = str(tmp_path / f"tiny-{arch}.gguf")
    _write_gguf(folder, path, arch)
    loaded = load_model(path)
    assert type(loaded.model).__name__ == hf_arch
    assert loaded.tokenizer.encode("hello world") == load_model(folder).tokenizer.encode("hello world")
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    for ids in PROMPTS[:2]:
        logits = _run_ours(loaded.model, ids)
        ours = logits.log_softmax(-1)[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
        assert (ours - _hf_logprobs(hf, ids)).abs().max().item() < 1e-4
    if arch == "qwen3":  # transformers' GGUF reader ignores qwen3.attention.key_length (assumes 128)
        return
    # transformers' own GGUF reader maps the same file to the same weights
    ref = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                               dtype=torch.float32).state_dict()
    for name, tensor in hf.state_dict().items():
        assert torch.allclose(tensor, ref[name], atol=1e-6), name
