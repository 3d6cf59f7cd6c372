"""Tiny random-weight models for tests: a config folder plus the embedded model's tokenizer."""
from __future__ import annotations

import functools
import json
import os
import shutil

from radixlang.runtime.models.loader.model_loader import default_model_path, resolve_model_dir

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


def private_cache(root, monkeypatch) -> None:
    """Point ``RADIXLANG_CACHE`` at ``root`` (GGUF conversions land there, apart from other tests') while
    the compiled kernels stay shared: ``root/kernels`` links to the machine's kernel cache, so a test does
    not rebuild them (~10 s of compiling each). Set it after any GGUF the test reads from the real cache."""
    from radixlang.kernels.cpu import build
    kernels = build.cache_dir()
    kernels.mkdir(parents=True, exist_ok=True)
    os.makedirs(root, exist_ok=True)
    os.symlink(kernels, os.path.join(root, "kernels"))
    monkeypatch.setenv("RADIXLANG_CACHE", str(root))


def smollm_dir() -> str:
    """The converted SmolLM2-135M-Instruct folder (converted once, then cached): config and tokenizer;
    loading it reads the weights from the embedded GGUF."""
    return resolve_model_dir(None)


@functools.cache
def smollm_hf_model():
    """transformers' own SmolLM2-135M-Instruct in float32, read from the embedded GGUF by transformers'
    GGUF loader (the converted folder holds no weights for it to read). Loaded once per test process
    (~20 s); callers only read it."""
    import torch
    from transformers import AutoModelForCausalLM

    path = default_model_path()
    return AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                dtype=torch.float32).eval()


def make_tiny_model_dir(path: str, *, num_layers: int = 2, hidden: int = 64, heads: int = 4, kv_heads: int = 2,
                        model_type: str = "llama", tie: bool = True, max_pos: int = 2048) -> str:
    os.makedirs(path, exist_ok=True)
    src = smollm_dir()
    for name in TOKENIZER_FILES:
        if os.path.exists(os.path.join(src, name)):
            shutil.copy(os.path.join(src, name), os.path.join(path, name))
    arch = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}[model_type]
    config = {
        "architectures": [arch], "model_type": model_type, "vocab_size": 49152, "hidden_size": hidden,
        "intermediate_size": hidden * 2, "num_hidden_layers": num_layers, "num_attention_heads": heads,
        "num_key_value_heads": kv_heads, "max_position_embeddings": max_pos, "rms_norm_eps": 1e-5,
        "rope_theta": 50000.0, "tie_word_embeddings": tie, "bos_token_id": 1, "eos_token_id": 2,
        "torch_dtype": "float32",
    }
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    return path


def make_tiny_safetensors_dir(path: str, *, num_layers: int = 2, hidden: int = 64, heads: int = 4, kv_heads: int = 2,
                              tie: bool = False, rope_scaling: dict | None = None, seed: int = 0) -> str:
    """A real HF checkpoint folder: random weights saved by transformers' own LlamaForCausalLM."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    make_tiny_model_dir(path, num_layers=num_layers, hidden=hidden, heads=heads, kv_heads=kv_heads, tie=tie)
    extra = {} if rope_scaling is None else {"rope_scaling": {"rope_theta": 50000.0, **rope_scaling}}
    config = LlamaConfig(vocab_size=49152, hidden_size=hidden, intermediate_size=hidden * 2,
                         num_hidden_layers=num_layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                         max_position_embeddings=2048, rms_norm_eps=1e-5, rope_theta=50000.0,
                         tie_word_embeddings=tie, bos_token_id=1, eos_token_id=2, **extra)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).float()
    with torch.no_grad():  # norms away from 1 so a swapped or missing norm weight shows up
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
    model.save_pretrained(path, safe_serialization=True)
    return path


def tied_toy_model():
    """Two linears and tied embeddings (``lm_head`` None): what quantize_model_ / pack_model_ rewrite."""
    from torch import nn

    class TiedToy(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed_tokens = nn.Embedding(50, 16)
            self.block = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16))
            self.lm_head = None

    return TiedToy()


# every family the model tests build (tests/runtime/models/test_model_families.py against transformers, tests/e2e/
# test_tensor_parallel_families.py tp=2 against tp=1): HF architecture, config overrides
WINDOW = 5  # shorter than every prompt the tests run
FAMILIES = {
    "llama": ("LlamaForCausalLM", {}),
    # the regression of issue 22: Qwen2 with sliding layers matched transformers on the first five
    # positions only (the window was ignored)
    "qwen2_sliding": ("Qwen2ForCausalLM", dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1)),
    "qwen2": ("Qwen2ForCausalLM", {}),
    "mistral_sliding": ("MistralForCausalLM", dict(sliding_window=WINDOW)),
    "qwen3": ("Qwen3ForCausalLM", {}),
    "qwen3_sliding": ("Qwen3ForCausalLM", dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=2)),
    # softcaps small enough to bite on random weights; layers alternate sliding / full
    "gemma2": ("Gemma2ForCausalLM", dict(sliding_window=WINDOW, attn_logit_softcapping=0.5,
                                         final_logit_softcapping=3.0, query_pre_attn_scalar=24,
                                         layer_types=["sliding_attention", "full_attention", "sliding_attention"])),
    "gemma3": ("Gemma3ForCausalLM", dict(sliding_window=WINDOW, query_pre_attn_scalar=24,
                                         layer_types=["sliding_attention", "full_attention", "sliding_attention"])),
    # fused qkv / gate_up in the checkpoint, longrope with partial rotary, a window
    "phi3": ("Phi3ForCausalLM", dict(sliding_window=WINDOW, max_position_embeddings=64,
                                     original_max_position_embeddings=32,
                                     rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                                                      "partial_rotary_factor": 0.75,
                                                      "original_max_position_embeddings": 32,
                                                      "short_factor": [1.0 + 0.3 * i for i in range(6)],
                                                      "long_factor": [2.0 + i for i in range(6)]})),
    # MoE: more experts than top-k; routers drawn large enough that tokens spread unevenly
    "mixtral": ("MixtralForCausalLM", dict(num_local_experts=5, num_experts_per_tok=2, sliding_window=WINDOW)),
    "qwen2_moe": ("Qwen2MoeForCausalLM", dict(num_experts=6, num_experts_per_tok=2, moe_intermediate_size=32,
                                              shared_expert_intermediate_size=48, decoder_sparse_step=1,
                                              mlp_only_layers=[1], norm_topk_prob=False)),
    "qwen3_moe": ("Qwen3MoeForCausalLM", dict(num_experts=6, num_experts_per_tok=3, moe_intermediate_size=32,
                                              norm_topk_prob=True, decoder_sparse_step=1)),
    "gpt_oss": ("GptOssForCausalLM", dict(num_local_experts=5, num_experts_per_tok=2, sliding_window=WINDOW,
                                          layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                                          rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0,
                                                           "original_max_position_embeddings": 512,
                                                           "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False})),
}

# DeepSeek-V2 / V3 (tests/runtime/models/test_deepseek.py against transformers,
# tests/e2e/test_tensor_parallel_families.py
# tp=2 against tp=1): multi-head latent attention over the 6 heads, a dense first layer then MoE layers with a
# shared expert, more experts than top-k over 3 groups, q_lora_rank on V3 and none on V2, yarn on V2
MLA = dict(num_key_value_heads=6, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, head_dim=8, v_head_dim=24,
           n_routed_experts=6, num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1,
           first_k_dense_replace=1, n_group=3, topk_group=2)
MLA_FAMILIES = {
    "deepseek_v2": ("DeepseekV2ForCausalLM", dict(
        MLA, q_lora_rank=None, topk_method="group_limited_greedy", routed_scaling_factor=1.5,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "mscale": 0.707,
                         "mscale_all_dim": 1.0, "original_max_position_embeddings": 512,
                         "beta_fast": 32.0, "beta_slow": 1.0})),
    "deepseek_v3": ("DeepseekV3ForCausalLM", dict(MLA, q_lora_rank=24, norm_topk_prob=True,
                                                  routed_scaling_factor=2.5)),
}

TINY_HF_CONFIG = dict(vocab_size=49152, hidden_size=96, intermediate_size=192, num_hidden_layers=3,
                      num_attention_heads=6, num_key_value_heads=2, head_dim=16, max_position_embeddings=2048,
                      rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)


def save_tiny_hf_model(path: str, arch: str, *, seed: int = 0, base: dict | None = None, **overrides) -> str:
    """A checkpoint folder saved by transformers' own ``arch`` class (e.g. "Qwen2ForCausalLM"): random
    weights, 3 layers, hidden 96, 6 heads over 2 kv heads of 16 dims, norm weights away from their init
    and random biases (so a dropped norm or bias shows up), the SmolLM2 tokenizer. ``overrides`` go to
    the config (sliding windows, expert counts, ...); ``base`` replaces TINY_HF_CONFIG under them (the
    family's own defaults for what it leaves out)."""
    import torch
    import transformers

    os.makedirs(path, exist_ok=True)
    src = smollm_dir()
    for name in TOKENIZER_FILES:
        if os.path.exists(os.path.join(src, name)):
            shutil.copy(os.path.join(src, name), os.path.join(path, name))
    cls = getattr(transformers, arch)
    config = cls.config_class(**{**(TINY_HF_CONFIG if base is None else base), **overrides})
    torch.manual_seed(seed)
    model = cls(config).float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif name.endswith(".bias"):
                p.copy_(0.1 * torch.randn_like(p))
            elif name.endswith((".gate.weight", ".router.weight")):  # an MoE router: decisive, uneven spread
                p.copy_(0.5 * torch.randn_like(p))
            elif name.endswith(".sinks"):  # attention sinks large enough to take real probability mass
                p.copy_(torch.randn_like(p))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # DeepSeek-V3's selection bias: away from zero
                b.copy_(0.3 * torch.randn_like(b))
    model.save_pretrained(path, safe_serialization=True)
    return path
