"""A quantized GGUF's weights served as they are stored (``--quantization gguf``, the default for one on the CPU).

``GGUFBlocksMethod`` is the weight method (layers/linear.py: ``LinearMethod``) of a linear whose GGUF tensor
is one of the block types below. ``bind_gguf_blocks_`` gives it to every such linear (and the logits head,
and, through gguf_experts.py, every stacked experts layer) from the file's header alone, after the model is
built and before any tensor is read: a family file never knows. The loader (loader/gguf_weights.py) then
streams each of those tensors' raw blocks into its method's ``weight_loader`` (a shard id per piece of a
fused projection), which decodes them into integer codes and per-group scales and offsets and keeps its
rank's slice; every other tensor (norms, the embedding table for lookups, linears of other types) is
dequantized into the float parameters as before. After loading, ``process_after_loading`` makes each
layer's ``kernel`` a ``QuantLinear`` over those codes, so a decode step streams the quantized bytes instead
of float32, and ``finish_model`` adds the float32 prefill copies within their memory budget:

=====  =========================================  =================================
type   stored per block                           kept as (kernels/cpu/quant.py)
=====  =========================================  =================================
Q4_0   32 x 4-bit, f16 scale d: d * (q - 8)        q4, scale d, offset -8d
Q4_1   32 x 4-bit, f16 d and m: d * q + m          q4, scale d, offset m
Q8_0   32 x int8, f16 d: d * q                      q8 (group 32), scale d, offset 0
Q5_0   32 x 5-bit, f16 d: d * (q - 16)              q8 (group 32) of q - 16, scale d, offset 0
Q5_1   32 x 5-bit, f16 d and m: d * q + m           q8 (group 32), scale d, offset m
Q4_K   256: 8 x 32 x 4-bit, 6-bit scales / mins     q4, scale d * sc, offset -dmin * m
Q5_K   256: 8 x 32 x 5-bit, 6-bit scales / mins     q8 (group 32), scale d * sc, offset -dmin * m
Q6_K   256: 16 x 16 x 6-bit, int8 scales           q8 (group 16) of q - 32, scale d * sc, offset 0
=====  =========================================  =================================

Each weight the kernel decodes is ``q * scale + offset`` in float32, the number the dequantized model
holds up to one rounding. With float32 activations, outputs match the ``--dtype float32`` path (the same
file dequantized) to float32 rounding; on a VNNI CPU, rows of one or two (decode steps) take their
activations as int8 codes in three passes (22 bits; kernels/cpu/quant.py, docs/cpu.md), within ~1e-4.
A fused projection of parts in different layouts (Q4_K q/k beside a Q6_K v) is kept as q8 codes in the
finest group among them, exactly (gguf_blocks.common_layout). Tensors of other types (F16, Q2_K, Q3_K, ...)
keep their dequantized float32 weights, with a log line naming them. A MoE layer's stacked expert tensors
are served the same way (gguf_experts.py: ``GGUFExpertsMethod``), and so are its shared experts. q/k/v and
gate/up are stacked into the model's fused projections (Phi-3's files hold them fused already: attn_qkv,
and ffn_up for gate/up); the tied logits projection reads the quantized embedding table. DeepSeek's MLA
projections q (or q_a and q_b) and kv_a are served from blocks too, their rows in the order the model
keeps (its ``checkpoint_tensor`` de-interleaves the rope rows at load; the blocks run along rows, so whole
rows move); kv_b stays float32 (layers/mla.py absorbs its two halves).
Decoding the blocks is gguf_blocks.py.

Under tensor parallelism (``--tp-size``) each rank keeps only its slice of every block tensor, cut from
the decoded codes, scales and offsets: column-parallel projections (q/k/v, gate/up, the logits:
parallel.VocabParallelHead) take whole output rows, each part of a fused projection sliced alone as
a float one's ``parallel.ColumnLoader`` slices it (its q heads, its kv heads, its half of gate and of up; the vocabulary
padded with zero rows); row-parallel ones (o_proj, down_proj: a ``RowParallelLinear`` under this method,
partial sums all-reduced, bias added once after the sum) take whole
groups of input features. Their slice must start on a multiple of ``TP_INPUT_ALIGN`` (32) features: the
K-types' 256-weight super-blocks are decoded into per-32 (Q6_K: per-16) scales and offsets, so 32 is the
coarsest group any kept layout has, and the int8-activation kernels quantize activations per 32 features
too; on those boundaries a rank's partial sum has exactly the single-rank sum's terms. A linear whose
slice would cut a group is not refused: it keeps its dequantized float32 weight on every rank (sliced like
a float checkpoint's), with a warning naming it, its input size, the group and the tp size.
"""
from __future__ import annotations

import logging
from functools import partial
from typing import Any, Callable, Iterable, NamedTuple

import torch
from torch import nn

from radixlang.kernels.cpu import quant as qk
from radixlang.runtime.models.gguf_blocks import (NATIVE_TYPES, DecodedBlocks,
                                                  QuantLinear, common_layout, decode_tensor, stackable)
from radixlang.runtime.models.loader.gguf_file import GGUFFile, TensorInfo
from radixlang.runtime.models.loader.gguf_weights import RawRoutes, restore_layout
from radixlang.runtime.models.gguf_experts import GGUFExpertsMethod, plan_experts
from radixlang.runtime.models.layers.linear import KernelWeight, Linear, LinearMethod
from radixlang.runtime.models.parallel import TPComm, VocabParallelHead, column_part_rows, padded_vocab

logger = logging.getLogger(__name__)


def add_prefill_copies_(linears: Iterable[QuantLinear], *, max_bytes: int | None = None) -> int:
    """Give each QuantLinear a oneDNN-packed float32 copy of its dequantized weight for matmuls of more
    than KERNEL_MAX_ROWS rows (prefills), which then run as fast as the float32 model's instead of
    dequantizing per call. Decode steps never touch the copy, so they still stream only the quantized
    bytes; the copies cost memory (4 bytes a weight). Where they would take more than ``max_bytes``
    (a 7B model's are ~28 GB) none are made: prefills then dequantize each layer's weight per call.
    Returns how many were added (0 without packing)."""
    from radixlang.runtime.models import packed

    if not packed.packing_available():
        return 0
    linears = [m for m in linears if isinstance(m, QuantLinear)]
    need = sum(4 * m.out_features * m.in_features for m in linears)
    if max_bytes is not None and need > max_bytes:
        logger.warning("no float32 prefill copies of the quantized weights: they would take %.1f GiB, more than "
                       "the %.1f GiB allowed; prefills dequantize each layer per call (slower)",
                       need / 2**30, max_bytes / 2**30)
        return 0
    count, warmed = 0, set()
    for m in linears:
        if m.dense is None:
            m.dense = packed.PackedLinear(m.dequantized_weight(), m.bias)
            key = (m.out_features, m.in_features, m.bias is None)
            if key not in warmed:  # oneDNN's kernels are cached per weight shape: one layer compiles them
                warmed.add(key)
                m.dense.warm_up()
            count += 1
    return count


# --- the method -------------------------------------------------------------------------------------------

class _Decode(NamedTuple):
    """What turning a GGUF tensor's blocks into a model's rows needs: the architecture and head counts
    (llama's q/k rows are permuted back: gguf_weights.restore_layout), the model's load-time hook (DeepSeek
    de-interleaves its rope rows; None: rows as stored) and the tensor-parallel group."""
    arch: str
    n_head: int
    n_kv: int
    checkpoint_tensor: Callable[[str, torch.Tensor], torch.Tensor] | None
    tp: TPComm | None


class GGUFBlocksMethod(LinearMethod):
    """A linear served from a GGUF file's blocks. ``shards``: the parts each of its GGUF tensors holds, in
    row order (("q",), ("k",), ("v",); Phi-3's attn_qkv: ("q", "k", "v")); ``part_rows``: each part's rows
    in the full model; ``split``: how a tensor-parallel rank slices it ("whole" without tp, "column": output
    rows per part, "row": whole groups of input features, "vocab": the logits' vocabulary rows, zero-padded);
    ``prefill_budget``: the bytes the float32 prefill copies may take, asked once loading is done (None: no
    copies)."""

    name = "gguf"

    def __init__(self, *, param: str, shards: list[tuple[str, ...]], part_rows: dict[str, int], source_type: str,
                 split: str, decode: _Decode, prefill_budget: Callable[[], int] | None) -> None:
        self.param, self.shards, self.part_rows, self.source_type = param, shards, part_rows, source_type
        self.split, self.prefill_budget = split, prefill_budget
        self._decode: _Decode | None = decode
        self._pieces: list[list[DecodedBlocks] | None] = [None] * len(shards)
        self._weight: qk.QuantWeight | None = None  # this rank's blocks, once every shard is in

    def create_weights(self, layer: Linear, *, bias: bool) -> None:
        """No float weight: the blocks come through ``weight_loader``; a bias is a float parameter the
        checkpoint fills."""
        layer.register_parameter("weight", None)
        layer.register_parameter("bias", nn.Parameter(torch.empty(layer.out_features), requires_grad=False)
                                 if bias else None)

    def weight_loader(self, shard: int, tensor: TensorInfo) -> None:
        """The raw blocks of the GGUF tensor of ``shard``: decoded, put in the model's row order, cut into
        its parts and each part's slice of this rank kept; the layer's weight is assembled once every shard
        is in (the parts stacked in one layout: gguf_blocks.common_layout)."""
        decode = self._decode
        if decode is None or self._pieces[shard] is not None:
            raise RuntimeError(f"{self.param}: GGUF tensor {tensor.name} streamed in twice")
        full = self._model_rows(decode, _decode_blocks(tensor, decode))
        pieces, first = [], 0
        for part in self.shards[shard]:  # a fused tensor is cut into its parts first
            rows = self.part_rows[part]
            pieces.append(self._rank_piece(decode, part, full.rows(first, first + rows)))
            first += rows
        self._pieces[shard] = pieces
        if all(p is not None for p in self._pieces):
            stacked = common_layout([p for got in self._pieces if got is not None for p in got])
            self._weight = qk.QuantWeight.concat([p.weight() for p in stacked])
            self._pieces, self._decode = [], None

    def _model_rows(self, decode: _Decode, full: DecodedBlocks) -> DecodedBlocks:
        """The rows in the order the model keeps them: its ``checkpoint_tensor`` applied to the row numbers
        (DeepSeek de-interleaves the rope rows of q_b and kv_a; the other families keep the file's order)."""
        if decode.checkpoint_tensor is None:
            return full
        n = full.q.shape[0]
        order = decode.checkpoint_tensor(self.param, torch.arange(n, dtype=torch.float64)[:, None])
        index = order[:, 0].round().long()
        if torch.equal(index, torch.arange(n)):
            return full
        if not torch.equal(index.sort().values, torch.arange(n)):
            raise RuntimeError(f"{self.param}: the model's load-time change is not a row order; it cannot keep blocks")
        return full.take_rows(index.numpy())

    def _rank_piece(self, decode: _Decode, part: str, piece: DecodedBlocks) -> DecodedBlocks:
        tp = decode.tp
        if tp is None or self.split == "whole":
            return piece
        if self.split == "row":
            per = piece.q.shape[1] // tp.size
            return piece.cols(tp.rank * per, (tp.rank + 1) * per)
        if self.split == "vocab":  # this rank's rows of the vocabulary, zero rows past it (parallel.shard_vocab)
            per = padded_vocab(piece.q.shape[0], tp.size) // tp.size
            return piece.rows(tp.rank * per, (tp.rank + 1) * per).padded(per)
        return piece.rows(*_column_span(part, self.part_rows[part], tp, decode.n_kv))

    def process_after_loading(self, layer: Linear) -> None:
        """The layer's ``kernel``: a QuantLinear over its blocks (the bias inside it, except a row-parallel
        layer's, which is added once after the ranks' sum)."""
        if self._weight is None:
            missing = [i for i, got in enumerate(self._pieces) if got is None]
            raise RuntimeError(f"{self.param}: the GGUF blocks of shards {missing} were never streamed in")
        row_parallel = self.split == "row"
        layer.kernel = QuantLinear(self._weight, None if row_parallel else layer.bias, self.source_type)
        self._weight = None
        if not row_parallel:
            layer.release_float_weights()

    def apply(self, layer: Linear, x: torch.Tensor, *, with_bias: bool = True) -> torch.Tensor:
        k = self._kernel(layer)
        if not with_bias and k.bias is not None:
            raise ValueError(f"{self.param}: this GGUF block linear adds its bias inside its kernel; a "
                             f"row-parallel one (bias added after the ranks' sum) is bound with split 'row'")
        return k(x)

    def kernel_weight(self, layer: Linear) -> KernelWeight | None:
        k = self._kernel(layer)
        return KernelWeight("quantized", k.weight_q, k.bias)

    def float32_weight(self, layer: Linear) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        return None

    @staticmethod
    def _kernel(layer: Linear) -> QuantLinear:
        k = layer.kernel
        if not isinstance(k, QuantLinear):
            raise RuntimeError("a GGUF block linear ran before process_weights_after_loading")
        return k

    @classmethod
    def finish_model(cls, layers: list[Linear]) -> None:
        """The float32 prefill copies, all or none within the budget (``add_prefill_copies_``), measured now
        that the model is loaded."""
        budgets = {m.prefill_budget for m in (layer.method for layer in layers) if isinstance(m, cls)}
        budget = budgets.pop() if len(budgets) == 1 else None
        if budget is not None:
            add_prefill_copies_((cls._kernel(layer) for layer in layers), max_bytes=budget())


def _decode_blocks(t: TensorInfo, decode: _Decode) -> DecodedBlocks:
    kind = t.tensor_type.name
    q, scale, offset, group = decode_tensor(kind, t.data, int(t.shape[1]), int(t.shape[0]))
    # the converter's row order (gguf_convert: llama's q/k rows are permuted back); blocks run along rows
    q, scale, offset = (restore_layout(decode.arch, t.name, a, decode.n_head, decode.n_kv) for a in (q, scale, offset))
    return DecodedBlocks(kind, q, scale, offset, group)


# --- the plan, from the header ----------------------------------------------------------------------------
# GGUF tensor kind -> (the model's projection it fills, the parts of it the tensor holds, in row order);
# the shared experts of Qwen2-MoE and DeepSeek MoE layers too
_LINEARS = {"attn_q": ("qkv", ("q",)), "attn_k": ("qkv", ("k",)), "attn_v": ("qkv", ("v",)),
            "attn_output": ("o", ("o",)), "ffn_gate": ("gate_up", ("gate",)), "ffn_up": ("gate_up", ("up",)),
            "ffn_down": ("down", ("down",)), "ffn_gate_shexp": ("shared_gate_up", ("gate",)),
            "ffn_up_shexp": ("shared_gate_up", ("up",)), "ffn_down_shexp": ("shared_down", ("down",))}
_ARCH_LINEARS = {
    # Phi-3's files hold q/k/v fused as attn_qkv, and gate and up as ffn_up
    "phi3": {"attn_qkv": ("qkv", ("q", "k", "v")), "ffn_up": ("gate_up", ("gate", "up")),
             "attn_output": ("o", ("o",)), "ffn_down": ("down", ("down",))},
    # DeepSeek's multi-head latent attention: attn_q (no q_lora_rank) is q_b over the hidden state; kv_b is
    # never a linear (layers/mla.py reads its absorbed halves) and stays float32
    "deepseek2": {**_LINEARS, "attn_q": ("q_b", ("q_b",)), "attn_q_a": ("q_a", ("q_a",)),
                  "attn_q_b": ("q_b", ("q_b",)), "attn_kv_a_mqa": ("kv_a", ("kv_a",))},
}
_PARTS = {"qkv": ("q", "k", "v"), "o": ("o",), "gate_up": ("gate", "up"), "down": ("down",), "q_a": ("q_a",),
          "q_b": ("q_b",), "kv_a": ("kv_a",), "shared_gate_up": ("gate", "up"), "shared_down": ("down",)}
# split by input features under tensor parallelism; MLA's latent projections stay whole on every rank; the
# others are split by output rows (q_b by heads)
_ROW_PARALLEL = ("o", "down", "shared_down")
_REPLICATED = ("q_a", "kv_a")
# a row-parallel rank's input features must start and end on this boundary: the kept layouts' groups (32;
# 16 for Q6_K) and the int8-activation kernels' groups of 32 (kernels/cpu/quant.py) are then the same
# groups as on one rank, so each rank's partial sums are the single-rank sums' terms
TP_INPUT_ALIGN = 32


_ROOMS = {"qkv": ("self_attn", "qkv_proj"), "o": ("self_attn", "o_proj"), "gate_up": ("mlp", "gate_up_proj"),
          "down": ("mlp", "down_proj"), "q_a": ("self_attn", "q_a_proj"), "q_b": ("self_attn", "q_b_proj"),
          "kv_a": ("self_attn", "kv_a_proj_with_mqa")}
_SHARED = {"shared_gate_up": "gate_up_proj", "shared_down": "down_proj"}


def _module_path(layer: nn.Module, target: str) -> str | None:
    """The projection's path in a decoder layer (self_attn.q_b_proj, mlp.shared_experts.down_proj), or None."""
    if target in _SHARED:
        mlp = getattr(layer, "mlp", None)
        for name in ("shared_experts", "shared_expert"):  # DeepSeek's, Qwen2-MoE's
            if isinstance(getattr(mlp, name, None), nn.Module):
                return f"mlp.{name}.{_SHARED[target]}"
        return None
    return ".".join(_ROOMS[target])


def _owner(root: nn.Module, path: str) -> tuple[nn.Module | None, str]:
    """(the module holding the projection at ``path`` under ``root``, its attribute name)."""
    *rooms, attr = path.split(".")
    owner: Any = root
    for room in rooms:
        owner = getattr(owner, room, None)
    return owner, attr


def _column_span(part: str, rows: int, tp: TPComm, n_kv: int) -> tuple[int, int]:
    """The rows [first, end) of a column-parallel part this rank holds."""
    if part in _REPLICATED:
        return 0, rows
    if part == "q_b":  # whole heads of nope + rope rows, evenly over the ranks (as mla.py's column loader)
        per = rows // tp.size
        return tp.rank * per, (tp.rank + 1) * per
    return column_part_rows(part, rows, tp, num_kv_heads=n_kv)


class _Swap(NamedTuple):
    """One projection served from the file's blocks: its tensors in row order, the parts each holds, each
    part's rows in the full model, and the projection's parameter name (layers.3.mlp.shared_experts.down_proj
    .weight)."""
    tensors: list[Any]
    parts: list[tuple[str, ...]]
    part_rows: dict[str, int]  # q, k, v: heads x head_dim; gate, up: this layer's intermediate size
    param: str


class _Plan(NamedTuple):
    """Which of the model's linears a GGUF file's blocks serve, read from the header alone."""
    swaps: dict[tuple[int, str], _Swap]  # (layer, qkv/o/gate_up/down) -> the tensors that serve it
    logits: Any | None  # the reader tensor the logits projection is made of
    kept: list[str]  # linears that keep their float32 weights, and why
    unaligned: list[str]  # of those, row-parallel ones whose rank slice would cut a quantization group


def _part_rows(model: nn.Module, tensors: list[Any], parts: list[tuple[str, ...]]) -> dict[str, int] | None:
    """Each part's rows in the full model, from the file's tensors (a fused one cut as the model's heads
    say); None when a fused tensor does not hold the rows the model expects."""
    c = model.config
    n_head = c.num_attention_heads
    n_kv = getattr(c, "num_key_value_heads", None) or n_head
    out: dict[str, int] = {}
    for t, held in zip(tensors, parts):
        rows = int(t.shape[1])
        if len(held) == 1:
            out[held[0]] = rows
            continue
        sizes = ([n_head * model.head_dim] + [n_kv * model.head_dim] * 2 if held == ("q", "k", "v")
                 else [rows // 2] * 2)
        if sum(sizes) != rows:
            return None
        out.update(zip(held, sizes))
    return out


def _rank_shape(model: nn.Module, target: str, rows: dict[str, int], cols: int) -> tuple[int, int]:
    """[out, in] of the projection on this rank (the full one without tensor parallelism)."""
    tp = getattr(model, "tp", None)
    if tp is None:
        return sum(rows.values()), cols
    if target in _ROW_PARALLEL:
        return sum(rows.values()), cols // tp.size
    n_kv = getattr(model.config, "num_key_value_heads", None) or model.config.num_attention_heads
    spans = [_column_span(part, n, tp, n_kv) for part, n in rows.items()]
    return sum(end - first for first, end in spans), cols


def _plan(model: nn.Module, reader: Any) -> _Plan:
    linears = _ARCH_LINEARS.get(reader.fields["general.architecture"], _LINEARS)
    pieces: dict[tuple[int, str], list[Any]] = {}
    kept: list[str] = []
    unaligned: list[str] = []
    logits = None
    for t in reader.tensors:
        kind = t.tensor_type.name
        parts = t.name.split(".")
        is_linear = (parts[0] == "blk" and parts[2] in linears and parts[-1] == "weight") or \
            t.name in ("output.weight", "token_embd.weight")
        if not is_linear:
            continue
        if kind not in NATIVE_TYPES:
            if t.name != "token_embd.weight" or getattr(model, "lm_head", None) is None:
                kept.append(f"{t.name} ({kind})")
            continue
        if parts[0] == "blk":
            pieces.setdefault((int(parts[1]), linears[parts[2]][0]), []).append(t)
        elif t.name == "output.weight" or getattr(model, "lm_head", "absent") is None:
            if t.name == "output.weight" or logits is None:
                logits = t
    tp = getattr(model, "tp", None)
    swaps = {}
    for (layer_id, target), got in pieces.items():
        path = _module_path(model.layers[layer_id], target)
        owner, attr = _owner(model.layers[layer_id], path) if path else (None, "")
        old = getattr(owner, attr, None)
        order = _PARTS[target]
        got.sort(key=lambda t: order.index(linears[t.name.split(".")[2]][1][0]))
        held = [linears[t.name.split(".")[2]][1] for t in got]
        kinds = {t.tensor_type.name for t in got}
        rows = _part_rows(model, got, held) if tuple(p for h in held for p in h) == order else None
        cols = int(got[0].shape[0])
        if rows is None or not isinstance(old, Linear) or \
                tuple(old.weight.shape) != _rank_shape(model, target, rows, cols):
            kept.append(f"blk.{layer_id}.{target} (no fused float linear of that shape in this model)")
        elif not stackable(kinds):
            kept.append(f"blk.{layer_id}.{target} (mixed {'/'.join(sorted(kinds))})")
        elif tp is not None and target in _ROW_PARALLEL and (cols // tp.size) % TP_INPUT_ALIGN:
            why = (f"blk.{layer_id}.{target} ({cols} input features over tp_size {tp.size} is {cols // tp.size} "
                   f"a rank, not a multiple of the {TP_INPUT_ALIGN}-feature quantization group)")
            kept.append(why)
            unaligned.append(why)
        else:
            swaps[(layer_id, target)] = _Swap(got, held, rows, f"layers.{layer_id}.{path}.weight")
    return _Plan(swaps, logits, kept, unaligned)


def serves_tied_logits(gguf_file: GGUFFile) -> bool:
    """Whether a tied model's logits will be served from the file's blocks (``bind_gguf_blocks_``
    takes output.weight, else token_embd.weight, of a native type): then they need no float copy."""
    return any(t.name in ("output.weight", "token_embd.weight") and t.tensor_type.name in NATIVE_TYPES
               for t in gguf_file.tensors)


def bind_gguf_blocks_(model: nn.Module, gguf_file: GGUFFile, *,
                      prefill_budget: Callable[[], int] | None) -> RawRoutes:
    """Before any tensor is read: give every linear (and the logits head, and each stacked experts layer)
    that ``gguf_file``'s header says is stored in a native block type its GGUF blocks method, and return
    where the loader streams each of those tensors' raw blocks (loader/gguf_weights.py). Linears the plan
    keeps (other types, a mix of groups that do not stack, a tensor-parallel slice that would cut a group)
    keep the method they were built with and load dequantized. ``prefill_budget``: see GGUFBlocksMethod."""
    plan = _plan(model, gguf_file)
    config = model.config
    n_head = config.num_attention_heads
    n_kv = getattr(config, "num_key_value_heads", None) or n_head
    tp: TPComm | None = getattr(model, "tp", None)
    decode = _Decode(gguf_file.fields["general.architecture"], n_head, n_kv, model.checkpoint_tensor, tp)
    loaders: dict[str, list[Callable[[TensorInfo], None]]] = {}
    bound: dict[str, int] = {}

    def route(shards: Iterable[tuple[Any, TensorInfo]], loader: Callable[[Any, TensorInfo], None]) -> None:
        """Stream each (shard id, tensor) into ``loader``."""
        for shard, t in shards:
            loaders.setdefault(t.name, []).append(partial(loader, shard))
            bound[t.tensor_type.name] = bound.get(t.tensor_type.name, 0) + 1

    for (_, target), swap in plan.swaps.items():
        layer = model.get_submodule(swap.param.removesuffix(".weight"))
        split = "whole" if tp is None else "row" if target in _ROW_PARALLEL else "column"
        method = GGUFBlocksMethod(param=swap.param, shards=swap.parts, part_rows=swap.part_rows,
                                  source_type="/".join(sorted({t.tensor_type.name for t in swap.tensors})),
                                  split=split, decode=decode, prefill_budget=prefill_budget)
        layer.rebind(method)
        route(enumerate(swap.tensors), method.weight_loader)
    expert_swaps, expert_kept = plan_experts(model, gguf_file, align=TP_INPUT_ALIGN)
    for layer_id, got in expert_swaps.items():
        experts = model.layers[layer_id].mlp.experts
        experts_method = GGUFExpertsMethod(got, act_is_silu=experts.act_is_silu, tp=tp)
        experts.rebind(experts_method)
        route(got.items(), experts_method.weight_loader)
    dequantized_too: frozenset[str] = frozenset()
    if plan.logits is not None:
        t = plan.logits
        vocab, hidden = int(t.shape[1]), int(t.shape[0])
        head_method = GGUFBlocksMethod(param="lm_head.weight", shards=[("logits",)], part_rows={"logits": vocab},
                                       source_type=t.tensor_type.name, split="whole" if tp is None else "vocab",
                                       decode=decode._replace(checkpoint_tensor=None),
                                       prefill_budget=prefill_budget)
        model.lm_head = (Linear(hidden, vocab, method=head_method) if tp is None
                         else VocabParallelHead(vocab, hidden, tp=tp, method=head_method))
        route([(0, t)], head_method.weight_loader)
        if t.name == "token_embd.weight":  # tied: the same table also fills the embedding's lookups
            dequantized_too = frozenset([t.name])
    kept = plan.kept + expert_kept
    if kept:
        logger.info("GGUF tensors kept dequantized to float32: %s",
                    ", ".join(kept[:8]) + (f" and {len(kept) - 8} more" if len(kept) > 8 else ""))
    if plan.unaligned:
        logger.warning("tensor parallelism: %d row-parallel linears kept dequantized to float32 on every rank, "
                       "their rank slice would cut a quantization group: %s", len(plan.unaligned),
                       ", ".join(plan.unaligned[:4]) + (" ..." if len(plan.unaligned) > 4 else ""))
    if bound:
        logger.info("GGUF weights served quantized: %s", ", ".join(f"{n} {k}" for k, n in sorted(bound.items())))
    return RawRoutes(loaders, dequantized_too)
