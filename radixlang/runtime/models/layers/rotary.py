"""Rotary position embeddings: the inverse frequencies of each scaling rule transformers implements,
the cos / signed-sin tables and the torch rotation (the compiled CPU kernel reads the same tables).

Rules: default, linear, llama3, yarn, longrope, dynamic. Two of them change with the sequence length: in
transformers, each forward call re-derives the frequencies from its longest position. Here:
- the tables give each position the rows its own length gives (what transformers gives a token decoded
  at that position): longrope (Phi-3) uses the short factors before the original context and the long
  ones after it; dynamic NTK uses the plain frequencies up to ``max_position_embeddings`` and, at position
  p past it, the base theta * (factor * (p + 1) / max_pos - (factor - 1)) ^ (dim / (dim - 2)), up to
  factor x max_position_embeddings (``rope_context_length``);
- a prompt longer than that switch point is rotated as transformers rotates it when prefilled at once:
  every prompt position with the prompt length's rows (``rope_length_key``, ``length_rows``), in every
  chunk and after a retraction alike. Its KV then differs from a shorter prompt's at the same positions,
  so the radix cache keeps it apart (the key is the request's cache namespace).
Left as it is: transformers' Phi-3 recomputes the whole cache when a generation first crosses the original
context; here the tokens decoded past it take the long factors and the earlier ones keep the short ones.
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


def _long_inv_freq(params: dict, config: Any, rotary_dim: int) -> torch.Tensor:
    theta = float(params["rope_theta"])
    base = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim))
    return _longrope(params, base, config, long=True)[0]


def _dynamic_inv_freq(params: dict, rotary_dim: int, lengths: torch.Tensor, max_pos: int) -> torch.Tensor:
    """Dynamic NTK's frequencies for sequences of ``lengths`` (float64 [n, 1]): [n, rotary_dim / 2]."""
    factor, theta = float(params["factor"]), float(params["rope_theta"])
    base = theta * (factor * lengths / max_pos - (factor - 1)) ** (rotary_dim / (rotary_dim - 2))
    return base ** (-torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim)


def rope_switch_point(config: Any, layer_type: str | None = None) -> int | None:
    """The length past which a length-dependent rule changes its rows, or None for the other rules."""
    return _switch_point(config, rope_parameters(config, layer_type))


def _switch_point(config: Any, params: dict) -> int | None:
    kind = _rope_kind(params)
    if kind == "dynamic":
        return _max_positions(config)
    if kind == "longrope":
        return int(params.get("original_max_position_embeddings")
                   or getattr(config, "original_max_position_embeddings"))
    return None


def rope_length_key(config: Any, prompt_len: int) -> tuple | None:
    """None when a prompt of this length is rotated by the per-position tables; otherwise a key naming the
    rows its prompt positions take (``length_rows``): prompts with equal keys share those rows, so their
    KV can be shared. Layers whose own rule does not depend on the length ignore the key."""
    params = rope_parameters(config)
    switch = _switch_point(config, params)
    if switch is None or prompt_len <= switch:
        return None
    return ("longrope",) if _rope_kind(params) == "longrope" else ("dynamic", prompt_len)


def length_rows(config: Any, rotary_dim: int, prompt_len: int, positions: torch.Tensor,
                layer_type: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, signed sin) [len(positions), rotary_dim] float64 for prompt positions of a prompt of
    ``prompt_len`` tokens, past the layer type's switch point (``rope_switch_point``), as transformers
    rotates a prompt prefilled at once."""
    params = rope_parameters(config, layer_type)
    switch = _switch_point(config, params)
    if switch is None or prompt_len <= switch:
        raise ValueError(f"a prompt of {prompt_len} tokens takes the per-position rows (switch point {switch})")
    _, attn_factor = rope_inv_freq(config, rotary_dim, layer_type)
    if _rope_kind(params) == "longrope":
        return _table(_long_inv_freq(params, config, rotary_dim), attn_factor, positions)
    length = torch.full((1, 1), float(prompt_len), dtype=torch.float64)
    return _table(_dynamic_inv_freq(params, rotary_dim, length, switch)[0], attn_factor, positions)


def rope_tables(config: Any, rotary_dim: int, max_pos: int,
                layer_type: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, signed sin) [max_pos, rotary_dim] float64: rows of rotate_half's layout for ``apply_rope``,
    each position's row as its own sequence length gives it."""
    inv_freq, attn_factor = rope_inv_freq(config, rotary_dim, layer_type)
    positions = torch.arange(max_pos)
    cos, sin = _table(inv_freq, attn_factor, positions)
    params = rope_parameters(config, layer_type)
    switch = _switch_point(config, params)
    if switch is not None and max_pos > switch:
        later = positions[switch:]
        if _rope_kind(params) == "dynamic":  # the sequence length at each position: a base per row
            freq = _dynamic_inv_freq(params, rotary_dim, later.to(torch.float64)[:, None] + 1, switch)
        else:
            freq = _long_inv_freq(params, config, rotary_dim)
        cos[switch:], sin[switch:] = _table(freq, attn_factor, later)
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
