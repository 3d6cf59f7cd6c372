"""CPU attention backend: attention on radixlang's compiled kernels (kernels/cpu/csrc/cpu_ops.c).

Both kernels read each request's keys and values straight from the KV pool through
``req_to_token`` and score the grouped query heads of a kv head together; the torch backend
gathers a copy of every request's context first (and, for torch's flash SDPA, repeats it for each
query head). Decode: one pass per request and kv head. Extend (prefill, chunked prefill, questions
after a cached prefix, mixed batches): causal attention in blocks of 16 query tokens per request and
kv head, as small register-blocked matrix products; faster than the torch backend's flash SDPA
and cascade paths on prefill and few-shot shapes (docs/cpu.md). Head sizes the extend kernel does not take (not a
multiple of 64) run the torch backend's extend. The new tokens' k/v are written with one copy per
token. The default on the CPU whenever the kernels build here; ``attention_backend="torch"`` is the
pure-PyTorch reference. Both kernels take a layer's sliding window, logit soft-capping and attention
sinks (Mistral, Qwen2 and Gemma 2/3 windows, Gemma 2's cap, GPT-OSS's sinks); MLA layers, and featured
layers whose heads the extend kernel does not take, run the torch backend's MLA or plain path (same
pool, same metadata step).
"""
from __future__ import annotations

import torch

from radixlang.kernels import cpu as cpu_ops
from radixlang.kernels.attention.base import AttentionLayerLike, ForwardBatchLike
from radixlang.kernels.attention.swa_index import SwaIndices, swa_indices
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
        self._extend_kernel = cpu_ops.extend_fits(head_dim, num_heads, num_kv_heads)
        self._ext: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # q_start, prefix, extend lens
        self._swa: SwaIndices | None = None  # window layers' indices when the pool has an swa slot space

    def init_forward_metadata(self, forward_batch: ForwardBatchLike) -> None:
        self._plain_reqs = None  # built on first use by a layer the kernels cannot run
        self._swa = None
        decode = forward_batch.forward_mode.is_decode()
        if not decode and not self._extend_kernel:
            super().init_forward_metadata(forward_batch)
            return
        # the kernels trust these for every layer: check them once per step
        req_idx, seq_lens = forward_batch.req_pool_indices.contiguous(), forward_batch.seq_lens.contiguous()
        r2t, loc = forward_batch.req_to_token, forward_batch.out_cache_loc
        pool = forward_batch.token_to_kv_pool
        slots = pool.get_key_buffer(0).shape[0] if pool.full_to_swa is None else pool.full_to_swa.shape[0]
        if len(req_idx) and (int(req_idx.min()) < 0 or int(req_idx.max()) >= r2t.shape[0]
                             or int(seq_lens.min()) < 1 or int(seq_lens.max()) > r2t.shape[1]
                             or (len(loc) and (int(loc.min()) < 0 or int(loc.max()) >= slots))):
            raise ValueError("attention metadata falls outside req_to_token or the KV pool")
        self._req_idx, self._seq_lens = req_idx, seq_lens
        self._swa = swa_indices(forward_batch)
        if decode:
            return
        prefix = forward_batch.extend_prefix_lens_cpu
        extend = forward_batch.extend_seq_lens_cpu
        if any(p + e != s for p, e, s in zip(prefix, extend, forward_batch.seq_lens_cpu)) or min(extend) < 1:
            raise ValueError("extend metadata: prefix + extend lengths must equal seq_lens, each extend >= 1")
        ext = torch.tensor(extend, dtype=torch.int64)
        self._ext = (torch.cumsum(ext, 0) - ext, torch.tensor(prefix, dtype=torch.int64), ext)

    def decode_metadata(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This decode step's (req_pool_indices, seq_lens), int64, as ``init_forward_metadata`` checked them."""
        if self._req_idx is None or self._seq_lens is None:
            raise RuntimeError("decode_metadata before init_forward_metadata")
        return self._req_idx, self._seq_lens

    def swa_metadata(self) -> SwaIndices | None:
        """This step's window-layer indices where the pool keeps window KV in its own slot space, else None."""
        return self._swa

    def extend_metadata(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """This extend step's (req_pool_indices, q_start, prefix_lens, extend_lens), int64, as
        ``init_forward_metadata`` checked them; None where the extend kernel does not take these heads."""
        if not self._extend_kernel:
            return None
        if self._req_idx is None or self._ext is None:
            raise RuntimeError("extend_metadata before init_forward_metadata")
        return (self._req_idx, *self._ext)

    def _indices(self, layer: AttentionLayerLike,
                 forward_batch: ForwardBatchLike) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(req_to_token, req_pool_indices, out_cache_loc) in the slot space of the layer's buffers."""
        if self._swa is not None and forward_batch.token_to_kv_pool.is_swa_layer(layer.layer_id):
            return self._swa
        return forward_batch.req_to_token, self._req_idx, forward_batch.out_cache_loc

    def _store(self, k: torch.Tensor, v: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor,
               layer: AttentionLayerLike, forward_batch: ForwardBatchLike, loc: torch.Tensor) -> None:
        """Write the new tokens' k/v at ``loc``, slots of k_buf / v_buf's space."""
        if (k.dtype == v.dtype == k_buf.dtype == torch.float32 and k.stride(-1) == v.stride(-1) == 1
                and k.stride(1) == v.stride(1) == k.shape[2]):
            cpu_ops.store_kv(k, v, k_buf, v_buf, loc, check=False)
        else:  # the pool translates full slots itself
            forward_batch.token_to_kv_pool.set_kv_buffer(layer.layer_id, forward_batch.out_cache_loc, k, v)

    @staticmethod
    def _query(q: torch.Tensor) -> torch.Tensor:
        qf = q.to(torch.float32)
        return qf if qf.stride(-1) == 1 and qf.stride(1) == qf.shape[2] else qf.contiguous()

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                layer: AttentionLayerLike, forward_batch: ForwardBatchLike) -> torch.Tensor:
        if getattr(layer, "mla", None) is not None or (
                not self._extend_kernel and not forward_batch.forward_mode.is_decode()):
            return super().forward(q, k, v, layer, forward_batch)  # torch's MLA, plain or extend path
        if forward_batch.forward_mode.is_decode():
            return self.forward_decode(q, k, v, layer, forward_batch)
        return self.forward_extend(q, k, v, layer, forward_batch)

    @staticmethod
    def _features(layer: AttentionLayerLike) -> dict:
        sinks = getattr(layer, "sinks", None)
        return {"window": getattr(layer, "sliding_window", None), "softcap": getattr(layer, "logit_softcap", None),
                "sinks": None if sinks is None else sinks.detach().float().contiguous()}

    def forward_extend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       layer: AttentionLayerLike, forward_batch: ForwardBatchLike) -> torch.Tensor:
        if not self._extend_kernel:
            return super().forward_extend(q, k, v, layer, forward_batch)
        pool = forward_batch.token_to_kv_pool
        k_buf, v_buf = pool.get_key_buffer(layer.layer_id), pool.get_value_buffer(layer.layer_id)
        r2t, req_idx, loc = self._indices(layer, forward_batch)
        self._store(k, v, k_buf, v_buf, layer, forward_batch, loc)
        q_start, prefix, extend = self._ext
        out = cpu_ops.extend_attention(self._query(q), k_buf, v_buf, r2t, req_idx,
                                       q_start, prefix, extend, layer.scaling, **self._features(layer), check=False)
        return out.to(q.dtype)

    def forward_decode(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       layer: AttentionLayerLike, forward_batch: ForwardBatchLike) -> torch.Tensor:
        pool = forward_batch.token_to_kv_pool
        k_buf, v_buf = pool.get_key_buffer(layer.layer_id), pool.get_value_buffer(layer.layer_id)
        r2t, req_idx, loc = self._indices(layer, forward_batch)
        self._store(k, v, k_buf, v_buf, layer, forward_batch, loc)
        out = cpu_ops.decode_attention(self._query(q), k_buf, v_buf, r2t, req_idx,
                                       self._seq_lens, layer.scaling, **self._features(layer), check=False)
        return out.to(q.dtype)
