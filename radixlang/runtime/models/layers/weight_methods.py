"""The weight methods of float checkpoints' linears, and ``WeightMethods``: which one each linear gets.

The methods (layers/linear.py: ``LinearMethod``) keep their storage in the layer's ``kernel``, built from
the loaded float weight by the kernels they run:

- ``PackedMethod``: oneDNN's blocked layout (models/packed.py: ``PackedLinear``), plus the row-major
  float32 weight for the 1-4 row C kernel where ``keep_plain``; the CPU default for float32 / bfloat16;
- ``Int8Method``: ``--quantization int8``, int8 codes with a scale per output channel (models/quant.py);
- ``Int4Method``: ``--quantization int4``, 4-bit codes per group of 32 run by the GGUF Q4_1 kernels.

``WeightMethods`` is chosen once per start (``choose``, from the server's options) and passed into the
family constructors, which ask it for every linear's method before any tensor is read. A quantized GGUF's
block linears (``--quantization gguf``: ``gguf_blocks``) get theirs from the file's header instead, once
the model is built and before any tensor is read (models/gguf_quant.py: ``GGUFBlocksMethod``, bound by the
loader).
"""
from __future__ import annotations

from typing import Callable, NamedTuple

import torch
from torch import nn

from radixlang.runtime.models import packed
from radixlang.runtime.models.layers.linear import KernelWeight, Linear, LinearMethod


def _check_bias(method: LinearMethod, with_bias: bool) -> None:
    """The kernels below add the bias inside their matmul: a row-parallel linear (which adds it after the
    ranks' sum) must use the plain method (WeightMethods.row_parallel)."""
    if not with_bias:
        raise ValueError(f"the {method.name} weight method always adds the bias; a row-parallel linear "
                         f"takes the plain method")


class PackedMethod(LinearMethod):
    name = "packed"

    def __init__(self, *, keep_plain: bool) -> None:
        self.keep_plain = keep_plain

    def process_after_loading(self, layer: Linear) -> None:
        if layer.weight is None:
            raise RuntimeError("a packed linear was processed twice (its float weight is gone)")
        layer.kernel = packed.PackedLinear(layer.weight.detach(), layer.bias, keep_plain=self.keep_plain)
        layer.release_float_weights()

    def apply(self, layer: Linear, x: torch.Tensor, *, with_bias: bool = True) -> torch.Tensor:
        _check_bias(self, with_bias)
        return self._kernel(layer)(x)

    def kernel_weight(self, layer: Linear) -> KernelWeight | None:
        k = self._kernel(layer)
        if k.plain is None or k.dtype != torch.float32:
            return None
        rows = frozenset(m for m in range(1, packed.SMALL_ROWS + 1) if k.small_kernels[m] == "c")
        return KernelWeight("float32", k.plain, k.bias, rows)

    def float32_weight(self, layer: Linear) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        k = self._kernel(layer)
        return None if k.plain is None else (k.plain, k.bias)

    @staticmethod
    def _kernel(layer: Linear) -> packed.PackedLinear:
        k = layer.kernel
        if not isinstance(k, packed.PackedLinear):
            raise RuntimeError("a packed linear ran before process_weights_after_loading")
        return k

    @classmethod
    def finish_model(cls, layers: list[Linear]) -> None:
        """oneDNN compiles kernels per weight shape: one layer of each shape compiles them now; then the
        small-row matmul is calibrated over the layers that kept their row-major weight."""
        kernels = [cls._kernel(layer) for layer in layers]
        warmed = set()
        for k in kernels:
            if (key := (k.out_features, k.in_features, k.dtype, k.bias is None)) not in warmed:
                warmed.add(key)
                k.warm_up()
        packed.calibrate_small_rows_(kernels)


class Int8Method(LinearMethod):
    name = "int8"

    def process_after_loading(self, layer: Linear) -> None:
        from radixlang.runtime.models.quant import Int8WeightOnlyLinear

        if layer.weight is None:
            raise RuntimeError("an int8 linear was processed twice (its float weight is gone)")
        layer.kernel = Int8WeightOnlyLinear(layer.weight, layer.bias)
        layer.release_float_weights()

    def apply(self, layer: Linear, x: torch.Tensor, *, with_bias: bool = True) -> torch.Tensor:
        _check_bias(self, with_bias)
        if layer.kernel is None:
            raise RuntimeError("an int8 linear ran before process_weights_after_loading")
        return layer.kernel(x)

    def float32_weight(self, layer: Linear) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        return None


class Int4Method(LinearMethod):
    name = "int4"

    def process_after_loading(self, layer: Linear) -> None:
        from radixlang.runtime.models.quant import int4_linear

        if layer.weight is None:
            raise RuntimeError("an int4 linear was processed twice (its float weight is gone)")
        layer.kernel = int4_linear(layer.weight, layer.bias)
        layer.release_float_weights()

    def apply(self, layer: Linear, x: torch.Tensor, *, with_bias: bool = True) -> torch.Tensor:
        _check_bias(self, with_bias)
        if layer.kernel is None:
            raise RuntimeError("an int4 linear ran before process_weights_after_loading")
        return layer.kernel(x)

    def kernel_weight(self, layer: Linear) -> KernelWeight | None:
        if layer.kernel is None:
            return None
        return layer.kernel.kernel_weight()  # type: ignore[operator]  # a gguf_blocks.QuantLinear

    def float32_weight(self, layer: Linear) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        return None


# format -> (its method, the input widths its kernel takes). torch's int8 matmul crashed (segfault) at
# 2+ rows on widths that are not a multiple of 16, int4 groups 32 input features: a linear of another
# width keeps the plain float method
_FORMATS: dict[str, tuple[Callable[[bool], LinearMethod], int]] = {
    "plain": (lambda keep_plain: LinearMethod(), 1),
    "packed": (lambda keep_plain: PackedMethod(keep_plain=keep_plain), 1),
    "int8": (lambda keep_plain: Int8Method(), 16),
    "int4": (lambda keep_plain: Int4Method(), 32),
}


class GGUFBlocks(NamedTuple):
    """``--quantization gguf``: a GGUF checkpoint's linears, experts and logits stored in native block types
    are served from those blocks (models/gguf_quant.py); ``prefill_budget``: the bytes their float32
    prefill copies may take, asked once the model is loaded (None: no copies)."""
    prefill_budget: Callable[[], int] | None = None


class WeightMethods:
    """Which method each linear of one model gets. ``format``: one of ``_FORMATS``; ``keep_plain``: packed
    float32 linears keep their row-major weight too (the C kernel's); ``tied_head``: tied embeddings get a
    logits projection of the format's own (False: the logits read the embedding table); ``gguf_blocks``:
    the linears a GGUF file stores in block types take the GGUF blocks method instead (the others ``format``)."""

    def __init__(self, format: str = "plain", *, keep_plain: bool = False, tied_head: bool = False,
                 gguf_blocks: GGUFBlocks | None = None) -> None:
        if format not in _FORMATS:
            raise ValueError(f"weight format must be one of {', '.join(_FORMATS)}, got {format!r}")
        self.format, self.keep_plain = format, keep_plain
        self.tied_head = tied_head and format != "plain"
        self.gguf_blocks = gguf_blocks

    def linear(self, in_features: int) -> LinearMethod:
        """The method of a linear over ``in_features`` inputs, kept whole on this rank."""
        make, width = _FORMATS[self.format]
        return make(self.keep_plain) if in_features % width == 0 else LinearMethod()

    def row_parallel(self, in_features: int) -> LinearMethod:
        """A row-parallel linear's (its rank's input features): the plain float matmul, whose partial sums
        the ranks all-reduce."""
        return LinearMethod()

    def head(self, embedding: nn.Embedding) -> Linear | None:
        """Tied embeddings' logits projection, or None where the logits read the embedding table."""
        if not self.tied_head or embedding.weight.shape[1] % _FORMATS[self.format][1]:
            return None
        from radixlang.runtime.models.layers.linear import tied_head

        return tied_head(embedding, self.linear(embedding.weight.shape[1]))

    @classmethod
    def choose(cls, *, quantization: str | None, device: str, dtype: torch.dtype, weight_packing: bool,
               cpu_kernels: bool, native_logits: bool = False,
               prefill_budget: Callable[[], int] | None = None) -> WeightMethods:
        """The linears' methods for a start: int8 / int4 as asked; else (no quantization, or a quantized
        GGUF, whose block linears take the GGUF blocks method) packed on a CPU that can pack ``dtype``
        unless ``weight_packing`` is off, else plain. ``native_logits``: the GGUF's logits are served from
        its blocks, so tied embeddings get no packed copy; ``prefill_budget``: GGUFBlocks'."""
        if quantization in ("int8", "int4", "gguf") and device != "cpu":
            raise ValueError(f"quantization {quantization!r} is implemented for the CPU only, got device {device!r}")
        if quantization in ("int8", "int4"):
            return cls(quantization, tied_head=True)
        blocks = GGUFBlocks(prefill_budget) if quantization == "gguf" else None
        if device == "cpu" and weight_packing and packed.packing_available(dtype):
            return cls("packed", keep_plain=cpu_kernels, tied_head=not native_logits, gguf_blocks=blocks)
        return cls("plain", gguf_blocks=blocks)


PLAIN = WeightMethods()  # immutable: a model built without options (tests, random-weight shapes)
