"""A quantized GGUF's stacked expert tensors served from their own blocks.

llama.cpp stores a MoE layer's routed experts as three stacked tensors per layer, ``ffn_gate_exps``,
``ffn_up_exps`` [experts, inter, hidden] and ``ffn_down_exps`` [experts, hidden, inter] (numpy order), each
expert's rows quantized along the input features like any linear. Dequantized, a Qwen3-30B-A3B's experts
alone take ~120 GB in float32; kept as their blocks they are the file's ~17 GB. ``QuantExperts`` replaces
the model's float ``Experts`` (layers/moe.py) with one ``QuantWeight`` per expert and projection (gate and
up stacked into one, as the float path's w13) and runs the same expert-sorted dispatch, each expert's
rows through the quantized kernels (kernels/cpu/quant.py), or, past ``KERNEL_MAX_ROWS`` rows (a prefill),
through a float32 matmul on the expert's weights dequantized for that call. On a VNNI CPU a step whose
experts each hold at most the int8 kernels' rows (a decode step) runs the whole layer in one compiled call
instead (``quant.QuantMoE``: the sort, SiLU and weighted sum in C, the same kernels).
"""
from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from radixlang.kernels import cpu as cpu_ops
from radixlang.kernels.cpu import quant as qk
from radixlang.runtime.models.gguf_blocks import (KERNEL_MAX_ROWS, NATIVE_TYPES, DecodedBlocks, common_layout,
                                                  decode_tensor, stackable)
from radixlang.runtime.models.layers.moe import Experts, dispatch
from radixlang.runtime.models.parallel import TPComm

EXPERT_TENSORS = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")  # gate and up stack into w13, down is w2


class QuantExperts(nn.Module):
    """``Experts`` over quantized weights: w13[e] [2 * inter, hidden] (gate rows, then up rows), w2[e]
    [hidden, inter], each a QuantWeight."""

    def __init__(self, w13: list[qk.QuantWeight], w2: list[qk.QuantWeight], act: Callable[[torch.Tensor], torch.Tensor],
                 *, act_is_silu: bool, source_type: str, tp: TPComm | None = None) -> None:
        super().__init__()
        if len(w13) != len(w2) or not w13:
            raise ValueError(f"one gate/up and one down weight per expert, got {len(w13)} and {len(w2)}")
        inter, hidden = w2[0].in_features, w2[0].out_features
        for e, (a, b) in enumerate(zip(w13, w2)):
            if (a.out_features, a.in_features) != (2 * inter, hidden) or (b.out_features, b.in_features) != (
                    hidden, inter):
                raise ValueError(f"expert {e}: gate/up {a.out_features}x{a.in_features} and down "
                                 f"{b.out_features}x{b.in_features} do not fit hidden {hidden}, inter {inter}")
        self.w13 = [w.interleave() for w in w13]
        self.w2 = [w.interleave() for w in w2]
        self.num_experts, self.inter, self.hidden = len(w13), inter, hidden
        self.act, self.act_is_silu, self.tp = act, act_is_silu, tp
        self.source_type = source_type
        # decode steps: the whole layer in one compiled call (SwiGLU experts on a VNNI CPU)
        self.kernel = qk.QuantMoE.build(self.w13, self.w2) if act_is_silu and qk.available() else None

    def extra_repr(self) -> str:
        return f"{self.num_experts} experts, {self.hidden} -> {self.inter}, {self.source_type}"

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, *,
                reduce: bool = True) -> torch.Tensor:
        """x [n, hidden]; weights, ids [n, k] -> [n, hidden] in x's dtype (summed over the tp ranks;
        ``reduce=False``: this rank's term, the caller sums)."""
        xf = x.float()
        out = self.kernel(xf, weights, ids) if self.kernel is not None else None
        if out is None:  # an expert of more rows than the int8 kernels take (a prefill), or no such kernel
            out = dispatch(xf, weights, ids, self.num_experts, self._expert)
        out = out.to(x.dtype)
        return out if self.tp is None or not reduce else self.tp.all_reduce(out)

    def _expert(self, e: int, xs: torch.Tensor) -> torch.Tensor:
        h = _linear(xs, self.w13[e])  # [count, 2 * inter]
        if self.act_is_silu and cpu_ops.available():
            h = cpu_ops.silu_mul(h.contiguous(), check=False)
        else:
            gate, up = h.split(self.inter, dim=-1)
            h = self.act(gate) * up
        return _linear(h, self.w2[e])


def _linear(x: torch.Tensor, w: qk.QuantWeight) -> torch.Tensor:
    if x.shape[0] <= KERNEL_MAX_ROWS:
        return qk.linear(x.contiguous(), w)
    return F.linear(x, qk.dequantize(w))


def plan_experts(model: nn.Module, reader: Any, *, align: int) -> tuple[dict[int, dict[str, Any]], list[str]]:
    """The layers whose float ``Experts`` a GGUF file's stacked expert blocks replace, {layer: {tensor kind:
    reader tensor}}, and the ones kept float32, with why. ``align``: under tensor parallelism a rank's slice of
    the down projection's input features must start on a multiple of it (gguf_quant.TP_INPUT_ALIGN)."""
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


def expert_param_names(swaps: dict[int, dict[str, Any]]) -> set[str]:
    return {f"layers.{layer_id}.mlp.experts.{leaf}" for layer_id in swaps for leaf in ("w13", "w2")}


def apply_experts_(model: nn.Module, swaps: dict[int, dict[str, Any]]) -> dict[str, int]:
    """Replace each planned layer's float Experts with QuantExperts over the file's blocks (this rank's
    slice of each expert's intermediate features under tensor parallelism); returns type -> tensors used."""
    tp: TPComm | None = getattr(model, "tp", None)
    used: dict[str, int] = {}
    for layer_id, got in swaps.items():
        slices = {k: expert_slices(got[k]) for k in EXPERT_TENSORS}
        inter = int(got["ffn_gate_exps"].shape[1])
        per = inter if tp is None else inter // tp.size
        first = 0 if tp is None else tp.rank * per
        w13, w2 = [], []
        for e in range(int(got["ffn_gate_exps"].shape[2])):
            gate, up, down = (_blocks(got[k], slices[k][e]) for k in EXPERT_TENSORS)
            mine = common_layout([gate.rows(first, first + per), up.rows(first, first + per)])  # Q4_K/Q6_K: q8
            w13.append(qk.QuantWeight.concat([m.weight() for m in mine]))
            w2.append(down.cols(first, first + per).weight())
        kinds = "/".join(sorted({t.tensor_type.name for t in got.values()}))
        swap_experts_(model.layers[layer_id].mlp, w13, w2, kinds)
        for t in got.values():
            used[t.tensor_type.name] = used.get(t.tensor_type.name, 0) + 1
    return used


def _blocks(t: Any, data: Any) -> DecodedBlocks:
    kind = t.tensor_type.name
    return DecodedBlocks(kind, *decode_tensor(kind, data, int(t.shape[1]), int(t.shape[0])))


def expert_slices(t: Any) -> list[Any]:
    """A stacked GGUF expert tensor's raw blocks, one array per expert ([rows, row bytes])."""
    experts = int(t.shape[2])
    data = t.data.reshape(experts, -1)
    return [data[e] for e in range(experts)]


def swap_experts_(owner: nn.Module, w13: list[qk.QuantWeight], w2: list[qk.QuantWeight], source_type: str) -> None:
    """Replace ``owner.experts`` (a float ``Experts``) by QuantExperts over these weights."""
    old = owner.experts
    if not isinstance(old, Experts):
        raise TypeError(f"expected float Experts to replace, got {type(old).__name__}")
    if len(w13) != old.num_experts or w2[0].in_features != old.inter:
        raise ValueError(f"the GGUF holds {len(w13)} experts of {w2[0].in_features} features, the model "
                         f"{old.num_experts} of {old.inter}")
    owner.experts = QuantExperts(w13, w2, old.act, act_is_silu=old.act_is_silu, source_type=source_type, tp=old.tp)
