"""The attention-backend interface every backend implements.

A backend owns per-step attention metadata. The model runner calls
``init_forward_metadata(forward_batch)`` once per forward pass; each attention
layer then calls ``forward(q, k, v, layer, forward_batch)``, which dispatches to
``forward_extend`` or ``forward_decode``. Both write the new tokens' k/v into the
KV pool at ``forward_batch.out_cache_loc`` *before* attending, then read every
request's full KV (cached prefix + new tokens) through ``req_to_token``.

kernels/ must not import runtime/, so the forward batch is described here by
the fields a backend may read (``ForwardBatchLike``), not by the runtime class.
"""
from __future__ import annotations

import enum
from typing import Protocol

import torch


class ForwardMode(enum.IntEnum):
    # EXTEND: every request appends extend_seq_lens[i] >= 1 new tokens after
    # extend_prefix_lens[i] tokens already in the pool (prefill, chunked prefill,
    # jump-forward). DECODE: every request appends exactly one token.
    EXTEND = 1
    DECODE = 2

    def is_extend(self) -> bool:
        return self is ForwardMode.EXTEND

    def is_decode(self) -> bool:
        return self is ForwardMode.DECODE


class KVPoolLike(Protocol):
    # [slots + 1] int64 swa slot of each token slot where window layers keep KV in a second, smaller slot
    # space (the runtime's SWATokenToKVPool; 0 = freed), else None; ``is_swa_layer`` names those layers
    full_to_swa: torch.Tensor | None

    def is_swa_layer(self, layer_id: int) -> bool: ...
    def get_key_buffer(self, layer_id: int) -> torch.Tensor: ...  # [size, num_kv_heads, head_dim]
    def get_value_buffer(self, layer_id: int) -> torch.Tensor: ...  # [size, num_kv_heads, head_dim]
    def set_kv_buffer(self, layer_id: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None: ...


class ForwardBatchLike(Protocol):
    forward_mode: ForwardMode
    batch_size: int
    req_pool_indices: torch.Tensor  # [bs] int64: rows of req_to_token
    seq_lens: torch.Tensor  # [bs] int64: tokens in the pool per request after this step
    seq_lens_cpu: list[int]
    extend_prefix_lens_cpu: list[int]  # [bs] tokens already cached (EXTEND only)
    extend_seq_lens_cpu: list[int]  # [bs] new tokens this step (EXTEND only)
    out_cache_loc: torch.Tensor  # [num_tokens] int64: KV slots of the new tokens
    req_to_token: torch.Tensor  # [max_num_reqs, max_context_len] int32
    token_to_kv_pool: KVPoolLike


class AttentionLayerLike(Protocol):
    layer_id: int
    num_heads: int  # query heads on this rank
    num_kv_heads: int
    head_dim: int
    scaling: float


ATTENTION_FEATURES = ("sliding_window", "logit_softcap", "sinks", "mla")


def layer_features(layer: object) -> frozenset[str]:
    """The optional attention features a layer uses: a layer may carry ``sliding_window`` (int tokens),
    ``logit_softcap`` (float), ``sinks`` ([num_heads] logits) and ``mla`` (int: multi-head latent
    attention, see below); absent or None means unused.

    ``mla`` = value_dim: attention over a compressed latent (DeepSeek-V2/V3, decode-style absorbed
    projections). q is [num_tokens, num_heads, latent_dim], k [num_tokens, 1, latent_dim] (one kv head
    for every query head), v is k's first value_dim features, and the output is
    [num_tokens, num_heads, value_dim]."""
    return frozenset(f for f in ATTENTION_FEATURES if getattr(layer, f, None) is not None)


class AttentionBackend:
    """Base class for attention backends.

    ``supported_features``: which of ``ATTENTION_FEATURES`` the backend computes; the model runner
    refuses at start a model whose layers need one it lacks, naming both.

    Invariants: q is [num_tokens, num_heads, head_dim], k and v are
    [num_tokens, num_kv_heads, head_dim], all in the model dtype on the model
    device; tokens are laid out request by request in batch order. The
    returned tensor has q's shape (an ``mla`` layer's: v's head size). A backend never frees or allocates KV slots:
    the scheduler owns the pools; the backend only writes the slots named by
    ``out_cache_loc`` and reads those named by ``req_to_token``.
    """

    supported_features: frozenset[str] = frozenset()

    def init_forward_metadata(self, forward_batch: ForwardBatchLike) -> None:
        raise NotImplementedError

    def forward_extend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       layer: AttentionLayerLike, forward_batch: ForwardBatchLike) -> torch.Tensor:
        raise NotImplementedError

    def forward_decode(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       layer: AttentionLayerLike, forward_batch: ForwardBatchLike) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                layer: AttentionLayerLike, forward_batch: ForwardBatchLike) -> torch.Tensor:
        if forward_batch.forward_mode.is_decode():
            return self.forward_decode(q, k, v, layer, forward_batch)
        return self.forward_extend(q, k, v, layer, forward_batch)
