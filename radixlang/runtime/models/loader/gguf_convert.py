"""GGUF -> a small Hugging Face folder (config.json, the tokenizer files and a generation_config.json of
every EOS id), cached on disk; the weights stay in the GGUF file and are read from it at load time
(gguf_weights.py), one tensor at a time.

The GGUF metadata maps to a transformers config per architecture (llama, qwen2, qwen3, qwen2moe,
qwen3moe, gemma2, gemma3, phi3, deepseek2: see gguf_weights.py for the tensors); transformers supplies
the tokenizer and chat template from the GGUF metadata. Phi-3's longrope factors are tensors of the file
that go into the config. The folder is written atomically under the user cache, keyed by the GGUF
file's path, size and modification time, and names its file in ``source.json``, so later starts read
the small folder and the file directly. (Folders of the earlier design, which held every tensor
dequantized to float32 in a ``model.safetensors``, have another key and are never used again.)
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from radixlang.runtime.models.loader.gguf_file import GGUFFile, read_gguf
from radixlang.runtime.models.loader.gguf_weights import (
    CONFIG_TENSORS, DEEPSEEK_V3, MIXTRAL, GGUFArch, check_readable, dequantize_tensor, file_arch, hf_shape,
)

logger = logging.getLogger(__name__)

_CACHE_FORMAT = "v5"  # v2: with a float32 model.safetensors; v3: config and tokenizer only; v4: and
# generation_config.json (every EOS id); v5: and the file's general.sampling.* defaults in it
SOURCE_FILE = "source.json"


def cache_root() -> Path:
    return Path(os.environ.get("RADIXLANG_CACHE", Path.home() / ".cache" / "radixlang"))


def converted_dir_for(gguf_path: str) -> Path:
    st = os.stat(gguf_path)
    stamp = f"{os.path.abspath(gguf_path)}|{st.st_size}|{int(st.st_mtime)}|{_CACHE_FORMAT}"
    return cache_root() / f"{Path(gguf_path).stem}-{hashlib.sha256(stamp.encode()).hexdigest()[:16]}"


def ensure_converted(gguf_path: str, *, gguf_file: GGUFFile | None = None) -> str:
    """Return the HF folder (config and tokenizer) of the GGUF file, writing it once. ``gguf_file``: the
    file's header as the caller already read it (a start parses it once), else it is read here when the
    folder has to be written."""
    out = converted_dir_for(gguf_path)
    if (out / "complete").exists():
        return str(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".", dir=out.parent))
    try:
        _convert(gguf_path, tmp, gguf_file if gguf_file is not None else read_gguf(gguf_path))
        (tmp / "complete").write_text("ok")
        try:
            os.rename(tmp, out)
        except OSError:  # another process won the race
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return str(out)


def gguf_of_folder(folder: str) -> str | None:
    """The GGUF file whose weights a converted folder stands for, or None for any other folder (one
    holding safetensors reads them, as a folder of the earlier design does)."""
    source = Path(folder) / SOURCE_FILE
    if not source.exists() or any(Path(folder).glob("*.safetensors")):
        return None
    path = json.loads(source.read_text()).get("gguf")
    if not path or not os.path.exists(path):
        raise FileNotFoundError(f"{folder} holds the config of GGUF file {path!r}, which no longer exists; "
                                f"pass the GGUF file itself")
    return str(path)


class _Meta:
    """The GGUF metadata of one architecture: ``key("embedding_length")`` reads ``{arch}.embedding_length``."""

    def __init__(self, gguf_file: GGUFFile, arch: str, spec: GGUFArch) -> None:
        self.file, self.arch, self.spec = gguf_file, arch, spec
        self.n_head = int(self.key("attention.head_count"))
        self.n_experts = int(self.key("expert_count", 0) or 0)
        self.shapes = {t.name: hf_shape(t) for t in gguf_file.tensors}
        self.layers = int(self.key("block_count"))

    def key(self, name: str, default: Any = None) -> Any:
        return self.file.fields.get(f"{self.arch}.{name}", default)

    def sparse_layers(self) -> list[int]:
        return [i for i in range(self.layers) if f"blk.{i}.ffn_gate_inp.weight" in self.shapes]


def _common_config(m: _Meta) -> dict[str, Any]:
    """The config fields every architecture shares."""
    if "token_embd.weight" not in m.shapes:
        raise ValueError("GGUF file has no token_embd.weight")
    return dict(
        architectures=[m.spec.hf_arch], vocab_size=int(m.shapes["token_embd.weight"][0]),
        hidden_size=int(m.key("embedding_length")), intermediate_size=int(m.key("feed_forward_length", 0) or 0),
        num_hidden_layers=m.layers, num_attention_heads=m.n_head,
        num_key_value_heads=int(m.key("attention.head_count_kv", m.n_head)),
        max_position_embeddings=int(m.key("context_length", 4096)),
        rms_norm_eps=float(m.key("attention.layer_norm_rms_epsilon", 1e-5)),
        tie_word_embeddings="output.weight" not in m.shapes,
        bos_token_id=m.file.fields.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=m.file.fields.get("tokenizer.ggml.eos_token_id"), torch_dtype="float32",
    )


def _rope(m: _Meta) -> dict[str, Any]:
    theta = float(m.key("rope.freq_base", 10000.0))
    scaling = m.key("rope.scaling.type")
    if scaling in (None, "none"):
        return {"rope_type": "default", "rope_theta": theta}
    if scaling == "linear":
        return {"rope_type": "linear", "rope_theta": theta, "factor": float(m.key("rope.scaling.factor"))}
    if scaling == "yarn" and m.arch == "deepseek2":
        return _deepseek_yarn(m, theta)
    if scaling == "yarn" and m.arch == "gpt-oss":  # the file keeps no truncate flag: GPT-OSS's is off
        return {**_yarn(m, theta), "truncate": False}
    raise ValueError(f"GGUF rope scaling {scaling!r} ({m.arch}) is not supported (supported: linear; "
                     f"yarn on deepseek2 and gpt-oss)")


def _config_kwargs(m: _Meta) -> dict[str, Any]:
    """The transformers config fields of the GGUF's metadata beyond the common ones, per architecture."""
    if m.arch == "deepseek2":
        return _deepseek_config(m)
    head_dim = int(m.key("attention.key_length") or int(m.key("embedding_length")) // m.n_head)
    extra: dict[str, Any] = {"head_dim": head_dim}  # Qwen3's config defaults to 128 otherwise
    window = m.key("attention.sliding_window")
    if window:
        extra["sliding_window"] = int(window)
    if m.spec.norm_offset:  # Gemma 2 / 3
        return {**extra, **_gemma_config(m, head_dim)}
    rope = _rope(m)
    if m.arch == "phi3":
        extra.update(_phi3_rope(m, rope, head_dim))
    extra["rope_parameters"] = rope
    if m.arch == "gpt-oss":
        extra.update(_gpt_oss_config(m))
    elif m.n_experts:
        extra.update(_moe_config(m))
    return extra


def _gpt_oss_config(m: _Meta) -> dict[str, Any]:
    """GPT-OSS: windows on even layers and the SwiGLU clamp at 7, as llama.cpp fixes them (the file keeps
    neither); every layer is MoE, its experts' size in expert_feed_forward_length."""
    return dict(num_local_experts=m.n_experts, num_experts_per_tok=int(m.key("expert_used_count")),
                intermediate_size=int(m.key("expert_feed_forward_length") or m.key("feed_forward_length")),
                layer_types=["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(m.layers)],
                attention_bias=True, swiglu_limit=7.0)


def _gemma_config(m: _Meta, head_dim: int) -> dict[str, Any]:
    extra: dict[str, Any] = {}
    for name in ("attn_logit_softcapping", "final_logit_softcapping"):
        if m.key(name) is not None:
            extra[name] = float(m.key(name))
    # llama.cpp's own rule (the GGUF has no query_pre_attn_scalar): hidden / heads for the 27B models
    extra["query_pre_attn_scalar"] = int(m.key("embedding_length")) // m.n_head if m.layers in (46, 62) else head_dim
    pattern = m.key("attention.sliding_window_pattern")
    if pattern is not None:
        flags = ([bool(x) for x in pattern] if isinstance(pattern, list)
                 else [i % int(pattern) < int(pattern) - 1 for i in range(m.layers)])
        extra["layer_types"] = ["sliding_attention" if f else "full_attention" for f in flags]
    rope = _rope(m)
    if m.arch == "gemma3":
        local = {"rope_type": "default", "rope_theta": float(m.key("rope.freq_base_swa", 10000.0))}
        extra["rope_parameters"] = {"full_attention": rope, "sliding_attention": local}
    else:
        extra["rope_parameters"] = rope
    return extra


def _phi3_rope(m: _Meta, rope: dict[str, Any], head_dim: int) -> dict[str, Any]:
    """Partial rotary and longrope (the factors are tensors of the file); updates ``rope`` in place."""
    rotary = m.key("rope.dimension_count")
    if rotary is not None:
        rope["partial_rotary_factor"] = int(rotary) / head_dim
    factors = {t.name: dequantize_tensor(t).reshape(-1).tolist() for t in m.file.tensors
               if t.name in CONFIG_TENSORS}
    if not factors:
        return {}
    orig = int(m.key("rope.scaling.original_context_length") or m.key("context_length"))
    rope.update(rope_type="longrope", original_max_position_embeddings=orig,
                long_factor=factors["rope_factors_long.weight"], short_factor=factors["rope_factors_short.weight"])
    if m.key("rope.scaling.attn_factor") is not None:
        rope["attention_factor"] = float(m.key("rope.scaling.attn_factor"))
    return {"original_max_position_embeddings": orig}


def _moe_config(m: _Meta) -> dict[str, Any]:
    if m.spec is MIXTRAL:
        return dict(num_local_experts=m.n_experts, num_experts_per_tok=int(m.key("expert_used_count")))
    norm_default = m.arch == "qwen3moe"  # llama.cpp's defaults: Qwen3-MoE renormalises, Qwen2-MoE not
    sparse = m.sparse_layers()
    extra = dict(num_experts=m.n_experts, num_experts_per_tok=int(m.key("expert_used_count")),
                 moe_intermediate_size=int(m.key("expert_feed_forward_length")),
                 norm_topk_prob=bool(m.key("expert_weights_norm", norm_default)), decoder_sparse_step=1,
                 mlp_only_layers=[i for i in range(m.layers) if i not in sparse])
    if m.key("expert_shared_feed_forward_length") is not None:
        extra["shared_expert_intermediate_size"] = int(m.key("expert_shared_feed_forward_length"))
    return extra


def _deepseek_config(m: _Meta) -> dict[str, Any]:
    """DeepSeek-V2/V3 (deepseek2). llama.cpp writes MLA as multi-query attention over the latent: newer
    files give key_length = kv_lora_rank + rope and the per-head sizes in key_length_mla /
    value_length_mla, older ones the per-head sizes in key_length / value_length."""
    rope_dim = int(m.key("rope.dimension_count"))
    per_head = m.key("attention.key_length_mla") is not None
    qk = int(m.key("attention.key_length_mla" if per_head else "attention.key_length"))
    v = int(m.key("attention.value_length_mla" if per_head else "attention.value_length"))
    q_rank = int(m.key("attention.q_lora_rank", 0) or 0)
    extra: dict[str, Any] = dict(
        num_key_value_heads=m.n_head, head_dim=rope_dim, qk_rope_head_dim=rope_dim, qk_nope_head_dim=qk - rope_dim,
        v_head_dim=v, kv_lora_rank=int(m.key("attention.kv_lora_rank")), q_lora_rank=q_rank or None,
        rms_norm_eps=float(m.key("attention.layer_norm_rms_epsilon", 1e-6)), rope_parameters=_rope(m))
    if m.n_experts:
        extra.update(_deepseek_moe(m))
    else:  # dense throughout
        extra.update(first_k_dense_replace=m.layers, n_routed_experts=None, n_shared_experts=0)
    return extra


def _deepseek_moe(m: _Meta) -> dict[str, Any]:
    """Routing: V2's softmax (llama.cpp's default when expert_gating_func is absent) or V3's sigmoid with
    the selection bias (exp_probs_b); groups when expert_group_count > 1."""
    sparse = m.sparse_layers()
    groups, used = int(m.key("expert_group_count", 0) or 0), int(m.key("expert_group_used_count", 0) or 0)
    extra: dict[str, Any] = dict(
        n_routed_experts=m.n_experts, num_experts_per_tok=int(m.key("expert_used_count")),
        n_shared_experts=int(m.key("expert_shared_count", 0) or 0),
        moe_intermediate_size=int(m.key("expert_feed_forward_length")),
        first_k_dense_replace=int(m.key("leading_dense_block_count", sparse[0] if sparse else m.layers)),
        routed_scaling_factor=float(m.key("expert_weights_scale", 1.0) or 1.0),
        norm_topk_prob=bool(m.key("expert_weights_norm", False)),
        n_group=max(groups, 1), topk_group=max(used, 1) if groups > 1 else 1)
    if m.spec is not DEEPSEEK_V3:
        extra["topk_method"] = "group_limited_greedy" if groups > 1 else "greedy"
    return extra


def _yarn(m: _Meta, theta: float) -> dict[str, Any]:
    """The yarn fields a GGUF keeps: factor, original context, beta_fast / beta_slow."""
    return {"rope_type": "yarn", "rope_theta": theta, "factor": float(m.key("rope.scaling.factor")),
            "original_max_position_embeddings": int(m.key("rope.scaling.original_context_length")),
            "beta_fast": float(m.key("rope.scaling.yarn_beta_fast", 32.0)),
            "beta_slow": float(m.key("rope.scaling.yarn_beta_slow", 1.0))}


def _deepseek_yarn(m: _Meta, theta: float) -> dict[str, Any]:
    """DeepSeek's yarn. llama.cpp keeps 0.1 * mscale_all_dim as yarn_log_multiplier and no mscale: every
    DeepSeek release has mscale == mscale_all_dim (the rotary tables then stay unscaled, the softmax
    scale takes mscale squared), so both are read back from it."""
    rope = _yarn(m, theta)
    log_mul = m.key("rope.scaling.yarn_log_multiplier")
    if log_mul:
        rope["mscale"] = rope["mscale_all_dim"] = float(log_mul) / 0.1
    return rope


def _tokenizer(src: Path) -> Any:
    """The tokenizer and chat template of the GGUF's metadata. AutoTokenizer reads the file's config too,
    and refuses architectures transformers cannot load from a GGUF (deepseek2 with a ValueError, gpt-oss
    with a TypeError reading its metadata): the tokenizer alone comes from ``tokenizer.ggml.model`` then."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    try:
        return AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name)
    except (ValueError, TypeError) as e:
        logger.info("GGUF %s: tokenizer read without transformers' config (%s)", src.name, e)
        return PreTrainedTokenizerFast.from_pretrained(str(src.parent), gguf_file=src.name)


# the tokens chat templates end a turn with; llama.cpp counts them as end-of-generation by their text too
_END_OF_TURN = ("<|eot_id|>", "<|eom_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|return|>", "<|call|>")


def eos_token_ids(fields: dict[str, Any], tokenizer: Any) -> list[int]:
    """Every id that ends a reply: the file's EOS, EOT and EOM ids, and the end-of-turn token its chat
    template writes (Gemma's ``<end_of_turn>``, which the file's EOS id does not name)."""
    ids = [fields.get(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
    template = fields.get("tokenizer.chat_template") or ""
    vocab = tokenizer.get_vocab()
    # harmony (GPT-OSS) ends a reasoning message with <|end|> and goes on with the final one
    harmony = "<|channel|>" in template
    ids += [vocab.get(t) for t in _END_OF_TURN if t in template and not (harmony and t == "<|end|>")]
    return list(dict.fromkeys(int(i) for i in ids if i is not None))


# general.sampling.* (what llama.cpp's converter copies from the model's generation_config.json) ->
# generation_config.json's names, read by runtime/generation_config.py under --generation-config auto
_GGUF_SAMPLING = {"general.sampling.temp": "temperature", "general.sampling.top_p": "top_p",
                  "general.sampling.top_k": "top_k", "general.sampling.min_p": "min_p",
                  "general.sampling.penalty_repeat": "repetition_penalty"}


def gguf_sampling_defaults(fields: dict[str, Any]) -> dict[str, Any]:
    """The sampling defaults a GGUF's metadata carries, under generation_config.json's names."""
    out: dict[str, Any] = {}
    for key, name in _GGUF_SAMPLING.items():
        value = fields.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            out[name] = int(value) if name == "top_k" else float(value)
    return out


def _convert(gguf_path: str, out: Path, gguf_file: GGUFFile) -> None:
    from transformers import AutoConfig

    arch, spec = file_arch(gguf_file.fields)
    check_readable(gguf_file.tensors)  # refuse an unreadable tensor type now, not halfway through a load
    meta = _Meta(gguf_file, arch, spec)
    kwargs = {**_common_config(meta), **_config_kwargs(meta)}
    AutoConfig.for_model(spec.model_type, **kwargs).save_pretrained(out)
    src = Path(gguf_path)
    tokenizer = _tokenizer(src)
    tokenizer.save_pretrained(out)
    eos = eos_token_ids(gguf_file.fields, tokenizer)
    sampling = gguf_sampling_defaults(gguf_file.fields)
    if eos or sampling:
        (out / "generation_config.json").write_text(json.dumps(
            {"bos_token_id": gguf_file.fields.get("tokenizer.ggml.bos_token_id"),
             **({"eos_token_id": eos} if eos else {}), **sampling}, indent=2))
    (out / SOURCE_FILE).write_text(json.dumps({"gguf": str(src.resolve()), "size": os.stat(src).st_size}))
    logger.info("GGUF %s (%s as %s): config and tokenizer in %s; weights read from the file at load",
                src.name, arch, spec.hf_arch, out)
