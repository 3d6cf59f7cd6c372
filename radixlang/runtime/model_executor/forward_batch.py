"""ForwardBatch: what the model and the attention backend see for one forward pass."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from radixlang.kernels.attention.base import AttentionBackend, ForwardMode
from radixlang.runtime.mem_cache.memory_pool import TokenToKVPool


@dataclass(eq=False, kw_only=True)
class ForwardBatch:
    forward_mode: ForwardMode
    batch_size: int
    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    req_pool_indices: torch.Tensor  # [bs] int64
    seq_lens: torch.Tensor  # [bs] int64, after this step
    seq_lens_cpu: list[int]
    extend_prefix_lens_cpu: list[int]  # [bs]; DECODE: seq_len - 1
    extend_seq_lens_cpu: list[int]  # [bs]; DECODE: 1
    out_cache_loc: torch.Tensor  # [num_tokens] int64
    req_to_token: torch.Tensor  # [max_reqs, max_context_len] int32
    token_to_kv_pool: TokenToKVPool
    attn_backend: AttentionBackend
    # EXTEND: each request's prompt length; length-dependent rotary rules rotate prompt positions by it
    # (models/layers/rotary.py: length_rows). None: every position takes its table row
    prompt_lens_cpu: list[int] | None = None
    # every linear must see the step's rows whole, not slices of them: the LoRA adapters' deltas know the
    # step's rows by position (runtime/lora/layer.py), so a layer may not run its rows a slice at a time
    whole_rows: bool = False

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])


@dataclass(eq=False, kw_only=True)
class StepInputs:
    """One forward's inputs as host data: what rank 0 builds from a ScheduleBatch and, under tensor
    parallelism, broadcasts so every rank runs the same forward."""

    mode: ForwardMode
    input_ids: torch.Tensor  # [num_tokens] int64 cpu
    positions: torch.Tensor  # [num_tokens] int64 cpu
    req_pool_indices: torch.Tensor  # [bs] int64 cpu
    seq_lens: list[int]  # [bs], after this step
    prefix_lens: list[int]  # [bs]
    extend_lens: list[int]  # [bs]
    out_cache_loc: torch.Tensor  # [num_tokens] int64
    logit_rows: torch.Tensor  # [num_rows] int64: token rows whose logits are returned
    prompt_lens: list[int] | None = None  # [bs]: as ForwardBatch.prompt_lens_cpu
    lora_ids: list[int | None] | None = None  # [bs]: each request's LoRA adapter id (None: the base model)
