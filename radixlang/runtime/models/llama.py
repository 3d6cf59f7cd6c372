"""Llama-family decoder (Llama, Mistral, Qwen2, SmolLM) whose attention runs through the AttentionBackend.

q/k/v and gate/up are fused into one matmul each: on a CPU at batch 1 the
number of ops per layer matters as much as their size.
"""
from __future__ import annotations

import math
from typing import Any, Iterable

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


def _rope_inv_freq(config: Any, head_dim: int) -> torch.Tensor:
    # transformers >= 5 keeps theta and scaling in `rope_parameters`; older configs use the flat fields
    params = getattr(config, "rope_parameters", None) or {}
    theta = float(params.get("rope_theta") or getattr(config, "rope_theta", None) or 10000.0)
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    scaling = params or getattr(config, "rope_scaling", None) or {}
    kind = scaling.get("rope_type", scaling.get("type", "default")) if scaling else "default"
    if kind in ("default", None):
        return inv_freq
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind == "llama3":
        factor = float(scaling["factor"])
        low, high = float(scaling.get("low_freq_factor", 1.0)), float(scaling.get("high_freq_factor", 4.0))
        old_ctx = float(scaling.get("original_max_position_embeddings", 8192))
        wavelen = 2 * math.pi / inv_freq
        smooth = (old_ctx / wavelen - low) / (high - low)
        scaled = torch.where(wavelen > old_ctx / low, inv_freq / factor, inv_freq)
        mid = (wavelen <= old_ctx / low) & (wavelen >= old_ctx / high)
        return torch.where(mid, (1 - smooth) * inv_freq / factor + smooth * inv_freq, scaled)
    raise ValueError(f"rope_scaling type {kind!r} is not supported (supported: default, linear, llama3)")


class Attention(nn.Module):
    def __init__(self, config: Any, layer_id: int) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        self.scaling = self.head_dim ** -0.5
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        bias = bool(getattr(config, "attention_bias", False)) or config.model_type == "qwen2"
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=bias)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, forward_batch: Any) -> torch.Tensor:
        # x [num_tokens, hidden]; cos/sin [num_tokens, head_dim]
        qkv = self.qkv_proj(x)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        n = x.shape[0]
        q = _apply_rope(q.view(n, self.num_heads, self.head_dim), cos, sin)
        k = _apply_rope(k.view(n, self.num_kv_heads, self.head_dim), cos, sin)
        v = v.view(n, self.num_kv_heads, self.head_dim)
        out = forward_batch.attn_backend.forward(q, k, v, self, forward_batch)  # [n, heads, head_dim]
        return self.o_proj(out.reshape(n, self.q_size))


def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x [n, heads, head_dim]; rotate_half layout as in HF Llama
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    rotated = torch.cat((-x2, x1), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


class MLP(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.inter = config.intermediate_size
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * self.inter, bias=False)
        self.down_proj = nn.Linear(self.inter, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.inter, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, config: Any, layer_id: int) -> None:
        super().__init__()
        self.self_attn = Attention(config, layer_id)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, forward_batch: Any) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, forward_batch)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: Any, *, dtype: torch.dtype = torch.float32, device: str = "cpu") -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.lm_head = None if self.tie_word_embeddings else nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        attn = self.layers[0].self_attn
        self.num_heads, self.num_kv_heads, self.head_dim = attn.num_heads, attn.num_kv_heads, attn.head_dim
        max_pos = int(getattr(config, "max_position_embeddings", 8192) or 8192)
        inv_freq = _rope_inv_freq(config, self.head_dim)
        freqs = torch.outer(torch.arange(max_pos, dtype=torch.float64), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos_cache", emb.cos().to(dtype), persistent=False)  # [max_pos, head_dim]
        self.register_buffer("sin_cache", emb.sin().to(dtype), persistent=False)
        self.to(dtype=dtype, device=device)
        self.requires_grad_(False)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, forward_batch: Any) -> torch.Tensor:
        """input_ids, positions [num_tokens] int64 -> hidden [num_tokens, hidden] after the final norm."""
        x = self.embed_tokens(input_ids)
        cos, sin = self.cos_cache[positions], self.sin_cache[positions]
        for layer in self.layers:
            x = layer(x, cos, sin, forward_batch)
        return self.norm(x)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.lm_head is None:
            return F.linear(hidden, self.embed_tokens.weight).float()  # [n, vocab]
        return self.lm_head(hidden).float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load HF-named tensors (model.layers.N.self_attn.q_proj.weight, ...), fusing q/k/v and gate/up."""
        params = dict(self.named_parameters())
        fused = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
                 "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
        seen: set[str] = set()
        for name, tensor in weights:
            name = name.removeprefix("model.")
            if "rotary_emb" in name:
                continue
            if name == "lm_head.weight" and self.lm_head is None:
                continue
            parts = name.split(".")
            if len(parts) >= 2 and parts[-2] in fused:
                target, shard = fused[parts[-2]]
                pname = ".".join(parts[:-2] + [target, parts[-1]])
                param = params[pname]
                offset, size = self._shard_range(target, shard)
                param.data[offset:offset + size].copy_(tensor)
                seen.add(f"{pname}:{shard}")
                continue
            if name not in params:
                raise ValueError(f"unexpected weight {name!r} for {type(self).__name__}")
            params[name].data.copy_(tensor)
            seen.add(name)
        missing = [n for n in params if n not in seen and not any(s.startswith(n + ":") for s in seen)]
        if missing:
            raise ValueError(f"weights missing from checkpoint: {missing[:5]}{'...' if len(missing) > 5 else ''}")

    def _shard_range(self, target: str, shard: int) -> tuple[int, int]:
        if target == "qkv_proj":
            q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
            return [(0, q), (q, kv), (q + kv, kv)][shard]
        inter = self.config.intermediate_size
        return (shard * inter, inter)


EntryClass = LlamaForCausalLM
