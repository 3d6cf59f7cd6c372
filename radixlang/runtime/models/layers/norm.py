"""RMSNorm, on radixlang's compiled CPU kernels when ``fused`` (float32 on the CPU; see kernels/cpu).

Gemma's norm multiplies by (1 + w): its families store 1 + w in ``weight`` at load time
(``unit_offset_weight``), which is the same float32 arithmetic, so one module and one kernel serve both.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from radixlang.kernels import cpu as cpu_ops


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.fused = False  # the compiled CPU kernels (float32 on the CPU; see kernels/cpu)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused and x.dim() == 2:
            return cpu_ops.rms_norm(x, self.weight, self.eps, check=x.dtype != torch.float32)
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)

    def add_norm(self, x: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual); residual None means x starts the stream."""
        if residual is None:
            return self(x), x
        if self.fused:  # one pass, in place: x is the sublayer's fresh output and residual is ours
            x = x.contiguous()
            cpu_ops.add_rms_norm_(x, residual, self.weight, self.eps, check=x.dtype != torch.float32)
            return x, residual
        residual = x + residual
        return self(residual), residual


def unit_offset_weight(checkpoint_weight: torch.Tensor) -> torch.Tensor:
    """Gemma's (1 + w) norm weight as a plain RMSNorm weight (added in float32, as transformers does)."""
    return 1.0 + checkpoint_weight.float()
