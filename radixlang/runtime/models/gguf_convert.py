"""GGUF -> Hugging Face folder (config.json, model.safetensors, tokenizer files), cached on disk.

The `gguf` package reads and dequantizes the tensors; transformers supplies the tokenizer and chat
template from the GGUF metadata. Architectures (``general.architecture``): llama (Llama, Mistral,
SmolLM; Mixtral when it has experts), qwen2, qwen3, qwen2moe, qwen3moe, gemma2, gemma3 (text), phi3.
Per tensor, three steps, so a quantized-tensor path can replace the last one: ``hf_tensor_name``
(llama.cpp's name -> the HF checkpoint name, per architecture), ``restore_layout`` (llama.cpp's
permuted Q/K rows on llama back to rotate_half's), ``dequantize_tensor`` (to float32). Per architecture
besides: Gemma's norms are stored by llama.cpp as 1 + w (the offset is taken off again), stacked expert
tensors (``ffn_gate_exps`` [experts, inter, hidden]) become one HF tensor per expert, Phi-3's longrope
factors are tensors that go into the config. The safetensors file is written one tensor at a time
(only one tensor is ever dequantized in memory); F16 tensors stay F16, the others become F32. The
converted folder is written atomically under the user cache so later starts load it directly.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import struct
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np

logger = logging.getLogger(__name__)

_LAYER_MAP = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
}
# "{e}": a stacked tensor [experts, ...] that becomes one HF tensor per expert
_MOE_MAP = {
    **_LAYER_MAP, "ffn_gate_inp": "mlp.gate", "ffn_gate_exps": "mlp.experts.{e}.gate_proj",
    "ffn_up_exps": "mlp.experts.{e}.up_proj", "ffn_down_exps": "mlp.experts.{e}.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate", "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj", "ffn_down_shexp": "mlp.shared_expert.down_proj",
}
_MIXTRAL_MAP = {
    **_LAYER_MAP, "ffn_gate_inp": "block_sparse_moe.gate", "ffn_gate_exps": "block_sparse_moe.experts.{e}.w1",
    "ffn_up_exps": "block_sparse_moe.experts.{e}.w3", "ffn_down_exps": "block_sparse_moe.experts.{e}.w2",
}
# Gemma's four norms a layer: llama.cpp's ffn_norm is the one before the MLP
_GEMMA_MAP = {**_LAYER_MAP, "post_attention_norm": "post_attention_layernorm",
              "ffn_norm": "pre_feedforward_layernorm", "post_ffw_norm": "post_feedforward_layernorm"}
# Phi-3 keeps q/k/v fused, and gate/up fused in ffn_up (gate rows first), as its HF checkpoint does
_PHI3_MAP = {**_LAYER_MAP, "attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"}
_TOP_MAP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_CONFIG_TENSORS = ("rope_factors_long.weight", "rope_factors_short.weight")  # Phi-3's longrope factors


@dataclass(frozen=True)
class GGUFArch:
    model_type: str  # transformers' model_type
    hf_arch: str  # the HF architecture (the registry's key)
    layer_map: dict[str, str]
    norm_offset: float = 0.0  # llama.cpp stores Gemma's norm weights w as 1 + w


GGUF_ARCHS = {
    "llama": GGUFArch("llama", "LlamaForCausalLM", _LAYER_MAP),
    "qwen2": GGUFArch("qwen2", "Qwen2ForCausalLM", _LAYER_MAP),
    "qwen3": GGUFArch("qwen3", "Qwen3ForCausalLM", _LAYER_MAP),
    "qwen2moe": GGUFArch("qwen2_moe", "Qwen2MoeForCausalLM", _MOE_MAP),
    "qwen3moe": GGUFArch("qwen3_moe", "Qwen3MoeForCausalLM", _MOE_MAP),
    "gemma2": GGUFArch("gemma2", "Gemma2ForCausalLM", _GEMMA_MAP, norm_offset=1.0),
    "gemma3": GGUFArch("gemma3_text", "Gemma3ForCausalLM", _GEMMA_MAP, norm_offset=1.0),
    "phi3": GGUFArch("phi3", "Phi3ForCausalLM", _PHI3_MAP),
}
_MIXTRAL = GGUFArch("mixtral", "MixtralForCausalLM", _MIXTRAL_MAP)  # llama with experts


def gguf_arch(arch: str, expert_count: int = 0) -> GGUFArch:
    """How a GGUF architecture maps to ours; a ValueError naming it and the supported ones."""
    if arch not in GGUF_ARCHS:
        raise ValueError(f"GGUF architecture {arch!r} is not supported (supported: {', '.join(GGUF_ARCHS)})")
    return _MIXTRAL if arch == "llama" and expert_count > 0 else GGUF_ARCHS[arch]


def hf_tensor_name(gguf_name: str, arch: str = "llama", expert_count: int = 0) -> str:
    """llama.cpp's tensor name (blk.3.attn_q.weight) -> the HF checkpoint's (model.layers.3.self_attn.q_proj.weight).

    A stacked expert tensor's name holds ``{e}`` where the expert index goes."""
    parts = gguf_name.split(".")
    table = gguf_arch(arch, expert_count).layer_map if parts[0] == "blk" else _TOP_MAP
    kind = parts[2] if parts[0] == "blk" else parts[0]
    if kind not in table:
        raise ValueError(f"GGUF tensor {gguf_name!r} has no Hugging Face counterpart here (architecture {arch})")
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
    return _dequantize(t, t.data).reshape(_hf_shape(t))


def _dequantize(t, data: np.ndarray) -> np.ndarray:
    import gguf
    try:
        return gguf.quants.dequantize(data, t.tensor_type).astype(np.float32)
    except NotImplementedError as e:
        raise ValueError(f"GGUF tensor {t.name!r} has type {t.tensor_type.name}, which cannot be read "
                         f"(no dequantization for it in the gguf package)") from e


def _hf_shape(t) -> list[int]:
    return [int(d) for d in reversed(t.shape)]


def cache_root() -> Path:
    return Path(os.environ.get("RADIXLANG_CACHE", Path.home() / ".cache" / "radixlang"))


def converted_dir_for(gguf_path: str) -> Path:
    st = os.stat(gguf_path)
    key = hashlib.sha256(f"{os.path.abspath(gguf_path)}|{st.st_size}|{int(st.st_mtime)}|v2".encode()).hexdigest()[:16]
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


class _Entry:
    """One GGUF tensor's HF tensors: ``names`` (one, or one per expert of a stacked tensor, each of
    ``shape``), laid out back to back; ``load()`` gives them all as one array."""

    def __init__(self, names: list[str], shape: list[int], dtype: str, load: Callable[[], np.ndarray]) -> None:
        self.names, self.shape, self.dtype, self.load = names, shape, dtype, load


def _entries(reader, arch: str, spec: GGUFArch, n_head: int, n_kv: int, n_experts: int) -> list[_Entry]:
    entries = []
    for t in reader.tensors:
        if t.name in _CONFIG_TENSORS:
            continue
        name = hf_tensor_name(t.name, arch, n_experts)
        shape = _hf_shape(t)
        kind = t.name.split(".")[2] if t.name.startswith("blk.") else t.name.split(".")[0]
        offset = spec.norm_offset if kind.endswith("norm") else 0.0
        keep_f16 = t.tensor_type.name == "F16" and not offset

        def load(t=t, offset=offset, keep_f16=keep_f16) -> np.ndarray:
            arr = (np.asarray(t.data).view(np.float16).reshape(_hf_shape(t)) if keep_f16
                   else dequantize_tensor(t))
            arr = restore_layout(arch, t.name, arr, n_head, n_kv)
            return arr - np.float32(offset) if offset else arr

        dtype = "F16" if keep_f16 else "F32"
        if "{e}" in name:
            entries.append(_Entry([name.format(e=e) for e in range(shape[0])], shape[1:], dtype, load))
        else:
            entries.append(_Entry([name], shape, dtype, load))
    return entries


def _write_safetensors(path: Path, entries: list[_Entry]) -> None:
    """A safetensors file written one GGUF tensor at a time (the header first, from the shapes)."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for entry in entries:
        nbytes = int(np.prod(entry.shape, dtype=np.int64)) * (2 if entry.dtype == "F16" else 4)
        for name in entry.names:
            if name in header:
                raise ValueError(f"GGUF file holds tensor {name!r} twice")
            header[name] = {"dtype": entry.dtype, "shape": entry.shape, "data_offsets": [offset, offset + nbytes]}
            offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for entry in entries:
            arr = np.ascontiguousarray(entry.load(), dtype=np.float16 if entry.dtype == "F16" else np.float32)
            if list(arr.shape) != ([len(entry.names)] if len(entry.names) > 1 else []) + entry.shape:
                raise ValueError(f"GGUF tensor for {entry.names[0]!r} has shape {list(arr.shape)}")
            f.write(arr.tobytes())


def _config_kwargs(reader, arch: str, spec: GGUFArch, n_head: int, n_kv: int, n_experts: int,
                   layer_tensors: set[str]) -> dict[str, Any]:
    """The transformers config fields of the GGUF's metadata beyond the common ones, per architecture."""
    def key(name: str, default: Any = None) -> Any:
        return _field(reader, f"{arch}.{name}", default)

    hidden, layers = int(key("embedding_length")), int(key("block_count"))
    head_dim = int(key("attention.key_length") or hidden // n_head)
    theta = float(key("rope.freq_base", 10000.0))
    extra: dict[str, Any] = {"head_dim": head_dim}  # Qwen3's config defaults to 128 otherwise
    window = key("attention.sliding_window")
    if window:
        extra["sliding_window"] = int(window)
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": theta}
    scaling = key("rope.scaling.type")
    if scaling == "linear":
        rope = {"rope_type": "linear", "rope_theta": theta, "factor": float(key("rope.scaling.factor"))}
    elif scaling not in (None, "none"):
        raise ValueError(f"GGUF rope scaling {scaling!r} ({arch}) is not supported (supported: linear)")
    if spec.norm_offset:  # Gemma 2 / 3
        for name in ("attn_logit_softcapping", "final_logit_softcapping"):
            if key(name) is not None:
                extra[name] = float(key(name))
        # llama.cpp's own rule (the GGUF has no query_pre_attn_scalar): hidden / heads for the 27B models
        extra["query_pre_attn_scalar"] = hidden // n_head if layers in (46, 62) else head_dim
        pattern = key("attention.sliding_window_pattern")
        if pattern is not None:
            flags = ([bool(x) for x in pattern] if isinstance(pattern, list)
                     else [i % int(pattern) < int(pattern) - 1 for i in range(layers)])
            extra["layer_types"] = ["sliding_attention" if f else "full_attention" for f in flags]
        if arch == "gemma3":
            local = {"rope_type": "default", "rope_theta": float(key("rope.freq_base_swa", 10000.0))}
            extra["rope_parameters"] = {"full_attention": rope, "sliding_attention": local}
        else:
            extra["rope_parameters"] = rope
        return extra
    if arch == "phi3":
        rotary = key("rope.dimension_count")
        if rotary is not None:
            rope["partial_rotary_factor"] = int(rotary) / head_dim
        factors = {t.name: dequantize_tensor(t).reshape(-1).tolist() for t in reader.tensors
                   if t.name in _CONFIG_TENSORS}
        if factors:
            orig = int(key("rope.scaling.original_context_length") or key("context_length"))
            rope.update(rope_type="longrope", original_max_position_embeddings=orig,
                        long_factor=factors["rope_factors_long.weight"],
                        short_factor=factors["rope_factors_short.weight"])
            extra["original_max_position_embeddings"] = orig
            if key("rope.scaling.attn_factor") is not None:
                rope["attention_factor"] = float(key("rope.scaling.attn_factor"))
    extra["rope_parameters"] = rope
    if n_experts:
        if spec is _MIXTRAL:
            extra.update(num_local_experts=n_experts, num_experts_per_tok=int(key("expert_used_count")))
        else:
            norm_default = arch == "qwen3moe"  # llama.cpp's defaults: Qwen3-MoE renormalises, Qwen2-MoE not
            sparse = [i for i in range(layers) if f"blk.{i}.ffn_gate_inp.weight" in layer_tensors]
            extra.update(num_experts=n_experts, num_experts_per_tok=int(key("expert_used_count")),
                         moe_intermediate_size=int(key("expert_feed_forward_length")),
                         norm_topk_prob=bool(key("expert_weights_norm", norm_default)), decoder_sparse_step=1,
                         mlp_only_layers=[i for i in range(layers) if i not in sparse])
            if key("expert_shared_feed_forward_length") is not None:
                extra["shared_expert_intermediate_size"] = int(key("expert_shared_feed_forward_length"))
    return extra


def _convert(gguf_path: str, out: Path) -> None:
    import gguf
    from transformers import AutoConfig, AutoTokenizer

    reader = gguf.GGUFReader(gguf_path)
    arch = _field(reader, "general.architecture")
    n_experts = int(_field(reader, f"{arch}.expert_count", 0) or 0)
    spec = gguf_arch(arch, n_experts)
    n_head = int(_field(reader, f"{arch}.attention.head_count"))
    n_kv = int(_field(reader, f"{arch}.attention.head_count_kv", n_head))
    shapes = {t.name: _hf_shape(t) for t in reader.tensors}
    for t in reader.tensors:  # refuse an unreadable type before writing anything (one row of each tried)
        _dequantize(t, t.data[:1])
    if "token_embd.weight" not in shapes:
        raise ValueError(f"GGUF file {gguf_path} has no token_embd.weight")
    config = AutoConfig.for_model(
        spec.model_type, architectures=[spec.hf_arch],
        vocab_size=int(shapes["token_embd.weight"][0]), hidden_size=int(_field(reader, f"{arch}.embedding_length")),
        intermediate_size=int(_field(reader, f"{arch}.feed_forward_length", 0) or 0),
        num_hidden_layers=int(_field(reader, f"{arch}.block_count")), num_attention_heads=n_head,
        num_key_value_heads=n_kv, max_position_embeddings=int(_field(reader, f"{arch}.context_length", 4096)),
        rms_norm_eps=float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        tie_word_embeddings="output.weight" not in shapes,
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_id=_field(reader, "tokenizer.ggml.eos_token_id"),
        torch_dtype="float32", **_config_kwargs(reader, arch, spec, n_head, n_kv, n_experts, set(shapes)),
    )
    entries = _entries(reader, arch, spec, n_head, n_kv, n_experts)
    config.save_pretrained(out)
    _write_safetensors(out / "model.safetensors", entries)
    src = Path(gguf_path)
    tokenizer = AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name)
    tokenizer.save_pretrained(out)
    (out / "source.json").write_text(json.dumps({"gguf": str(src), "size": os.stat(src).st_size}))
    logger.info("converted %s (%s as %s) -> %s (%d tensors)", src.name, arch, spec.hf_arch, out,
                sum(len(e.names) for e in entries))
