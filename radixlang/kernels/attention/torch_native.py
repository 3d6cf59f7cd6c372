"""Torch attention backend: the reference every other backend is compared with; runs on the CPU.

Decode gathers every request's KV through req_to_token into one padded
[bs, max_len] batch and runs a single masked SDPA; extend runs one causal SDPA
per request over prefix + new tokens.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from radixlang.kernels.attention.base import AttentionBackend, AttentionLayerLike, ForwardBatchLike


class TorchNativeAttnBackend(AttentionBackend):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int,
                 device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32, **_: object) -> None:
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.device = device
        self.dtype = dtype
        self._decode_kv_loc: torch.Tensor | None = None  # [bs, max_len] int64
        self._decode_mask: torch.Tensor | None = None  # [bs, 1, 1, max_len] bool
        self._extend_kv_loc: list[torch.Tensor] = []
        self._extend_masks: list[torch.Tensor | None] = []

    def init_forward_metadata(self, forward_batch: ForwardBatchLike) -> None:
        rows = forward_batch.req_to_token[forward_batch.req_pool_indices]  # [bs, max_context] int32
        seq_lens = forward_batch.seq_lens_cpu
        if forward_batch.forward_mode.is_decode():
            max_len = max(seq_lens)
            loc = rows[:, :max_len].to(torch.int64)
            ar = torch.arange(max_len, device=loc.device)
            valid = ar[None, :] < forward_batch.seq_lens[:, None]  # [bs, max_len]
            self._decode_kv_loc = torch.where(valid, loc, torch.zeros_like(loc))
            self._decode_mask = None if min(seq_lens) == max_len else valid[:, None, None, :]
            return
        self._extend_kv_loc = []
        self._extend_masks = []
        for i, (prefix_len, extend_len) in enumerate(zip(forward_batch.extend_prefix_lens_cpu,
                                                         forward_batch.extend_seq_lens_cpu)):
            total = prefix_len + extend_len
            self._extend_kv_loc.append(rows[i, :total].to(torch.int64))
            if extend_len == 1 or prefix_len == 0:
                # one query sees everything; a fresh prompt is plain causal (SDPA's fast path)
                self._extend_masks.append(None)
            else:
                q_pos = torch.arange(prefix_len, total, device=rows.device)[:, None]
                k_pos = torch.arange(total, device=rows.device)[None, :]
                self._extend_masks.append(k_pos <= q_pos)  # [extend_len, total] bool

    def forward_extend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       layer: AttentionLayerLike, forward_batch: ForwardBatchLike) -> torch.Tensor:
        pool = forward_batch.token_to_kv_pool
        pool.set_kv_buffer(layer.layer_id, forward_batch.out_cache_loc, k, v)
        k_buf = pool.get_key_buffer(layer.layer_id)
        v_buf = pool.get_value_buffer(layer.layer_id)
        out = torch.empty_like(q)  # [num_tokens, num_heads, head_dim]
        start = 0
        gqa = layer.num_heads != layer.num_kv_heads
        for loc, mask, extend_len in zip(self._extend_kv_loc, self._extend_masks,
                                         forward_batch.extend_seq_lens_cpu):
            qi = q[start:start + extend_len].transpose(0, 1)  # [num_heads, extend_len, head_dim]
            ki = k_buf[loc].transpose(0, 1)  # [num_kv_heads, total, head_dim]
            vi = v_buf[loc].transpose(0, 1)
            causal = mask is None and extend_len > 1
            oi = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask, is_causal=causal, scale=layer.scaling,
                                                enable_gqa=gqa)
            out[start:start + extend_len] = oi.transpose(0, 1)
            start += extend_len
        return out

    def forward_decode(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       layer: AttentionLayerLike, forward_batch: ForwardBatchLike) -> torch.Tensor:
        pool = forward_batch.token_to_kv_pool
        pool.set_kv_buffer(layer.layer_id, forward_batch.out_cache_loc, k, v)
        loc = self._decode_kv_loc  # [bs, max_len]
        ki = pool.get_key_buffer(layer.layer_id)[loc].transpose(1, 2)  # [bs, num_kv_heads, max_len, head_dim]
        vi = pool.get_value_buffer(layer.layer_id)[loc].transpose(1, 2)
        qi = q.unsqueeze(2)  # [bs, num_heads, 1, head_dim]
        out = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=self._decode_mask, scale=layer.scaling,
                                             enable_gqa=layer.num_heads != layer.num_kv_heads)
        return out.squeeze(2)  # [bs, num_heads, head_dim]
