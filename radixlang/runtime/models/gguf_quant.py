"""A quantized GGUF's weights served as they are stored (``--quantization gguf``, the default for one on the CPU).

The model is first built and loaded from the GGUF's dequantized float32 copy (gguf_convert.py: config,
tokenizer, norms, the embedding table for lookups). Then every linear whose GGUF tensor is one of the block
types below is replaced by a ``QuantLinear`` holding that tensor's integer codes and per-group scales and
offsets, read straight from the file, so a decode step streams the quantized bytes instead of float32:

=====  =========================================  =================================
type   stored per block                           kept as (kernels/cpu/quant.py)
=====  =========================================  =================================
Q4_0   32 x 4-bit, f16 scale d: d * (q - 8)        q4, scale d, offset -8d
Q4_1   32 x 4-bit, f16 d and m: d * q + m          q4, scale d, offset m
Q8_0   32 x int8, f16 d: d * q                      q8 (group 32), scale d, offset 0
Q4_K   256: 8 x 32 x 4-bit, 6-bit scales / mins     q4, scale d * sc, offset -dmin * m
Q5_K   256: 8 x 32 x 5-bit, 6-bit scales / mins     q8 (group 32), scale d * sc, offset -dmin * m
Q6_K   256: 16 x 16 x 6-bit, int8 scales           q8 (group 16) of q - 32, scale d * sc, offset 0
=====  =========================================  =================================

Each weight the kernel decodes is ``q * scale + offset`` in float32, the number the dequantized model
holds up to one rounding. With float32 activations, outputs match the ``--dtype float32`` path (the same
file dequantized) to float32 rounding; on a VNNI CPU, rows of one or two (decode steps) take their
activations as int8 codes in three passes (22 bits; kernels/cpu/quant.py, docs/cpu.md), within ~1e-4.
Tensors of other types (F16, Q5_0, Q2_K, ...) keep their dequantized float32 weights, with a log line
naming them. q/k/v and gate/up are stacked into the model's fused projections; the tied logits
projection reads the quantized embedding table.
"""
from __future__ import annotations

import logging
from typing import Any, NamedTuple

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from radixlang.kernels.cpu import quant as qk

logger = logging.getLogger(__name__)

_LAYOUTS = {"Q4_0": ("q4", 32), "Q4_1": ("q4", 32), "Q4_K": ("q4", 32), "Q8_0": ("q8", 32), "Q5_K": ("q8", 32),
            "Q6_K": ("q8", 16)}  # the layout and group each type is kept in (decode_tensor, to_quant_weight)
NATIVE_TYPES = tuple(_LAYOUTS)
# up to this many rows the kernel (which decodes each weight group once per 4 rows) is used; past it the
# weight is dequantized once for the call and the rows run through a float32 GEMM
KERNEL_MAX_ROWS = 16


class QuantLinear(nn.Module):
    """y = x @ W^T (+ bias) with W a QuantWeight; float32 in and out."""

    def __init__(self, weight: qk.QuantWeight, bias: torch.Tensor | None, source_type: str) -> None:
        super().__init__()
        self.weight_q = weight.interleave()  # the layout this CPU's kernels read fastest
        self.register_buffer("bias", None if bias is None else bias.detach().float().contiguous())
        self.out_features, self.in_features = weight.out_features, weight.in_features
        self.source_type = source_type
        self.dense: nn.Module | None = None  # see add_prefill_copies_

    def extra_repr(self) -> str:
        return f"{self.in_features} -> {self.out_features}, {self.source_type} as {self.weight_q.layout}"

    def dequantized_weight(self) -> torch.Tensor:
        return qk.dequantize(self.weight_q)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        if x2.dtype != torch.float32:
            x2 = x2.float()
        if x2.shape[0] <= KERNEL_MAX_ROWS:
            y = qk.linear(x2, self.weight_q, self.bias)
        elif self.dense is not None:
            y = self.dense(x2)
        else:
            y = F.linear(x2, qk.dequantize(self.weight_q), self.bias)
        return y.to(x.dtype).view(*lead, self.out_features)


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


# --- GGUF blocks -> (integer codes [rows, cols], scales and offsets [rows, cols / group]) ---------------

def _f16(b: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(b).view(np.float16).astype(np.float32)[..., 0]


def _k_scale_min(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K: 12 bytes -> 8 six-bit scales and 8 six-bit mins per 256-block."""
    s = scales.reshape(-1, 3, 4)
    d, m, md = s[:, 0], s[:, 1], s[:, 2]
    sc = np.concatenate([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc.astype(np.float32), mn.astype(np.float32)


def _decode(kind: str, raw: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """raw uint8 [n_blocks, block_bytes] -> codes [n_blocks, weights], scales, offsets [n_blocks, groups], group."""
    n = raw.shape[0]
    if kind == "Q4_0":
        d, qs = _f16(raw[:, 0:2]), raw[:, 2:18]
        q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)
        return q, d[:, None], (-8.0 * d)[:, None], 32
    if kind == "Q4_1":
        d, m, qs = _f16(raw[:, 0:2]), _f16(raw[:, 2:4]), raw[:, 4:20]
        q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)
        return q, d[:, None], m[:, None], 32
    if kind == "Q8_0":
        d = _f16(raw[:, 0:2])
        return raw[:, 2:34].view(np.int8), d[:, None], np.zeros((n, 1), np.float32), 32
    if kind in ("Q4_K", "Q5_K"):
        d, dmin = _f16(raw[:, 0:2]), _f16(raw[:, 2:4])
        sc, mn = _k_scale_min(raw[:, 4:16])
        scale, offset = d[:, None] * sc, -(dmin[:, None] * mn)
        if kind == "Q4_K":  # 4 chunks of 64 weights in 32 bytes: low nibbles the first 32, high the next
            qs = raw[:, 16:144].reshape(n, 4, 1, 32)
            q = ((qs >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)) & 0x0F).reshape(n, 256)
        else:  # the same low nibbles, plus a fifth bit per weight: bit j of qh[i] for sub-block j
            qh, qs = raw[:, 16:48], raw[:, 48:176]
            lo = ((qs.reshape(n, 4, 1, 32) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)) & 0x0F).reshape(n, 8, 32)
            hi = ((qh.reshape(n, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)) & 1)
            q = (lo | (hi << 4)).reshape(n, 256).astype(np.int8)
        return q, scale, offset, 32
    if kind == "Q6_K":
        ql, qh, sc, d = raw[:, 0:128], raw[:, 128:192], raw[:, 192:208].view(np.int8), _f16(raw[:, 208:210])
        lo = ((ql.reshape(n, 2, 1, 64) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)) & 0x0F).reshape(n, 2, 128)
        hi = ((qh.reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)) & 3).reshape(n, 2, 128)
        q = ((lo | (hi << 4)).astype(np.int16) - 32).astype(np.int8).reshape(n, 256)
        return q, d[:, None] * sc.astype(np.float32), np.zeros((n, 16), np.float32), 16
    raise ValueError(f"no native layout for GGUF type {kind}")


def _block_bytes(kind: str) -> int:
    return {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34, "Q4_K": 144, "Q5_K": 176, "Q6_K": 210}[kind]


def decode_tensor(kind: str, data: np.ndarray, rows: int, cols: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """A GGUF tensor's raw bytes -> codes [rows, cols], scales / offsets [rows, cols / group], group."""
    per = 32 if kind in ("Q4_0", "Q4_1", "Q8_0") else 256
    if cols % per:
        raise ValueError(f"a {kind} tensor needs rows of a multiple of {per} weights, got {cols}")
    raw = np.ascontiguousarray(data).view(np.uint8).reshape(-1, _block_bytes(kind))
    if raw.shape[0] != rows * cols // per:
        raise ValueError(f"{kind} tensor of {raw.shape[0]} blocks does not hold [{rows}, {cols}]")
    q, scale, offset, group = _decode(kind, raw)
    return (q.reshape(rows, cols), np.ascontiguousarray(scale, np.float32).reshape(rows, cols // group),
            np.ascontiguousarray(offset, np.float32).reshape(rows, cols // group), group)


def to_quant_weight(kind: str, q: np.ndarray, scale: np.ndarray, offset: np.ndarray, group: int) -> qk.QuantWeight:
    rows, cols = q.shape
    if _LAYOUTS[kind][0] == "q4":  # our q4 order: byte i of a 32-group = weight i | weight i + 16 << 4
        g = q.astype(np.uint8).reshape(rows, cols // 32, 32)
        codes = torch.from_numpy(np.ascontiguousarray((g[..., :16] | (g[..., 16:] << 4)).reshape(rows, cols // 2)))
        layout = "q4"
    else:
        codes = torch.from_numpy(np.ascontiguousarray(q.astype(np.int8)))
        layout = "q8"
    return qk.QuantWeight(layout, codes, torch.from_numpy(scale.copy()), torch.from_numpy(offset.copy()),
                          group, rows, cols)


# --- the model hook ---------------------------------------------------------------------------------------

_LINEARS = {"attn_q": ("qkv", 0), "attn_k": ("qkv", 1), "attn_v": ("qkv", 2), "attn_output": ("o", 0),
            "ffn_gate": ("gate_up", 0), "ffn_up": ("gate_up", 1), "ffn_down": ("down", 0)}


def gguf_file_types(path: str) -> dict[str, str]:
    """{tensor name: GGUF type name} of a GGUF file (reads only its header)."""
    import gguf

    return {t.name: t.tensor_type.name for t in gguf.GGUFReader(path).tensors}


def is_quantized_gguf(path: str) -> bool:
    """Whether the file holds any linear weight of a type served natively."""
    return any(kind in NATIVE_TYPES for kind in gguf_file_types(path).values())


_ROOMS = {"qkv": ("self_attn", "qkv_proj"), "o": ("self_attn", "o_proj"), "gate_up": ("mlp", "gate_up_proj"),
          "down": ("mlp", "down_proj")}


class _Plan(NamedTuple):
    """Which of the model's linears a GGUF file's blocks replace, read from the header alone."""
    swaps: dict[tuple[int, str], dict[int, Any]]  # (layer, qkv/o/gate_up/down) -> {part: reader tensor}
    logits: Any | None  # the reader tensor the logits projection is made of
    kept: list[str]  # linears that keep their float32 weights, and why


def _plan(model: nn.Module, reader: Any) -> _Plan:
    if getattr(model, "tp", None) is not None:
        raise ValueError("quantization 'gguf' is not supported with tensor parallelism")
    pieces: dict[tuple[int, str], dict[int, Any]] = {}
    kept: list[str] = []
    logits = None
    for t in reader.tensors:
        kind = t.tensor_type.name
        parts = t.name.split(".")
        is_linear = (parts[0] == "blk" and parts[2] in _LINEARS and parts[-1] == "weight") or \
            t.name in ("output.weight", "token_embd.weight")
        if not is_linear:
            continue
        if kind not in NATIVE_TYPES:
            if t.name != "token_embd.weight" or getattr(model, "lm_head", None) is None:
                kept.append(f"{t.name} ({kind})")
            continue
        if parts[0] == "blk":
            target, index = _LINEARS[parts[2]]
            pieces.setdefault((int(parts[1]), target), {})[index] = t
        elif t.name == "output.weight" or getattr(model, "lm_head", "absent") is None:
            if t.name == "output.weight" or logits is None:
                logits = t
    swaps = {}
    for (layer_id, target), got in pieces.items():
        room, attr = _ROOMS[target]
        old = getattr(getattr(model.layers[layer_id], room, None), attr, None)
        want = {"qkv": 3, "gate_up": 2}.get(target, 1)
        kinds = {t.tensor_type.name for t in got.values()}
        shape = (sum(int(t.shape[1]) for t in got.values()), int(next(iter(got.values())).shape[0]))  # [out, in]
        if not isinstance(old, nn.Linear) or tuple(old.weight.shape) != shape:
            kept.append(f"blk.{layer_id}.{target} (no fused float linear of that shape in this model)")
        elif len(got) != want or len({_LAYOUTS[k] for k in kinds}) != 1:  # a fused projection: one layout
            kept.append(f"blk.{layer_id}.{target} (mixed {'/'.join(sorted(kinds))})")
        else:
            swaps[(layer_id, target)] = got
    return _Plan(swaps, logits, kept)


def gguf_replaced_params(model: nn.Module, gguf_path: str) -> set[str]:
    """The names of the parameters ``apply_gguf_quantization_`` will replace (from the file's header), so
    that loading can leave them unfilled: the float32 copies of those weights are never made."""
    import gguf

    plan = _plan(model, gguf.GGUFReader(gguf_path))
    names = {f"layers.{layer_id}.{'.'.join(_ROOMS[target])}.weight" for layer_id, target in plan.swaps}
    if plan.logits is not None and getattr(model, "lm_head", None) is not None:
        names.add("lm_head.weight")
    return names


def apply_gguf_quantization_(model: nn.Module, gguf_path: str) -> dict[str, int]:
    """Swap the model's linears for QuantLinears over the GGUF file's own blocks; returns type -> tensors
    swapped. Refuses a model left with a parameter that loading skipped and no swap replaced."""
    import gguf

    from radixlang.runtime.models.gguf_convert import restore_layout

    reader = gguf.GGUFReader(gguf_path)
    plan = _plan(model, reader)
    arch = reader.fields["general.architecture"].contents()
    n_head = model.config.num_attention_heads
    n_kv = getattr(model.config, "num_key_value_heads", None) or n_head

    def quant_weight(t: Any) -> qk.QuantWeight:
        kind = t.tensor_type.name
        q, scale, offset, group = decode_tensor(kind, t.data, int(t.shape[1]), int(t.shape[0]))
        # the converter's row order (gguf_convert: llama's q/k rows are permuted back); blocks run along rows
        q, scale, offset = (restore_layout(arch, t.name, a, n_head, n_kv) for a in (q, scale, offset))
        return to_quant_weight(kind, q, scale, offset, group)

    swapped: dict[str, int] = {}
    for (layer_id, target), got in plan.swaps.items():
        room, attr = _ROOMS[target]
        owner = getattr(model.layers[layer_id], room)
        old = getattr(owner, attr)
        kinds = sorted({t.tensor_type.name for t in got.values()})
        weight = qk.QuantWeight.concat([quant_weight(got[i]) for i in range(len(got))])
        setattr(owner, attr, QuantLinear(weight, getattr(old, "bias", None), "/".join(kinds)))
        for t in got.values():
            swapped[t.tensor_type.name] = swapped.get(t.tensor_type.name, 0) + 1
    if plan.logits is not None:
        kind = plan.logits.tensor_type.name
        model.lm_head = QuantLinear(quant_weight(plan.logits), None, kind)
        swapped[kind] = swapped.get(kind, 0) + 1
    unset = [name for name, p in model.named_parameters() if p.is_meta]
    if unset:
        raise RuntimeError(f"parameters left unloaded for the GGUF blocks and not replaced: {unset[:5]}")
    kept = plan.kept
    if kept:
        logger.info("GGUF tensors kept dequantized to float32 (no native kernel for their type): %s",
                    ", ".join(kept[:8]) + (f" and {len(kept) - 8} more" if len(kept) > 8 else ""))
    logger.info("GGUF weights served quantized: %s", ", ".join(f"{n} {k}" for k, n in sorted(swapped.items())))
    return swapped
