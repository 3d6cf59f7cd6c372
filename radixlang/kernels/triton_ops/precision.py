"""The input precision of the kernels' ``tl.dot`` (imports no triton: the CPU tests check the choice).

``tl.dot`` on float32 inputs defaults to TF32 on NVIDIA GPUs (a 10-bit mantissa), so a float32 model
would silently compute attention and experts at about bfloat16's accuracy on the triton path while the
torch path computes in full float32. Float32 inputs run in IEEE float32; half inputs are unaffected by
the setting (their products are exact in the float32 accumulator)."""
from __future__ import annotations

import torch


def dot_precision(dtype: torch.dtype) -> str | None:
    """``input_precision`` for tl.dot over inputs of ``dtype``: "ieee" for float32, else None (triton's
    default for the target, which for half inputs changes nothing)."""
    return "ieee" if dtype == torch.float32 else None
