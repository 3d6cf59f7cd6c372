"""Linear layers that take their weight method at construction, as vLLM's ``LinearMethod`` does.

A family file builds every projection as ``Linear(in, out, method=methods.linear(in))`` on the meta device;
``methods`` (a ``WeightMethods``, chosen once per start from the server's options and the checkpoint:
layers/weight_methods.py) says how each one stores and multiplies its weight. The layer never changes
class: a method creates the float parameters the checkpoint loads into (``create_weights``), turns them
into its own storage once every tensor is in (``process_after_loading``: oneDNN packing, int8 / int4
codes; the result is the layer's ``kernel`` child, the float parameters are released), and runs the
matmul (``apply``). ``process_weights_after_loading`` does that for a whole model, then lets each method
class finish the model at once (warm-ups, calibration over every layer of its kind).

``kernel_weight`` and ``float32_weight`` are what other rooms read through a method instead of probing
the layer's type: the fused CPU decode step (model_executor/decode_stack.py) takes the compiled kernels'
weights, the MoE kernel folds a shared expert's plain float32 weights into its experts (layers/moe.py).
"""
from __future__ import annotations

from typing import NamedTuple, Protocol

import torch
import torch.nn.functional as F
from torch import nn


class KernelWeight(NamedTuple):
    """A weight as the fused decode step reads it: ``kind`` "quantized" (``weight`` a kernels/cpu/quant.py
    QuantWeight) or "float32" (a row-major [out, in] tensor; ``c_rows``: the row counts its small-row
    matmul runs on the C kernel), and the float32 bias or None."""
    kind: str
    weight: object
    bias: torch.Tensor | None
    c_rows: frozenset[int] = frozenset()


class Piece(NamedTuple):
    """A checkpoint module's share of a fused linear's output (q_proj in qkv_proj): columns
    [offset, offset + size)."""
    offset: int
    size: int


class WeightLoader(Protocol):
    """How a parameter takes a checkpoint tensor, set on the parameter as its ``weight_loader`` when it is
    created (as nano-vllm does): ``tensor`` is the full checkpoint tensor, of which the loader keeps this
    tensor-parallel rank's slice (models/parallel.py); ``shard`` the checkpoint piece of a fused parameter
    (0, 1, 2 for q, k, v in qkv_proj), None for a tensor that fills the whole parameter."""

    def __call__(self, param: nn.Parameter, tensor: torch.Tensor, shard: int | None = None) -> None:
        ...


def default_weight_loader(param: nn.Parameter, tensor: torch.Tensor, shard: int | None = None) -> None:
    """A replicated parameter's loader (norms, a router, any parameter that sets none): the whole tensor."""
    if shard is not None:
        raise ValueError(f"a parameter of one piece, {tuple(param.shape)}, was given checkpoint piece {shard}")
    param.data.copy_(tensor)


def set_weight_loader(param: nn.Parameter | None, loader: WeightLoader) -> None:
    """Make ``loader`` the ``weight_loader`` of ``param`` (nothing for an absent parameter)."""
    if param is not None:
        param.weight_loader = loader  # type: ignore[attr-defined]


def weight_loader_of(param: nn.Parameter) -> WeightLoader:
    """The loader ``param`` was created with, else ``default_weight_loader``."""
    loader: WeightLoader = getattr(param, "weight_loader", default_weight_loader)
    return loader


class OutputDelta(Protocol):
    """What a linear adds to its output after its own matmul: the LoRA adapters' deltas of a batch
    (runtime/lora/layer.py). Set on a linear as its ``lora``; None: nothing is added."""

    def add(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y [..., out] (x [..., in] the linear's input) with the delta added; may change y in place."""
        ...


class LinearMethod:
    """How one linear holds and multiplies its weight; this base is the plain float method (``F.linear``
    on the loaded parameters). A subclass is a weight format: it overrides ``process_after_loading`` (build
    its storage from the loaded float parameters) and ``apply``, and registers in weight_methods.py."""

    name = "plain"

    def create_weights(self, layer: Linear, *, bias: bool) -> None:
        """The parameters the checkpoint loads into: weight [out, in], bias [out] (on the device context the
        model is built under: the meta device until ``materialize_``)."""
        layer.register_parameter("weight", nn.Parameter(torch.empty(layer.out_features, layer.in_features),
                                                        requires_grad=False))
        layer.register_parameter("bias", nn.Parameter(torch.empty(layer.out_features), requires_grad=False)
                                 if bias else None)

    def process_after_loading(self, layer: Linear) -> None:
        """Turn the loaded parameters into this method's storage (the plain method keeps them)."""

    def apply(self, layer: Linear, x: torch.Tensor, *, with_bias: bool = True) -> torch.Tensor:
        """x [..., in] -> [..., out], the bias added unless ``with_bias`` is False (a row-parallel layer adds
        it after the ranks' sum; this plain method and a GGUF file's blocks serve those)."""
        return F.linear(x, layer.weight, layer.bias if with_bias else None)

    def kernel_weight(self, layer: Linear) -> KernelWeight | None:
        """The weight as the fused decode step reads it; None: the step cannot run this method."""
        return None

    def float32_weight(self, layer: Linear) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """(row-major float32 weight [out, in], bias) where the method keeps one, else None."""
        w = layer.weight
        return (w.detach(), layer.bias) if w is not None and w.dtype == torch.float32 else None

    @classmethod
    def finish_model(cls, layers: list[Linear]) -> None:
        """After every layer of this method was processed: work over all of them at once (none here)."""


class Linear(nn.Module):
    """y = x W^T + b, W stored and multiplied by ``method`` (a fresh instance per layer: it holds the
    layer's storage choices)."""

    def __init__(self, in_features: int, out_features: int, *, bias: bool = False,
                 method: LinearMethod | None = None) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.method = method if method is not None else LinearMethod()
        self.weight: nn.Parameter | None
        self.bias: nn.Parameter | None
        self.kernel: nn.Module | None = None  # the method's storage after loading (process_after_loading)
        # its output columns per checkpoint piece, in shard order (q, k, v of a fused qkv_proj): one piece
        # unless a fused column-parallel builder (models/parallel.py: column_linear) says otherwise
        self.pieces: tuple[Piece, ...] = (Piece(0, out_features),)
        # the LoRA adapters' deltas on this linear (runtime/lora/layer.py), set once an adapter targets it
        self.lora: OutputDelta | None = None
        self.method.create_weights(self, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.method.apply(self, x)
        return y if self.lora is None else self.lora.add(x, y)

    def set_weight_loader(self, loader: WeightLoader) -> None:
        """``loader`` takes the checkpoint tensors of this linear's weight and bias (models/parallel.py)."""
        set_weight_loader(self.weight, loader)
        set_weight_loader(self.bias, loader)

    def rebind(self, method: LinearMethod) -> None:
        """Before any tensor is read: serve this linear with ``method`` instead of the one it was built with
        (a GGUF file's blocks, chosen from the file's header once the model's shapes are known: models/
        gguf_quant.py). The float weight the first method created is dropped unwritten; a bias keeps its
        parameter (its dtype and device), which the checkpoint still fills."""
        bias = self.bias
        self.method = method
        method.create_weights(self, bias=bias is not None)
        if bias is not None:
            self.bias = bias

    def release_float_weights(self) -> None:
        """Drop the loaded float parameters once the method's own storage holds the weight (a tied head's
        weight stays the embedding table's: only this layer's reference goes)."""
        self.register_parameter("weight", None)
        self.register_parameter("bias", None)

    def kernel_weight(self) -> KernelWeight | None:
        return self.method.kernel_weight(self)

    def float32_weight(self) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        return self.method.float32_weight(self)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, method={self.method.name}"


def tied_head(embedding: nn.Embedding, method: LinearMethod) -> Linear:
    """The logits projection of tied embeddings under a method of its own: its weight parameter is the
    embedding table itself (loaded once, as ``embed_tokens.weight``), which ``method`` turns into its copy."""
    vocab, hidden = embedding.weight.shape
    head = Linear(hidden, vocab, method=method)
    head.weight = embedding.weight
    return head


def process_weights_after_loading(model: nn.Module) -> dict[str, int]:
    """Every linear's ``process_after_loading``, then each method class's ``finish_model`` over its layers.
    Returns method name -> layers."""
    by_method: dict[type[LinearMethod], list[Linear]] = {}
    for m in model.modules():
        if isinstance(m, Linear):
            m.method.process_after_loading(m)
            by_method.setdefault(type(m.method), []).append(m)
    for cls, layers in by_method.items():
        cls.finish_model(layers)
    return {cls.name: len(layers) for cls, layers in by_method.items()}
