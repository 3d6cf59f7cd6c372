"""A toy model whose linears take their weight methods at construction (tests of layers/weight_methods.py)."""
from __future__ import annotations

import torch
from torch import nn

from radixlang.runtime.models.layers.linear import Linear
from radixlang.runtime.models.layers.weight_methods import WeightMethods


def tied_toy(methods: WeightMethods, dtype: torch.dtype = torch.float32) -> nn.Module:
    """Two linears and tied embeddings, built with ``methods`` and loaded with random weights."""
    class TiedToy(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed_tokens = nn.Embedding(50, 16)
            self.block = nn.Sequential(Linear(16, 32, bias=True, method=methods.linear(16)), nn.ReLU(),
                                       Linear(32, 16, bias=True, method=methods.linear(32)))
            self.lm_head = methods.head(self.embed_tokens)

    m = TiedToy().to(dtype)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
    return m
