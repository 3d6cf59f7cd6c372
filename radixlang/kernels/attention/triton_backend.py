"""Triton attention backend: split-KV paged decode and prefix+causal extend kernels.

Works wherever triton runs (CUDA; the CPU under TRITON_INTERPRET=1). The pool
is token-granular (page_size 1), so kv_indices are KV slot indices.
Metadata is built once per step in ``init_forward_metadata`` and reused by
every layer. For CUDA graphs, ``init_cuda_graph_state`` allocates static
metadata and scratch buffers and ``init_forward_metadata_cuda_graph`` refills
them in place before capture and before every replay. Decode runs one program per (request, KV head,
split) over all the query heads of the KV head; a float32 model's kernels multiply in IEEE float32 (tl.dot
would default to TF32 on the GPU).
"""
from __future__ import annotations

import os

import torch

from radixlang.kernels.attention.base import AttentionBackend, AttentionLayerLike, ForwardBatchLike
from radixlang.kernels.attention.metadata import AttentionMetadata, build_attention_metadata


def _import_triton_ops():
    try:
        from radixlang.kernels.triton_ops import decode_attention, extend_attention
    except ImportError as e:
        raise ImportError("the triton attention backend needs triton: pip install 'radixlang[cuda]' "
                          f"(or pip install triton); import failed with: {e}") from e
    return decode_attention, extend_attention


class TritonAttnBackend(AttentionBackend):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int,
                 device: str | torch.device = "cuda", dtype: torch.dtype = torch.float16, *,
                 max_kv_splits: int = 16, min_split_len: int = 256, **_: object) -> None:
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads must be a multiple of num_kv_heads, got {num_heads} and {num_kv_heads}")
        if max_kv_splits < 1 or min_split_len < 1:
            raise ValueError(f"max_kv_splits and min_split_len must be >= 1, got {max_kv_splits} and {min_split_len}")
        if torch.device(device).type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError("the triton backend on the CPU needs TRITON_INTERPRET=1 set before triton is "
                             "imported (slow; for tests); use attention_backend='torch' on the CPU")
        self._decode_ops, self._extend_ops = _import_triton_ops()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.device = torch.device(device)
        self.dtype = dtype
        self.max_kv_splits = max_kv_splits
        self.min_split_len = min_split_len
        self.metadata: AttentionMetadata | None = None
        self.num_kv_splits = 1
        self._kv_indptr: torch.Tensor | None = None  # what the decode kernel reads this step
        self._kv_indices: torch.Tensor | None = None
        self._mid_o: torch.Tensor | None = None  # [bs, num_heads, num_kv_splits, head_dim] fp32
        self._mid_lse: torch.Tensor | None = None  # [bs, num_heads, num_kv_splits] fp32
        self._graph: dict[str, torch.Tensor] | None = None

    def _scratch(self, bs: int, num_splits: int) -> tuple[torch.Tensor, torch.Tensor]:
        mid_o = torch.empty((bs, self.num_heads, num_splits, self.head_dim), dtype=torch.float32,
                            device=self.device)
        mid_lse = torch.empty((bs, self.num_heads, num_splits), dtype=torch.float32, device=self.device)
        return mid_o, mid_lse

    def _pick_num_splits(self, max_seq_len: int) -> int:
        return max(1, min(self.max_kv_splits, -(-max_seq_len // self.min_split_len)))

    def init_forward_metadata(self, forward_batch: ForwardBatchLike) -> None:
        is_decode = forward_batch.forward_mode.is_decode()
        self.metadata = build_attention_metadata(
            forward_batch.req_to_token, forward_batch.req_pool_indices, forward_batch.seq_lens_cpu,
            None if is_decode else forward_batch.extend_prefix_lens_cpu,
            None if is_decode else forward_batch.extend_seq_lens_cpu)
        if is_decode:
            self.num_kv_splits = self._pick_num_splits(self.metadata.max_seq_len)
            self._kv_indptr, self._kv_indices = self.metadata.kv_indptr, self.metadata.kv_indices
            self._mid_o, self._mid_lse = self._scratch(forward_batch.batch_size, self.num_kv_splits)

    # ---- CUDA graph support (decode only) ----
    def init_cuda_graph_state(self, max_bs: int, max_context_len: int) -> None:
        """Allocate the static decode buffers every captured graph reads."""
        self._graph = {
            "kv_indptr": torch.zeros(max_bs + 1, dtype=torch.int32, device=self.device),
            "kv_indices": torch.zeros(max_bs * max_context_len, dtype=torch.int32, device=self.device),
        }
        self._graph["mid_o"], self._graph["mid_lse"] = self._scratch(max_bs, self.max_kv_splits)

    def init_forward_metadata_cuda_graph(self, forward_batch: ForwardBatchLike) -> None:
        """Decode metadata written into the static buffers (same addresses at capture and replay).

        The split count is fixed at max_kv_splits so the grid never changes.
        """
        if self._graph is None:
            raise RuntimeError("call init_cuda_graph_state before init_forward_metadata_cuda_graph")
        if not forward_batch.forward_mode.is_decode():
            raise ValueError("only decode steps are captured as CUDA graphs")
        md = build_attention_metadata(forward_batch.req_to_token, forward_batch.req_pool_indices,
                                      forward_batch.seq_lens_cpu)
        bs, total = md.batch_size, md.kv_indices.shape[0]
        if total > self._graph["kv_indices"].shape[0]:
            raise ValueError(f"decode batch needs {total} kv indices, the graph buffer holds "
                             f"{self._graph['kv_indices'].shape[0]}")
        self._graph["kv_indptr"][:bs + 1].copy_(md.kv_indptr)
        self._graph["kv_indices"][:total].copy_(md.kv_indices)
        self.metadata = md
        self.num_kv_splits = self.max_kv_splits
        self._kv_indptr = self._graph["kv_indptr"][:bs + 1]
        self._kv_indices = self._graph["kv_indices"]
        self._mid_o, self._mid_lse = self._graph["mid_o"], self._graph["mid_lse"]

    # ---- forward ----
    def forward_extend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       layer: AttentionLayerLike, forward_batch: ForwardBatchLike) -> torch.Tensor:
        md = self.metadata
        if md is None:
            raise RuntimeError("forward_extend before init_forward_metadata")
        pool = forward_batch.token_to_kv_pool
        pool.set_kv_buffer(layer.layer_id, forward_batch.out_cache_loc, k, v)
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()  # [n, heads, d], [n, kv_heads, d]
        out = torch.empty_like(q)
        self._extend_ops.extend_attention_fwd(
            q, k, v, out, pool.get_key_buffer(layer.layer_id), pool.get_value_buffer(layer.layer_id),
            md.qo_indptr, md.prefix_kv_indptr, md.prefix_kv_indices,
            max_extend_len=md.max_extend_len, sm_scale=layer.scaling)
        return out

    def forward_decode(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       layer: AttentionLayerLike, forward_batch: ForwardBatchLike) -> torch.Tensor:
        if self._kv_indptr is None:
            raise RuntimeError("forward_decode before init_forward_metadata")
        pool = forward_batch.token_to_kv_pool
        pool.set_kv_buffer(layer.layer_id, forward_batch.out_cache_loc, k, v)
        q = q.contiguous()  # [bs, heads, d]
        out = torch.empty_like(q)
        self._decode_ops.decode_attention_fwd(
            q, pool.get_key_buffer(layer.layer_id), pool.get_value_buffer(layer.layer_id), out,
            self._kv_indptr, self._kv_indices, self._mid_o, self._mid_lse,
            num_kv_splits=self.num_kv_splits, sm_scale=layer.scaling)
        return out
