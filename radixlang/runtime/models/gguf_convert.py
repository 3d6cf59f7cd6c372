"""GGUF -> Hugging Face folder (config.json, model.safetensors, tokenizer files), cached on disk.

The `gguf` package reads and dequantizes the tensors (~4 s for SmolLM2-135M);
transformers supplies the tokenizer and chat template from the GGUF metadata. Architectures: llama
(Llama, Mistral, SmolLM), qwen2, qwen3. Three separate steps per tensor, so a quantized-tensor path can
replace the last one: ``hf_tensor_name`` (llama.cpp's name -> the HF checkpoint name), ``restore_layout``
(llama.cpp's permuted Q/K rows on llama back to rotate_half's), ``dequantize_tensor`` (to float32).
The converted folder is written atomically under the user cache so later
starts load it directly.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np
import torch

logger = logging.getLogger(__name__)

_LAYER_MAP = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
}
_TOP_MAP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
# GGUF general.architecture -> (transformers model_type, HF architecture)
GGUF_ARCHS = {"llama": ("llama", "LlamaForCausalLM"), "qwen2": ("qwen2", "Qwen2ForCausalLM"),
              "qwen3": ("qwen3", "Qwen3ForCausalLM")}


def hf_tensor_name(gguf_name: str) -> str:
    """llama.cpp's tensor name (blk.3.attn_q.weight) -> the HF checkpoint's (model.layers.3.self_attn.q_proj.weight)."""
    parts = gguf_name.split(".")
    table = _LAYER_MAP if parts[0] == "blk" else _TOP_MAP
    kind = parts[2] if parts[0] == "blk" else parts[0]
    if kind not in table:
        raise ValueError(f"GGUF tensor {gguf_name!r} has no Hugging Face counterpart here")
    if parts[0] == "blk":
        return f"model.layers.{parts[1]}.{table[kind]}.{parts[-1]}"
    return f"{table[kind]}.{parts[-1]}"


def restore_layout(arch: str, gguf_name: str, arr: np.ndarray, n_head: int, n_kv: int) -> np.ndarray:
    """llama.cpp permutes Q and K rows (weights and biases) of ``llama`` only; other archs keep HF's layout."""
    if arch != "llama":
        return arr
    kind = gguf_name.split(".")[2] if gguf_name.startswith("blk.") else ""
    if kind == "attn_q":
        return _unpermute(arr, n_head)
    if kind == "attn_k":
        return _unpermute(arr, n_kv)
    return arr


def dequantize_tensor(t) -> np.ndarray:
    """A GGUF reader tensor as float32 in HF's [out, in] shape (whatever its stored type)."""
    import gguf
    try:
        arr = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
    except NotImplementedError as e:
        raise ValueError(f"GGUF tensor {t.name!r} has type {t.tensor_type.name}, which cannot be read "
                         f"(no dequantization for it in the gguf package)") from e
    return arr.reshape([int(d) for d in reversed(t.shape)])


def cache_root() -> Path:
    return Path(os.environ.get("RADIXLANG_CACHE", Path.home() / ".cache" / "radixlang"))


def converted_dir_for(gguf_path: str) -> Path:
    st = os.stat(gguf_path)
    key = hashlib.sha256(f"{os.path.abspath(gguf_path)}|{st.st_size}|{int(st.st_mtime)}|v1".encode()).hexdigest()[:16]
    return cache_root() / f"{Path(gguf_path).stem}-{key}"


def ensure_converted(gguf_path: str) -> str:
    """Return a HF folder equivalent to the GGUF file, converting it once."""
    out = converted_dir_for(gguf_path)
    if (out / "complete").exists():
        return str(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".", dir=out.parent))
    try:
        _convert(gguf_path, tmp)
        (tmp / "complete").write_text("ok")
        try:
            os.rename(tmp, out)
        except OSError:  # another process won the race
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return str(out)


def _field(reader, key: str, default=None):
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    # llama.cpp's converter interleaves the rotary halves of each head; restore HF's rotate_half layout
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _convert(gguf_path: str, out: Path) -> None:
    import gguf
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoTokenizer

    reader = gguf.GGUFReader(gguf_path)
    arch = _field(reader, "general.architecture")
    if arch not in GGUF_ARCHS:
        raise ValueError(f"GGUF architecture {arch!r} is not supported (supported: {', '.join(GGUF_ARCHS)})")
    n_head = int(_field(reader, f"{arch}.attention.head_count"))
    n_kv = int(_field(reader, f"{arch}.attention.head_count_kv", n_head))
    tensors: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        arr = restore_layout(arch, t.name, dequantize_tensor(t), n_head, n_kv)
        tensors[hf_tensor_name(t.name)] = torch.from_numpy(np.ascontiguousarray(arr))
    emb = tensors["model.embed_tokens.weight"]
    model_type, hf_arch = GGUF_ARCHS[arch]
    hidden = int(_field(reader, f"{arch}.embedding_length"))
    extra = {}
    head_dim = _field(reader, f"{arch}.attention.key_length")
    if head_dim is not None:  # Qwen3's config defaults to 128 otherwise
        extra["head_dim"] = int(head_dim)
    config = AutoConfig.for_model(
        model_type, architectures=[hf_arch],
        vocab_size=int(emb.shape[0]), hidden_size=hidden,
        intermediate_size=int(_field(reader, f"{arch}.feed_forward_length")),
        num_hidden_layers=int(_field(reader, f"{arch}.block_count")), num_attention_heads=n_head,
        num_key_value_heads=n_kv, max_position_embeddings=int(_field(reader, f"{arch}.context_length", 4096)),
        rms_norm_eps=float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        tie_word_embeddings="lm_head.weight" not in tensors,
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_id=_field(reader, "tokenizer.ggml.eos_token_id"),
        torch_dtype="float32", **extra,
    )
    config.save_pretrained(out)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    src = Path(gguf_path)
    tokenizer = AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name)
    tokenizer.save_pretrained(out)
    (out / "source.json").write_text(json.dumps({"gguf": str(src), "size": os.stat(src).st_size}))
    logger.info("converted %s -> %s (%d tensors)", src.name, out, len(tensors))
