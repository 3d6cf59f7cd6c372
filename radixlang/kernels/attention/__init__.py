"""Attention backends: "torch" (reference, CPU and CUDA), "cpu" (torch + compiled decode kernels),
"triton", "flashinfer" (CUDA).

``create_attention_backend`` imports the chosen backend lazily, so torch-only
installs never import triton or flashinfer.
"""
from __future__ import annotations

import torch

from radixlang.kernels.attention.base import AttentionBackend

BACKEND_NAMES = ("torch", "cpu", "triton", "flashinfer")


def create_attention_backend(name: str, *, num_heads: int, num_kv_heads: int, head_dim: int,
                             device: str | torch.device, dtype: torch.dtype, **kwargs: object) -> AttentionBackend:
    """Build the backend called `name`; extra kwargs go to its constructor (e.g. max_kv_splits, workspace_bytes)."""
    if name == "torch":
        from radixlang.kernels.attention.torch_native import TorchNativeAttnBackend
        cls = TorchNativeAttnBackend
    elif name == "cpu":
        from radixlang.kernels.attention.cpu_backend import CpuAttnBackend
        cls = CpuAttnBackend
    elif name == "triton":
        from radixlang.kernels.attention.triton_backend import TritonAttnBackend
        cls = TritonAttnBackend
    elif name == "flashinfer":
        from radixlang.kernels.attention.flashinfer_backend import FlashInferAttnBackend
        cls = FlashInferAttnBackend
    else:
        raise ValueError(f"attention backend must be one of {', '.join(BACKEND_NAMES)}, got {name!r}")
    return cls(num_heads, num_kv_heads, head_dim, device, dtype, **kwargs)
