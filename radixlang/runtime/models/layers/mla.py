"""Multi-head latent attention (DeepSeek-V2/V3) over a cache of compressed latents.

Per token, ``kv_a_proj_with_mqa`` makes a latent c (kv_lora_rank features, RMS-normed) and one rotary
key k_pe (qk_rope_head_dim) shared by every head. ``kv_b_proj`` [heads * (nope + v), kv_lora_rank]
would expand c into each head's non-rotary key (W_UK) and value (W_UV); instead the cache keeps
[c | k_pe] (one "kv head") and the projections are absorbed:

    score_h = q_nope_h . (W_UK_h c) + q_pe_h . k_pe = (W_UK_h^T q_nope_h) . c + q_pe_h . k_pe
    out_h   = W_UV_h (sum_t p_t c_t)

so the attention backend runs multi-query attention with queries [W_UK^T q_nope | q_pe] over the latent
rows and values c (the latent's first kv_lora_rank features), and W_UV maps each head's result back.
Prefill and decode take the same path. The softmax scale is (nope + rope) ** -0.5, times mscale(factor,
mscale_all_dim) squared under yarn (as DeepSeek and transformers do).

Tensor parallelism splits the heads: a rank holds its heads' rows of ``q_b_proj`` and ``kv_b_proj``
(whole head blocks, so the absorbed halves stay per head) and their columns of ``o_proj`` (row-parallel,
all-reduced); ``q_a_proj``, ``kv_a_proj_with_mqa`` and their norms are replicated, so every rank makes the
same latent and caches all of it (the KV pool is not split: one latent serves every head).

Rotary layout: DeepSeek's checkpoints rotate the rope features as interleaved pairs (x0, x1), (x2, x3),
...; permuting the rows of the projections that make them (``deinterleave_rope_rows``, at load time)
turns that into the rotate-half layout ``apply_rope`` uses. q and k are permuted alike, so their dot
products, and everything after, are unchanged.
"""
from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from radixlang.runtime.models.layers.norm import RMSNorm
from radixlang.runtime.models.layers.rotary import Rotary, apply_rope, rope_parameters
from radixlang.runtime.models.layers.linear import Linear, set_weight_loader
from radixlang.runtime.models.layers.weight_methods import PLAIN, WeightMethods
from radixlang.runtime.models.parallel import ColumnLoader, RowParallelLinear, TPComm, column_linear, split_evenly

LATENT_NORM_EPS = 1e-6  # q_a_layernorm and kv_a_layernorm keep their default eps, not rms_norm_eps


def mla_softmax_scale(config: Any) -> float:
    scale = float(config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5
    params = rope_parameters(config)
    kind = params.get("rope_type", params.get("type", "default")) or "default"
    m_all = params.get("mscale_all_dim")
    factor = float(params.get("factor") or 1.0)
    if kind != "default" and m_all and factor > 1:
        m = 0.1 * float(m_all) * math.log(factor) + 1.0
        scale *= m * m
    return scale


def deinterleave_rope_rows(weight: torch.Tensor, *, block: int, offset: int, rope: int) -> torch.Tensor:
    """Reorder the rows of a projection's output (weight [out, in] or bias [out]) whose blocks of
    ``block`` rows each hold ``rope`` interleaved rotary features at ``offset``: evens first, then odds."""
    perm = torch.cat([torch.arange(0, rope, 2), torch.arange(1, rope, 2)]) + offset
    rows = weight.view(-1, block, *weight.shape[1:])
    out = rows.clone()
    out[:, offset:offset + rope] = rows[:, perm]
    return out.view(weight.shape)


class LatentUpProjection(nn.Module):
    """``kv_b_proj``'s weight [heads * (nope + v), kv_lora_rank], read as its two absorbed halves; never a
    plain linear (weight packing and quantization leave it alone)."""

    def __init__(self, heads: int, nope: int, v: int, rank: int) -> None:
        super().__init__()
        self.heads, self.nope, self.v, self.rank = heads, nope, v, rank
        self.weight = nn.Parameter(torch.empty(heads * (nope + v), rank))

    def w_uk(self) -> torch.Tensor:
        """[heads, nope, rank]: q_nope [heads, n, nope] @ w_uk -> the query in latent space."""
        return self.weight.view(self.heads, self.nope + self.v, self.rank)[:, :self.nope]

    def w_uv_t(self) -> torch.Tensor:
        """[heads, rank, v]: attention over the latent [heads, n, rank] @ w_uv_t -> each head's value output."""
        return self.weight.view(self.heads, self.nope + self.v, self.rank)[:, self.nope:].transpose(1, 2)


class MLAttention(nn.Module):
    """The attention of a DeepSeek-V2/V3 decoder layer (checkpoint names as transformers': q_proj, or
    q_a_proj / q_a_layernorm / q_b_proj with q_lora_rank; kv_a_proj_with_mqa, kv_a_layernorm,
    kv_b_proj, o_proj). Without q_lora_rank the checkpoint's q_proj loads as q_b_proj over the hidden
    state. With ``tp``, this rank's heads only (see the module docstring)."""

    def __init__(self, config: Any, layer_id: int, tp: TPComm | None = None, methods: WeightMethods = PLAIN) -> None:
        super().__init__()
        self.layer_id = layer_id
        hidden, total_heads = config.hidden_size, config.num_attention_heads
        heads = total_heads if tp is None else split_evenly(total_heads, tp.size, "attention heads")
        self.nope, self.rope_dim, self.v_dim = config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim
        self.rank = config.kv_lora_rank
        # what the attention backend sees: every query head over one latent "kv head"
        self.num_heads, self.num_kv_heads = heads, 1
        self.head_dim = self.rank + self.rope_dim
        self.mla = self.rank  # read by the backend: the value is the latent's first kv_lora_rank features
        self.sliding_window: int | None = None
        self.logit_softcap: float | None = None
        self.sinks: torch.Tensor | None = None
        self.scaling = mla_softmax_scale(config)
        bias = bool(getattr(config, "attention_bias", False))
        q_rank = getattr(config, "q_lora_rank", None)
        self.q_a_proj = Linear(hidden, q_rank, bias=bias, method=methods.linear(hidden)) if q_rank else None
        self.q_a_layernorm = RMSNorm(q_rank, LATENT_NORM_EPS) if q_rank else None
        # the per-head projections: this rank's heads' rows (q_a / kv_a and their norms stay whole)
        self.q_b_proj = column_linear(q_rank or hidden, [("q_b", heads * (self.nope + self.rope_dim))], tp,
                                      methods.linear(q_rank or hidden))
        self.kv_a_proj_with_mqa = Linear(hidden, self.rank + self.rope_dim, bias=bias, method=methods.linear(hidden))
        self.kv_a_layernorm = RMSNorm(self.rank, LATENT_NORM_EPS)
        self.kv_b_proj = LatentUpProjection(heads, self.nope, self.v_dim, self.rank)
        set_weight_loader(self.kv_b_proj.weight, ColumnLoader([("kv_b", heads * (self.nope + self.v_dim))], tp))
        self.o_proj = (Linear(heads * self.v_dim, hidden, bias=bias, method=methods.linear(heads * self.v_dim))
                       if tp is None else RowParallelLinear(total_heads * self.v_dim, hidden, tp=tp, bias=bias,
                                                            method=methods.row_parallel(heads * self.v_dim)))

    def attend(self, x: torch.Tensor, rope: Rotary, forward_batch: Any) -> torch.Tensor:
        """Everything but the output projection: x [n, hidden] -> [n, heads * v_head_dim]."""
        n, heads = x.shape[0], self.num_heads
        q_in = x if self.q_a_proj is None else self.q_a_layernorm(self.q_a_proj(x).contiguous())
        q = self.q_b_proj(q_in).view(n, heads, self.nope + self.rope_dim)
        kv = self.kv_a_proj_with_mqa(x)  # [n, rank + rope]
        latent = self.kv_a_layernorm(kv[:, :self.rank].contiguous())  # [n, rank]
        assert rope.cos is not None  # the rotary kernel turns whole heads: MLA's partial rotation runs here
        q_pe = apply_rope(q[..., self.nope:], rope.cos, rope.sin)  # [n, heads, rope]
        k_pe = apply_rope(kv[:, None, self.rank:], rope.cos, rope.sin)  # [n, 1, rope]
        q_latent = torch.bmm(q[..., :self.nope].transpose(0, 1), self.kv_b_proj.w_uk())  # [heads, n, rank]
        q_full = torch.cat([q_latent.transpose(0, 1), q_pe.to(q_latent.dtype)], dim=-1)  # [n, heads, rank + rope]
        k_full = torch.cat([latent[:, None, :], k_pe.to(latent.dtype)], dim=-1)  # [n, 1, rank + rope]
        out = forward_batch.attn_backend.forward(q_full, k_full, k_full[..., :self.rank], self, forward_batch)
        out = torch.bmm(out.to(x.dtype).transpose(0, 1), self.kv_b_proj.w_uv_t())  # [heads, n, v]
        return out.transpose(0, 1).reshape(n, heads * self.v_dim)
