"""Rotary position embeddings: the inverse frequencies of each scaling rule transformers implements,
the cos / signed-sin tables and the torch rotation (the compiled CPU kernel reads the same tables).

Rules: default, linear, llama3, yarn, longrope, dynamic. Two of them change with the sequence length
in transformers, which re-derives the frequencies from the longest position of each forward call; a cache
of already-rotated keys cannot follow a whole sequence switching tables, so here each position keeps the
table its own length gives (what transformers gives a token decoded at that position):
- longrope (Phi-3): positions before the original context use the short factors, later ones the long
  factors (transformers switches the whole sequence to the long ones once it is longer);
- dynamic (NTK): positions before ``max_position_embeddings`` use the plain frequencies; position p past
  it uses the base theta * (factor * (p + 1) / max_pos - (factor - 1)) ^ (dim / (dim - 2)). The context
  then reaches factor x max_position_embeddings (``rope_context_length``). A prompt longer than
  max_position_embeddings, prefilled at once, is rotated differently by transformers (every position
  with the prompt length's base).
"""
from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch

SUPPORTED_ROPE = ("default", "linear", "llama3", "yarn", "longrope", "dynamic")


def _rope_kind(params: dict) -> str:
    return params.get("rope_type", params.get("type", "default")) or "default"


def _max_positions(config: Any) -> int:
    return int(getattr(config, "max_position_embeddings", 8192) or 8192)


def rope_context_length(config: Any) -> int:
    """The positions the rotary tables cover: max_position_embeddings, times the factor for dynamic NTK."""
    max_pos = _max_positions(config)
    params = rope_parameters(config)
    if _rope_kind(params) == "dynamic":
        return int(max_pos * float(params["factor"]))
    return max_pos


def partial_rotary_factor(config: Any) -> float:
    return float(rope_parameters(config).get("partial_rotary_factor")
                 or getattr(config, "partial_rotary_factor", None) or 1.0)


def rope_parameters(config: Any, layer_type: str | None = None) -> dict:
    """transformers >= 5 keeps theta and scaling in ``rope_parameters`` (per layer type for Gemma3:
    {"full_attention": {...}, "sliding_attention": {...}}); older configs use flat fields."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    if params and all(isinstance(v, dict) for v in params.values()):
        params = dict(params[layer_type or "full_attention"])
    old = getattr(config, "rope_scaling", None) or {}
    for k, v in old.items():
        params.setdefault(k, v)
    params.setdefault("rope_theta", getattr(config, "rope_theta", None) or 10000.0)
    return params


def rope_inv_freq(config: Any, rotary_dim: int, layer_type: str | None = None) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [rotary_dim / 2] float64, attention factor the tables are scaled by)."""
    params = rope_parameters(config, layer_type)
    theta = float(params["rope_theta"])
    inv_freq = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim))
    kind = _rope_kind(params)
    if kind in ("default", "dynamic"):  # dynamic: the plain frequencies up to max_position_embeddings
        return inv_freq, 1.0
    if kind == "linear":
        return inv_freq / float(params["factor"]), 1.0
    if kind == "llama3":
        factor = float(params["factor"])
        low, high = float(params.get("low_freq_factor", 1.0)), float(params.get("high_freq_factor", 4.0))
        old_ctx = float(params.get("original_max_position_embeddings", 8192))
        wavelen = 2 * math.pi / inv_freq
        smooth = (old_ctx / wavelen - low) / (high - low)
        scaled = torch.where(wavelen > old_ctx / low, inv_freq / factor, inv_freq)
        mid = (wavelen <= old_ctx / low) & (wavelen >= old_ctx / high)
        return torch.where(mid, (1 - smooth) * inv_freq / factor + smooth * inv_freq, scaled), 1.0
    if kind == "yarn":
        return _yarn(params, inv_freq, rotary_dim, theta, config)
    if kind == "longrope":
        return _longrope(params, inv_freq, config, long=False)
    raise ValueError(f"rope_scaling type {kind!r} is not supported (supported: {', '.join(SUPPORTED_ROPE)})")


def _yarn(params: dict, inv_freq: torch.Tensor, dim: int, theta: float, config: Any) -> tuple[torch.Tensor, float]:
    factor = float(params["factor"])
    old_ctx = float(params.get("original_max_position_embeddings")
                    or getattr(config, "max_position_embeddings", 2048) / factor)
    beta_fast, beta_slow = float(params.get("beta_fast") or 32), float(params.get("beta_slow") or 1)

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attn = params.get("attention_factor")
    if attn is None:
        m, m_all = params.get("mscale"), params.get("mscale_all_dim")
        attn = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(old_ctx / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp
    return inv_freq / factor * (1 - extrapolation) + inv_freq * extrapolation, float(attn)


def _longrope(params: dict, inv_freq: torch.Tensor, config: Any, *, long: bool) -> tuple[torch.Tensor, float]:
    old_ctx = float(params.get("original_max_position_embeddings")
                    or getattr(config, "original_max_position_embeddings"))
    factor = params.get("factor") or getattr(config, "max_position_embeddings") / old_ctx
    attn = params.get("attention_factor")
    if attn is None:
        attn = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(old_ctx))
    ext = torch.tensor(params["long_factor" if long else "short_factor"], dtype=torch.float64)
    return inv_freq / ext, float(attn)


def _table(inv_freq: torch.Tensor, attn_factor: float, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """inv_freq [rotary_dim / 2], or one row of it per position [len(positions), rotary_dim / 2]."""
    freqs = positions.to(torch.float64)[:, None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    sin = emb.sin() * attn_factor
    sin[:, :inv_freq.shape[-1]] *= -1  # signed for apply_rope's roll
    return emb.cos() * attn_factor, sin


def rope_tables(config: Any, rotary_dim: int, max_pos: int,
                layer_type: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, signed sin) [max_pos, rotary_dim] float64: rows of rotate_half's layout for ``apply_rope``."""
    inv_freq, attn_factor = rope_inv_freq(config, rotary_dim, layer_type)
    positions = torch.arange(max_pos)
    cos, sin = _table(inv_freq, attn_factor, positions)
    params = rope_parameters(config, layer_type)
    kind = _rope_kind(params)
    if kind == "dynamic":
        ctx = _max_positions(config)
        if max_pos > ctx:
            factor, theta = float(params["factor"]), float(params["rope_theta"])
            length = positions[ctx:].to(torch.float64)[:, None] + 1  # the sequence length at each position
            base = theta * (factor * length / ctx - (factor - 1)) ** (rotary_dim / (rotary_dim - 2))  # [n, 1]
            per_position = base ** (-torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim)
            cos[ctx:], sin[ctx:] = _table(per_position, attn_factor, positions[ctx:])
    if kind == "longrope":
        old_ctx = int(params.get("original_max_position_embeddings")
                      or getattr(config, "original_max_position_embeddings"))
        if max_pos > old_ctx:
            theta = float(params["rope_theta"])
            base = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim))
            long_freq, _ = _longrope(params, base, config, long=True)
            cos[old_ctx:], sin[old_ctx:] = _table(long_freq, attn_factor, positions[old_ctx:])
    return cos, sin


class Rotary(NamedTuple):
    """One forward's rotary inputs: the tables and positions, and for the torch path each token's rows
    (cos, signed sin [num_tokens, 1, rotary_dim]); cos None means the compiled kernel rotates in place."""
    positions: torch.Tensor
    cos_cache: torch.Tensor
    sin_cache: torch.Tensor
    cos: torch.Tensor | None
    sin: torch.Tensor | None


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """HF Llama's rotate_half layout: x*cos + cat(-x2, x1)*sin, written as x*cos + roll(x)*signed_sin
    with signed_sin = cat(-sin_half, sin_half), which gives the same numbers in fewer ops.

    x [n, heads, head_dim]; cos, signed_sin [n, 1, head_dim]
    """
    return x * cos + torch.roll(x, x.shape[-1] // 2, dims=-1) * signed_sin
