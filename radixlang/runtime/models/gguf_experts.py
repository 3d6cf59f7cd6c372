"""A quantized GGUF's stacked expert tensors served from their own blocks.

llama.cpp stores a MoE layer's routed experts as three stacked tensors per layer, ``ffn_gate_exps``,
``ffn_up_exps`` [experts, inter, hidden] and ``ffn_down_exps`` [experts, hidden, inter] (numpy order), each
expert's rows quantized along the input features like any linear. Dequantized, a Qwen3-30B-A3B's experts
alone take ~120 GB in float32; kept as their blocks they are the file's ~17 GB. ``GGUFExpertsMethod`` is
the experts method (layers/moe.py: ``ExpertsMethod``) bound to such a layer's ``Experts`` before any tensor
is read (models/gguf_quant.bind_gguf_blocks_): the loader streams the three tensors' raw blocks into its
``weight_loader``, which keeps one ``QuantWeight`` per expert and projection (gate and up stacked into
one, as the float path's w13), and it runs the same expert-sorted dispatch, each expert's
rows through the quantized kernels (kernels/cpu/quant.py), or, past ``KERNEL_MAX_ROWS`` rows (a prefill),
through a float32 matmul on the expert's weights dequantized for that call. On a VNNI CPU a step whose
experts each hold at most the int8 kernels' rows (a decode step) runs the whole layer in one compiled call
instead (``quant.QuantMoE``: the sort, SiLU and weighted sum in C, the same kernels).
"""
from __future__ import annotations

from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from radixlang.kernels import cpu as cpu_ops
from radixlang.kernels.cpu import quant as qk
from radixlang.runtime.models.gguf_blocks import (KERNEL_MAX_ROWS, NATIVE_TYPES, DecodedBlocks, common_layout,
                                                  decode_tensor, stackable)
from radixlang.runtime.models.layers.moe import Experts, ExpertsMethod, dispatch
from radixlang.runtime.models.loader.gguf_file import TensorInfo
from radixlang.runtime.models.parallel import TPComm

EXPERT_TENSORS = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")  # gate and up stack into w13, down is w2


class GGUFExpertsMethod(ExpertsMethod):
    """A MoE layer's experts from a GGUF file's stacked blocks: ``tensors`` {ffn_gate_exps / ffn_up_exps /
    ffn_down_exps: the file's tensor}; once all three are streamed in, w13[e] [2 * inter, hidden] (gate
    rows, then up rows) and w2[e] [hidden, inter] per expert, each a QuantWeight (this rank's slice of the
    intermediate features under ``tp``)."""

    name = "gguf"

    def __init__(self, tensors: dict[str, TensorInfo], *, act_is_silu: bool, tp: TPComm | None) -> None:
        self.source_type = "/".join(sorted({t.tensor_type.name for t in tensors.values()}))
        self.act_is_silu, self.tp = act_is_silu, tp
        self._raw: dict[str, TensorInfo] = {}
        self.w13: list[qk.QuantWeight] = []
        self.w2: list[qk.QuantWeight] = []
        self.kernel: Any = None  # decode steps: the whole layer in one compiled call (SwiGLU on a VNNI CPU)

    def create_weights(self, experts: Experts) -> None:
        """No float w13 / w2: the blocks come through ``weight_loader``."""
        experts.register_parameter("w13", None)
        experts.register_parameter("w2", None)
        self._shape = (experts.num_experts, experts.inter, experts.hidden)

    def weight_loader(self, kind: str, tensor: TensorInfo) -> None:
        """One of the three stacked tensors' raw blocks (a view of the file, decoded once all three are in)."""
        if kind not in EXPERT_TENSORS or kind in self._raw or self.w13:
            raise RuntimeError(f"GGUF expert tensor {tensor.name} streamed in twice or unexpected")
        self._raw[kind] = tensor
        if len(self._raw) == len(EXPERT_TENSORS):
            self._assemble(self._raw)
            self._raw = {}

    def _assemble(self, got: dict[str, TensorInfo]) -> None:
        num_experts, per, hidden = self._shape
        slices = {k: expert_slices(got[k]) for k in EXPERT_TENSORS}
        if int(got["ffn_gate_exps"].shape[2]) != num_experts:
            raise ValueError(f"the GGUF holds {int(got['ffn_gate_exps'].shape[2])} experts, the model {num_experts}")
        first = 0 if self.tp is None else self.tp.rank * per
        for e in range(num_experts):
            gate, up, down = (_blocks(got[k], slices[k][e]) for k in EXPERT_TENSORS)
            mine = common_layout([gate.rows(first, first + per), up.rows(first, first + per)])  # Q4_K/Q6_K: q8
            self.w13.append(qk.QuantWeight.concat([m.weight() for m in mine]).interleave())
            self.w2.append(down.cols(first, first + per).weight().interleave())
        w13, w2 = self.w13[0], self.w2[0]
        if (w13.out_features, w13.in_features, w2.out_features, w2.in_features) != (2 * per, hidden, hidden, per):
            raise ValueError(f"GGUF experts of gate/up {w13.out_features}x{w13.in_features} and down "
                             f"{w2.out_features}x{w2.in_features} do not fit hidden {hidden}, inter {per}")
        self.kernel = qk.QuantMoE.build(self.w13, self.w2) if self.act_is_silu and qk.available() else None

    def apply(self, experts: Experts, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """x [n, hidden]; weights, ids [n, k] -> this rank's term, [n, hidden] in x's dtype."""
        if not self.w13:
            raise RuntimeError(f"GGUF experts ({self.source_type}) ran before their blocks were streamed in")
        xf = x.float()
        out = self.kernel(xf, weights, ids) if self.kernel is not None else None
        if out is None:  # an expert of more rows than the int8 kernels take (a prefill), or no such kernel
            out = dispatch(xf, weights, ids, len(self.w13), partial(self._expert, experts))
        return out.to(x.dtype)

    def _expert(self, experts: Experts, e: int, xs: torch.Tensor) -> torch.Tensor:
        h = _linear(xs, self.w13[e])  # [count, 2 * inter]
        if self.act_is_silu and cpu_ops.available():
            h = cpu_ops.silu_mul(h.contiguous(), check=False)
        else:
            gate, up = h.split(experts.inter, dim=-1)
            h = experts.act(gate) * up
        return _linear(h, self.w2[e])


def _linear(x: torch.Tensor, w: qk.QuantWeight) -> torch.Tensor:
    if x.shape[0] <= KERNEL_MAX_ROWS:
        return qk.linear(x.contiguous(), w)
    return F.linear(x, qk.dequantize(w))


def plan_experts(model: nn.Module, reader: Any, *, align: int) -> tuple[dict[int, dict[str, Any]], list[str]]:
    """The layers whose ``Experts`` a GGUF file's stacked expert blocks serve (``GGUFExpertsMethod``), {layer:
    {tensor kind: reader tensor}}, and the ones kept float32, with why. ``align``: under tensor parallelism a
    rank's slice of the down projection's input features must start on a multiple of it
    (gguf_quant.TP_INPUT_ALIGN)."""
    found: dict[int, dict[str, Any]] = {}
    for t in reader.tensors:
        parts = t.name.split(".")
        if len(parts) == 4 and parts[0] == "blk" and parts[2] in EXPERT_TENSORS and parts[3] == "weight":
            found.setdefault(int(parts[1]), {})[parts[2]] = t
    tp = getattr(model, "tp", None)
    size = 1 if tp is None else tp.size
    swaps: dict[int, dict[str, Any]] = {}
    kept: list[str] = []
    for layer_id, got in sorted(found.items()):
        experts = getattr(getattr(model.layers[layer_id], "mlp", None), "experts", None)
        kinds = sorted({t.tensor_type.name for t in got.values()})
        name = f"blk.{layer_id}.ffn_*_exps ({'/'.join(kinds)})"
        if not isinstance(experts, Experts) or len(got) != len(EXPERT_TENSORS):
            kept.append(f"{name}: not the three stacked tensors of a gated Experts layer")
        elif any(k not in NATIVE_TYPES for k in kinds):
            kept.append(f"{name}: a type without a native layout")
        elif not stackable((got["ffn_gate_exps"].tensor_type.name, got["ffn_up_exps"].tensor_type.name)):
            kept.append(f"{name}: gate and up in groups that do not divide each other")
        elif _shapes(got) != (experts.num_experts, experts.inter * size, experts.hidden):
            kept.append(f"{name}: shapes {_shapes(got)} do not fit the model's experts")
        elif tp is not None and experts.inter % align:
            kept.append(f"{name}: a rank's {experts.inter} intermediate features cut the {align}-feature groups")
        else:
            swaps[layer_id] = got
    return swaps, kept


def _shapes(got: dict[str, Any]) -> tuple[int, int, int] | None:
    """(experts, inter, hidden) when the three tensors agree (GGUF shapes run ggml's way: [hidden, inter, E])."""
    gate, up, down = (tuple(int(d) for d in got[k].shape) for k in EXPERT_TENSORS)
    if gate != up or down != (gate[1], gate[0], gate[2]):
        return None
    return gate[2], gate[1], gate[0]


def _blocks(t: Any, data: Any) -> DecodedBlocks:
    kind = t.tensor_type.name
    return DecodedBlocks(kind, *decode_tensor(kind, data, int(t.shape[1]), int(t.shape[0])))


def expert_slices(t: Any) -> list[Any]:
    """A stacked GGUF expert tensor's raw blocks, one array per expert ([rows, row bytes])."""
    experts = int(t.shape[2])
    data = t.data.reshape(experts, -1)
    return [data[e] for e in range(experts)]
