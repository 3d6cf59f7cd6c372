"""Torch attention backend: the reference every other backend is compared with; runs on the CPU.

Decode gathers every request's KV through req_to_token into one padded
[bs, max_len] batch and runs a single masked SDPA. Extend runs one causal SDPA
per request over prefix + new tokens (a fresh prompt over its own new k/v, with
no gather from the pool); requests extending by a single token (decodes in a
mixed batch) are grouped and run like a decode.
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
        # per multi-token request: (first token row, extend_len, kv slots or None = own k/v, mask)
        self._extend_reqs: list[tuple[int, int, torch.Tensor | None, torch.Tensor | None]] = []
        self._extend_singles: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None = None

    def init_forward_metadata(self, forward_batch: ForwardBatchLike) -> None:
        seq_lens = forward_batch.seq_lens_cpu
        rows = forward_batch.req_to_token[forward_batch.req_pool_indices, :max(seq_lens)]  # [bs, max_len] int32
        if forward_batch.forward_mode.is_decode():
            self._decode_kv_loc, self._decode_mask = _padded_kv_loc(rows, forward_batch.seq_lens, seq_lens)
            return
        # extend: requests with one new token (decodes riding in a mixed batch, short jump-forwards)
        # run together like a decode; the others run one causal SDPA each
        singles = [i for i, e in enumerate(forward_batch.extend_seq_lens_cpu) if e == 1]
        self._extend_singles = None
        if len(singles) > 1:
            starts = _token_starts(forward_batch.extend_seq_lens_cpu)
            lens = [seq_lens[i] for i in singles]
            idx = torch.tensor(singles, device=rows.device)
            loc, mask = _padded_kv_loc(rows[idx], torch.tensor(lens, device=rows.device), lens)
            self._extend_singles = (torch.tensor([starts[i] for i in singles], device=rows.device), loc, mask)
        self._extend_reqs = []
        start = 0
        for i, (prefix_len, extend_len) in enumerate(zip(forward_batch.extend_prefix_lens_cpu,
                                                         forward_batch.extend_seq_lens_cpu)):
            total = prefix_len + extend_len
            if not (extend_len == 1 and self._extend_singles is not None):
                if prefix_len == 0:  # a fresh prompt attends only to its own new k/v: plain causal, no gather
                    self._extend_reqs.append((start, extend_len, None, None))
                else:
                    loc = rows[i, :total].to(torch.int64)
                    mask = None
                    if extend_len > 1:
                        q_pos = torch.arange(prefix_len, total, device=rows.device)[:, None]
                        k_pos = torch.arange(total, device=rows.device)[None, :]
                        mask = k_pos <= q_pos  # [extend_len, total] bool
                    self._extend_reqs.append((start, extend_len, loc, mask))
            start += extend_len

    def forward_extend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       layer: AttentionLayerLike, forward_batch: ForwardBatchLike) -> torch.Tensor:
        pool = forward_batch.token_to_kv_pool
        pool.set_kv_buffer(layer.layer_id, forward_batch.out_cache_loc, k, v)
        k_buf = pool.get_key_buffer(layer.layer_id)
        v_buf = pool.get_value_buffer(layer.layer_id)
        out_dtype = q.dtype  # attention runs in the pool's dtype (float32 on the CPU even for bf16 weights)
        q, k, v = q.to(k_buf.dtype), k.to(k_buf.dtype), v.to(k_buf.dtype)
        out = torch.empty_like(q)  # [num_tokens, num_heads, head_dim]
        gqa = layer.num_heads != layer.num_kv_heads
        for start, extend_len, loc, mask in self._extend_reqs:
            end = start + extend_len
            qi = q[start:end].transpose(0, 1)  # [num_heads, extend_len, head_dim]
            if loc is None:
                ki, vi = k[start:end].transpose(0, 1), v[start:end].transpose(0, 1)
            else:
                ki = k_buf.index_select(0, loc).transpose(0, 1)  # [num_kv_heads, total, head_dim]
                vi = v_buf.index_select(0, loc).transpose(0, 1)
            causal = mask is None and extend_len > 1
            if gqa and extend_len > 1:
                # torch's CPU flash kernel does not take enable_gqa (the math path is ~5x slower on a
                # 1,000-token prompt): give every query head its own copy of the kv head
                rep = layer.num_heads // layer.num_kv_heads
                ki, vi = ki.repeat_interleave(rep, dim=0), vi.repeat_interleave(rep, dim=0)
            # 4-D inputs: torch's CPU flash kernel takes only [batch, heads, len, dim]; 3-D goes to the math path
            oi = F.scaled_dot_product_attention(qi[None], ki[None], vi[None], attn_mask=mask, is_causal=causal,
                                                scale=layer.scaling, enable_gqa=gqa and extend_len == 1)
            out[start:end] = oi[0].transpose(0, 1)
        if self._extend_singles is not None:
            token_idx, loc, mask = self._extend_singles
            out[token_idx] = self._attend_one_each(q[token_idx], k_buf, v_buf, loc, mask, layer)
        return out.to(out_dtype)

    def _attend_one_each(self, q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, loc: torch.Tensor,
                         mask: torch.Tensor | None, layer: AttentionLayerLike) -> torch.Tensor:
        """One query per request over its padded KV rows: q [n, num_heads, head_dim] -> same shape."""
        # index_select on the flat slots is ~3x faster on the CPU than advanced indexing with a 2-D index
        n, max_len = loc.shape
        ki = k_buf.index_select(0, loc.view(-1)).view(n, max_len, *k_buf.shape[1:]).transpose(1, 2)
        vi = v_buf.index_select(0, loc.view(-1)).view(n, max_len, *v_buf.shape[1:]).transpose(1, 2)
        # ki, vi [n, num_kv_heads, max_len, head_dim]
        out = F.scaled_dot_product_attention(q.unsqueeze(2), ki, vi, attn_mask=mask, scale=layer.scaling,
                                             enable_gqa=layer.num_heads != layer.num_kv_heads)
        return out.squeeze(2)

    def forward_decode(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       layer: AttentionLayerLike, forward_batch: ForwardBatchLike) -> torch.Tensor:
        pool = forward_batch.token_to_kv_pool
        pool.set_kv_buffer(layer.layer_id, forward_batch.out_cache_loc, k, v)
        k_buf, v_buf = pool.get_key_buffer(layer.layer_id), pool.get_value_buffer(layer.layer_id)
        out = self._attend_one_each(q.to(k_buf.dtype), k_buf, v_buf, self._decode_kv_loc, self._decode_mask, layer)
        return out.to(q.dtype)


def _token_starts(extend_lens: list[int]) -> list[int]:
    starts, acc = [], 0
    for e in extend_lens:
        starts.append(acc)
        acc += e
    return starts


def _padded_kv_loc(rows: torch.Tensor, seq_lens: torch.Tensor, seq_lens_cpu: list[int]):
    """KV slots [n, max_len] (padding points at slot 0) and the bool mask, None when no row is padded."""
    max_len = max(seq_lens_cpu)
    loc = rows[:, :max_len].to(torch.int64)
    valid = torch.arange(max_len, device=loc.device)[None, :] < seq_lens[:, None]
    loc = torch.where(valid, loc, torch.zeros_like(loc))
    return loc, (None if min(seq_lens_cpu) == max_len else valid[:, None, None, :])
