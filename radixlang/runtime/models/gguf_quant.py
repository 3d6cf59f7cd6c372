"""A quantized GGUF's weights served as they are stored (``--quantization gguf``, the default for one on the CPU).

The model is first built and loaded from the GGUF file (loader/gguf_convert.py: config and tokenizer;
loader/gguf_weights.py: the tensors that stay float32, dequantized one at a time: norms, the embedding table for
lookups, linears of other types), the linears planned here left unloaded. Then every linear whose GGUF
tensor is one of the block types below is replaced by a ``QuantLinear`` holding that tensor's integer
codes and per-group scales and offsets, read straight from the file, so a decode step streams the
quantized bytes instead of float32:

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
keep their dequantized float32 weights, with a log line
naming them. A MoE layer's stacked expert tensors are served the same way (gguf_experts.py), and so are
its shared experts. q/k/v and gate/up are stacked into the model's fused projections (Phi-3's files hold
them fused already: attn_qkv, and ffn_up for gate/up); the tied logits projection reads the quantized
embedding table. DeepSeek's MLA projections q (or q_a and q_b) and kv_a are served from blocks too, their
rows in the order the model keeps (its ``checkpoint_tensor`` de-interleaves the rope rows at load; the
blocks run along rows, so whole rows move); kv_b stays float32 (layers/mla.py absorbs its two halves).
Decoding the blocks is gguf_blocks.py.

Under tensor parallelism (``--tp-size``) each rank keeps only its slice of every block tensor, cut from
the decoded codes, scales and offsets: column-parallel projections (q/k/v, gate/up, the logits) take whole
output rows, each part of a fused projection sliced alone as ``load_weights`` slices a float one (its q
heads, its kv heads, its half of gate and of up; the vocabulary padded with zero rows); row-parallel ones
(o_proj, down_proj: ``RowParallelQuantLinear``, partial sums all-reduced, bias added once) take whole
groups of input features. Their slice must start on a multiple of ``TP_INPUT_ALIGN`` (32) features: the
K-types' 256-weight super-blocks are decoded into per-32 (Q6_K: per-16) scales and offsets, so 32 is the
coarsest group any kept layout has, and the int8-activation kernels quantize activations per 32 features
too; on those boundaries a rank's partial sum has exactly the single-rank sum's terms. A linear whose
slice would cut a group is not refused: it keeps its dequantized float32 weight on every rank (sliced like
a float checkpoint's), with a warning naming it, its input size, the group and the tp size.
"""
from __future__ import annotations

import logging
from typing import Any, NamedTuple

import torch
from torch import nn

from radixlang.kernels.cpu import quant as qk
from radixlang.runtime.models.gguf_blocks import (NATIVE_TYPES, DecodedBlocks,
                                                  QuantLinear, common_layout, decode_tensor, stackable)
from radixlang.runtime.models.loader.gguf_file import GGUFFile, read_gguf
from radixlang.runtime.models.gguf_experts import apply_experts_, expert_param_names, plan_experts
from radixlang.runtime.models.layers.linear import Linear
from radixlang.runtime.models.parallel import TPComm, column_part_rows, padded_vocab

logger = logging.getLogger(__name__)



def add_prefill_copies_(model: nn.Module, *, max_bytes: int | None = None) -> int:
    """Give every QuantLinear a oneDNN-packed float32 copy of its dequantized weight for matmuls of more
    than KERNEL_MAX_ROWS rows (prefills), which then run as fast as the float32 model's instead of
    dequantizing per call. Decode steps never touch the copy, so they still stream only the quantized
    bytes; the copies cost memory (4 bytes a weight). Where they would take more than ``max_bytes``
    (a 7B model's are ~28 GB) none are made: prefills then dequantize each layer's weight per call.
    Returns how many were added (0 without packing)."""
    from radixlang.runtime.models import packed

    if not packed.packing_available():
        return 0
    need = sum(4 * m.out_features * m.in_features for m in model.modules() if isinstance(m, QuantLinear))
    if max_bytes is not None and need > max_bytes:
        logger.warning("no float32 prefill copies of the quantized weights: they would take %.1f GiB, more than "
                       "the %.1f GiB allowed; prefills dequantize each layer per call (slower)",
                       need / 2**30, max_bytes / 2**30)
        return 0
    count, warmed = 0, set()
    for m in model.modules():
        if isinstance(m, QuantLinear) and m.dense is None:
            m.dense = packed.PackedLinear(m.dequantized_weight(), m.bias)
            key = (m.out_features, m.in_features, m.bias is None)
            if key not in warmed:  # oneDNN's kernels are cached per weight shape: one layer compiles them
                warmed.add(key)
                m.dense.warm_up()
            count += 1
    return count


# --- the model hook ---------------------------------------------------------------------------------------

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


def serve_gguf_blocks_(model: nn.Module, gguf_file: GGUFFile | None, *, prefill_copies: bool,
                       prefill_copy_bytes: int | None) -> dict[str, int]:
    """``--quantization gguf``: the linears ``gguf_replaced_params`` left unloaded served from the blocks of
    ``gguf_file`` (the file the model was loaded from, its header read once per start); ``prefill_copies``:
    plus a packed float32 copy per layer for prefills unless they would exceed ``prefill_copy_bytes``."""
    if gguf_file is None:
        raise ValueError("quantization 'gguf' needs a .gguf model file, got a checkpoint of another format")
    swapped = apply_gguf_quantization_(model, gguf_file)
    if prefill_copies:
        add_prefill_copies_(model, max_bytes=prefill_copy_bytes)
    return swapped


def serves_tied_logits(gguf_file: GGUFFile) -> bool:
    """Whether a tied model's logits will be served from the file's blocks (``apply_gguf_quantization_``
    takes output.weight, else token_embd.weight, of a native type): then they need no float copy."""
    return any(t.name in ("output.weight", "token_embd.weight") and t.tensor_type.name in NATIVE_TYPES
               for t in gguf_file.tensors)


def gguf_file_types(path: str) -> dict[str, str]:
    """{tensor name: GGUF type name} of a GGUF file (reads only its header)."""
    return {t.name: t.tensor_type.name for t in read_gguf(path).tensors}


def is_quantized_gguf(path: str) -> bool:
    """Whether the file holds any linear weight of a type served natively."""
    return any(kind in NATIVE_TYPES for kind in gguf_file_types(path).values())


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
    if part == "q_b":  # whole heads of nope + rope rows, evenly over the ranks (deepseek_v2._rank_slice)
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
    """Which of the model's linears a GGUF file's blocks replace, read from the header alone."""
    swaps: dict[tuple[int, str], _Swap]  # (layer, qkv/o/gate_up/down) -> what replaces it
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


def gguf_replaced_params(model: nn.Module, reader: GGUFFile) -> set[str]:
    """The names of the parameters ``apply_gguf_quantization_`` will replace (from the file's header), so
    that loading can leave them unfilled: the float32 copies of those weights are never made."""
    plan = _plan(model, reader)
    names = {swap.param for swap in plan.swaps.values()}
    names |= expert_param_names(plan_experts(model, reader, align=TP_INPUT_ALIGN)[0])
    if plan.logits is not None and getattr(model, "lm_head", None) is not None:
        names.add("lm_head.weight")
    return names


def apply_gguf_quantization_(model: nn.Module, reader: GGUFFile) -> dict[str, int]:
    """Swap the model's linears for QuantLinears over the GGUF file's own blocks; returns type -> tensors
    swapped. Under tensor parallelism each rank keeps its slice of every block tensor (whole output rows of
    q/k/v, gate/up and the logits; whole groups of o_proj's and down_proj's input features), each part of a
    fused projection sliced alone. Refuses a model left with a parameter that loading skipped and no swap
    replaced."""

    from radixlang.runtime.models.loader.gguf_weights import restore_layout

    plan = _plan(model, reader)
    arch = reader.fields["general.architecture"]
    n_head = model.config.num_attention_heads
    n_kv = getattr(model.config, "num_key_value_heads", None) or n_head
    tp: TPComm | None = getattr(model, "tp", None)

    def blocks(t: Any) -> DecodedBlocks:
        kind = t.tensor_type.name
        q, scale, offset, group = decode_tensor(kind, t.data, int(t.shape[1]), int(t.shape[0]))
        # the converter's row order (gguf_convert: llama's q/k rows are permuted back); blocks run along rows
        q, scale, offset = (restore_layout(arch, t.name, a, n_head, n_kv) for a in (q, scale, offset))
        return DecodedBlocks(kind, q, scale, offset, group)

    def model_rows(name: str, full: DecodedBlocks) -> DecodedBlocks:
        """The rows in the order the model keeps them: its ``checkpoint_tensor`` applied to the row numbers
        (DeepSeek de-interleaves the rope rows of q_b and kv_a; the other families keep the file's order)."""
        n = full.q.shape[0]
        order = model.checkpoint_tensor(name, torch.arange(n, dtype=torch.float64)[:, None])
        index = order[:, 0].round().long()
        if torch.equal(index, torch.arange(n)):
            return full
        if not torch.equal(index.sort().values, torch.arange(n)):
            raise RuntimeError(f"{name}: the model's load-time change is not a row order; it cannot keep blocks")
        return full.take_rows(index.numpy())

    def rank_parts(target: str, swap: _Swap) -> list[qk.QuantWeight]:
        rows = swap.part_rows
        out = []
        for t, held in zip(swap.tensors, swap.parts):
            full = model_rows(swap.param, blocks(t))
            first = 0
            for part in held:  # a fused tensor is cut into its parts first
                piece = full.rows(first, first + rows[part])
                first += rows[part]
                if tp is not None and target in _ROW_PARALLEL:
                    per = piece.q.shape[1] // tp.size
                    piece = piece.cols(tp.rank * per, (tp.rank + 1) * per)
                elif tp is not None:
                    piece = piece.rows(*_column_span(part, rows[part], tp, n_kv))
                out.append(piece)
        return [piece.weight() for piece in common_layout(out)]

    swapped: dict[str, int] = {}
    for (_, target), swap in plan.swaps.items():
        owner, attr = _owner(model, swap.param.removesuffix(".weight"))
        old = getattr(owner, attr)
        kinds = "/".join(sorted({t.tensor_type.name for t in swap.tensors}))
        weight = qk.QuantWeight.concat(rank_parts(target, swap))
        bias = getattr(old, "bias", None)
        setattr(owner, attr, QuantLinear(weight, bias, kinds) if tp is None or target not in _ROW_PARALLEL
                else RowParallelQuantLinear(weight, bias, kinds, tp=tp))
        for t in swap.tensors:
            swapped[t.tensor_type.name] = swapped.get(t.tensor_type.name, 0) + 1
    expert_swaps, expert_kept = plan_experts(model, reader, align=TP_INPUT_ALIGN)
    for kind, n in apply_experts_(model, expert_swaps).items():
        swapped[kind] = swapped.get(kind, 0) + n
    if plan.logits is not None:
        kind = plan.logits.tensor_type.name
        head = blocks(plan.logits)
        if tp is None:
            model.lm_head = QuantLinear(head.weight(), None, kind)
        else:  # this rank's rows of the vocabulary, zero rows past it (parallel.shard_vocab)
            vocab = head.q.shape[0]
            per = padded_vocab(vocab, tp.size) // tp.size
            mine = head.rows(tp.rank * per, (tp.rank + 1) * per).padded(per)
            model.lm_head = VocabParallelQuantHead(QuantLinear(mine.weight(), None, kind), tp=tp, vocab_size=vocab)
        swapped[kind] = swapped.get(kind, 0) + 1
    unset = [name for name, p in model.named_parameters() if p.is_meta]
    if unset:
        raise RuntimeError(f"parameters left unloaded for the GGUF blocks and not replaced: {unset[:5]}")
    kept = plan.kept + expert_kept
    if kept:
        logger.info("GGUF tensors kept dequantized to float32: %s",
                    ", ".join(kept[:8]) + (f" and {len(kept) - 8} more" if len(kept) > 8 else ""))
    if plan.unaligned:
        logger.warning("tensor parallelism: %d row-parallel linears kept dequantized to float32 on every rank, "
                       "their rank slice would cut a quantization group: %s", len(plan.unaligned),
                       ", ".join(plan.unaligned[:4]) + (" ..." if len(plan.unaligned) > 4 else ""))
    logger.info("GGUF weights served quantized: %s", ", ".join(f"{n} {k}" for k, n in sorted(swapped.items())))
    return swapped


class RowParallelQuantLinear(QuantLinear):
    """A row-parallel QuantLinear (o_proj, down_proj under tensor parallelism): this rank's input features;
    the ranks' partial sums are all-reduced and the bias is added once, after the sum."""

    def __init__(self, weight: qk.QuantWeight, bias: torch.Tensor | None, source_type: str, *,
                 tp: TPComm) -> None:
        super().__init__(weight, None, source_type)  # no bias in the partial sums (nor in a prefill copy)
        self.tp = tp
        self.register_buffer("sum_bias", None if bias is None else bias.detach().float().contiguous())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x [n, in_features / size] -> [n, out_features], summed over the ranks
        y = self.tp.all_reduce(super().forward(x))
        return y if self.sum_bias is None else y + self.sum_bias.to(y.dtype)

    def partial_sum(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's term of ``forward`` (the bias in rank 0's): the caller all-reduces."""
        y = super().forward(x)
        return y if self.sum_bias is None or self.tp.rank != 0 else y + self.sum_bias.to(y.dtype)


class VocabParallelQuantHead(nn.Module):
    """The quantized logits projection split by vocabulary rows (like parallel.ParallelLMHead): each rank
    holds ``padded_vocab / size`` rows, zero past the vocabulary, and the ranks' logits are all-gathered."""

    def __init__(self, linear: QuantLinear, *, tp: TPComm, vocab_size: int) -> None:
        super().__init__()
        self.linear, self.tp, self.vocab_size = linear, tp, vocab_size

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        # hidden [n, hidden] -> this rank's [n, per_rank] -> gathered [n, padded] -> [n, vocab]
        return self.tp.all_gather(self.linear(hidden).contiguous())[:, :self.vocab_size]
