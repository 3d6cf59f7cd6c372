"""CPU attention backend: the torch backend with decode steps on radixlang's compiled kernels.

Decode attention reads each request's keys and values straight from the KV pool through
``req_to_token`` (kernels/cpu/csrc/cpu_ops.c), one pass per request and kv head with the
grouped query heads scored together; the torch backend gathers a padded copy of every request's
context first. The new tokens' k/v are written with one copy per token. Extend steps (prefill,
chunked prefill, mixed batches) stay on the torch backend's flash SDPA and cascade paths.
The default on the CPU whenever the kernels build here; ``attention_backend="torch"`` is the
pure-PyTorch reference.
"""
from __future__ import annotations

import torch

from radixlang.kernels import cpu as cpu_ops
from radixlang.kernels.attention.base import AttentionLayerLike, ForwardBatchLike
from radixlang.kernels.attention.torch_native import TorchNativeAttnBackend


class CpuAttnBackend(TorchNativeAttnBackend):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int,
                 device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32, **kw: object) -> None:
        if torch.device(device).type != "cpu":
            raise ValueError(f"the cpu attention backend runs on the CPU, got device {device!r}")
        if not cpu_ops.available():
            raise ValueError(f"the cpu attention backend needs radixlang's CPU kernels: "
                             f"{cpu_ops.unavailable_reason()}")
        super().__init__(num_heads, num_kv_heads, head_dim, device, dtype, **kw)
        self._req_idx = self._seq_lens = None

    def init_forward_metadata(self, forward_batch: ForwardBatchLike) -> None:
        if not forward_batch.forward_mode.is_decode():
            super().init_forward_metadata(forward_batch)
            return
        # the kernels trust these for every layer: check them once per step
        req_idx, seq_lens = forward_batch.req_pool_indices.contiguous(), forward_batch.seq_lens.contiguous()
        r2t, loc = forward_batch.req_to_token, forward_batch.out_cache_loc
        slots = forward_batch.token_to_kv_pool.get_key_buffer(0).shape[0]
        if len(req_idx) and (int(req_idx.min()) < 0 or int(req_idx.max()) >= r2t.shape[0]
                             or int(seq_lens.min()) < 1 or int(seq_lens.max()) > r2t.shape[1]
                             or int(loc.min()) < 0 or int(loc.max()) >= slots):
            raise ValueError("decode metadata falls outside req_to_token or the KV pool")
        self._req_idx, self._seq_lens = req_idx, seq_lens

    def forward_decode(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       layer: AttentionLayerLike, forward_batch: ForwardBatchLike) -> torch.Tensor:
        pool = forward_batch.token_to_kv_pool
        k_buf, v_buf = pool.get_key_buffer(layer.layer_id), pool.get_value_buffer(layer.layer_id)
        if (k.dtype == v.dtype == k_buf.dtype == torch.float32 and k.stride(-1) == v.stride(-1) == 1
                and k.stride(1) == v.stride(1) == k.shape[2]):
            cpu_ops.store_kv(k, v, k_buf, v_buf, forward_batch.out_cache_loc, check=False)
        else:
            pool.set_kv_buffer(layer.layer_id, forward_batch.out_cache_loc, k, v)
        qf = q.to(torch.float32)
        if qf.stride(-1) != 1 or qf.stride(1) != qf.shape[2]:
            qf = qf.contiguous()
        out = cpu_ops.decode_attention(qf, k_buf, v_buf, forward_batch.req_to_token, self._req_idx, self._seq_lens,
                                       layer.scaling, check=False)
        return out.to(q.dtype)
