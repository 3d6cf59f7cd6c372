"""Quantized linear kernels (csrc/quant_ops.c) through ctypes: weight = code * scale + offset per group.

``QuantWeight`` holds one weight matrix in one of two layouts (see the C source): ``q4`` (two 4-bit codes a
byte, groups of 32) or ``q8`` (int8 codes, groups of 16 or 32), with float32 scales and offsets per group.
``linear`` multiplies float32 activations by it without forming the float32 weight; ``dequantize`` forms
it (the weight of a float32 GEMM over many rows). Built on first use like the other CPU kernels.

Two kernels do ``linear``: csrc/quant_ops.c decodes each weight to float32 and multiplies it by the float32
activations (the result is the dequantized matmul's up to the order of the sums), and csrc/quant_vnni.c,
on CPUs with AVX512-VNNI or AVX-VNNI, quantizes each activation row to int8 per group of 32 and takes
integer dot products of codes and activations (lossy by the activation rounding; see its header), in one
pass (int8) or more (int8x2, int8x3: then the int8 codes of what the earlier passes leave). ``linear(...,
activations=None)`` takes DEFAULT_ACTIVATIONS for up to INT8_MAX_ROWS rows (INTERLEAVED_INT8_MAX_ROWS on
the 16-feature interleaved layouts q4x16 / q8x16 of AVX512-VNNI CPUs) where the CPU has VNNI and the layout
fits, else float32.
"""
from __future__ import annotations

import ctypes
import functools
import logging
from dataclasses import dataclass

import torch

from radixlang.kernels.cpu.build import QUANT_SOURCE, QUANT_VNNI_SOURCE, BuildError, load_library

logger = logging.getLogger(__name__)

_P, _I64, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
_SIGNATURES = {
    "rl_q4_linear": (None, [_P, _I64, _I64, _P, _P, _P, _P, _P, _I64, _INT]),
    "rl_q8_linear": (None, [_P, _I64, _I64, _I64, _P, _P, _P, _P, _P, _I64, _INT]),
    "rl_q4_dequantize": (None, [_P, _P, _P, _P, _I64, _I64, _INT]),
    "rl_q8_dequantize": (None, [_P, _I64, _P, _P, _P, _I64, _I64, _INT]),
}
_VNNI_SIGNATURES = {
    "rl_vnni_level": (_INT, []),
    "rl_q4_linear_i8": (_INT, [_P, _I64, _I64, _P, _P, _P, _P, _P, _I64, _INT, _INT]),
    "rl_q8_linear_i8": (_INT, [_P, _I64, _I64, _I64, _P, _P, _P, _P, _P, _I64, _INT, _INT]),
    "rl_q4x16_linear_i8": (_INT, [_P, _I64, _I64, _P, _P, _P, _P, _P, _I64, _INT, _INT]),
    "rl_q8x16_linear_i8": (_INT, [_P, _I64, _I64, _I64, _P, _P, _P, _P, _P, _I64, _INT, _INT]),
    "rl_quant_moe_i8": (_INT, [_P, _P, _P, _I64, _I64, _I64, _I64, _I64, _INT, _I64, _P, _INT, _I64, _P, _I64,
                               _INT, _P, _P, _P, _INT]),
}
VNNI_LEVELS = {2: "avx512-vnni", 1: "avx-vnni"}
# how ``linear`` takes the activations: float32 (each weight decoded to float32), or quantized per group of
# 32 to int8 codes for integer dot products, in one pass (llama.cpp's way) or two or three (the int8 codes
# of what the earlier passes leave: about 15 and 22 significant bits)
ACTIVATIONS = {"float32": 0, "int8": 1, "int8x2": 2, "int8x3": 3}
DEFAULT_ACTIVATIONS = "int8x3"  # the one pass of llama.cpp moves SmolLM2's greedy output (its outliers)
INT8_MAX_ROWS = 2  # from 3 rows on, the per-row work of three passes outweighs the cheaper decoding
# ... except on the interleaved layouts, whose int8x3 kernels ran faster than the float32 ones at every row
# count from 1 to 16 (docs/cpu.md, "16 output features a vector")
INTERLEAVED_INT8_MAX_ROWS = 16
LAYOUTS = ("q4", "q8", "q4x16", "q8x16")


@functools.cache
def _library() -> ctypes.CDLL | str:
    try:
        return load_library(_SIGNATURES, QUANT_SOURCE)
    except (BuildError, OSError, AttributeError) as e:
        logger.warning("radixlang quantized CPU kernels unavailable: %s", e)
        return str(e)


@functools.cache
def _vnni_library() -> ctypes.CDLL | None:
    try:
        lib = load_library(_VNNI_SIGNATURES, QUANT_VNNI_SOURCE)
    except (BuildError, OSError, AttributeError) as e:
        logger.warning("radixlang int8-activation kernels unavailable (the float32 ones run): %s", e)
        return None
    return lib if lib.rl_vnni_level() in VNNI_LEVELS else None


def vnni() -> str | None:
    """The int8 dot-product instructions the int8-activation kernel was built for here ("avx512-vnni",
    "avx-vnni"), or None where the CPU has neither (then ``linear`` always runs the float32 kernel)."""
    lib = _vnni_library()
    return None if lib is None else VNNI_LEVELS[lib.rl_vnni_level()]


def int8_fits(w: QuantWeight) -> bool:
    """Whether the int8-activation kernel takes this weight here (a VNNI CPU; q8 groups of 16, 32 or a
    multiple of 64)."""
    return vnni() is not None and (w.layout != "q8" or 64 % w.group == 0 or w.group % 64 == 0)


def int8_max_rows(w: QuantWeight) -> int:
    """Up to how many rows ``linear`` takes DEFAULT_ACTIVATIONS for this weight by default (0: never here)."""
    if not int8_fits(w):
        return 0
    return INTERLEAVED_INT8_MAX_ROWS if w.layout in ("q4x16", "q8x16") else INT8_MAX_ROWS


def available() -> bool:
    return not isinstance(_library(), str)


def _load() -> ctypes.CDLL:
    lib = _library()
    if isinstance(lib, str):
        raise RuntimeError(f"radixlang quantized CPU kernels are unavailable: {lib}")
    return lib


INTERLEAVED = {"q4": "q4x16", "q8": "q8x16"}


@dataclass(frozen=True)
class QuantWeight:
    """One [out_features, in_features] weight: codes, and float32 scales / offsets [out, in / group].

    ``q4x16`` and ``q8x16`` hold the same numbers as ``q4`` and ``q8`` with their bytes interleaved by 16
    output features for the AVX512-VNNI kernels that take 16 features a vector (``interleave``; quant_vnni.c:
    rl_q4x16_linear_i8, rl_q8x16_linear_i8): the tensors keep their shapes, their bytes are reordered
    (``plain`` gives the plain layout back)."""
    layout: str
    codes: torch.Tensor  # q4 / q4x16: uint8 [out, in / 2]; q8: int8 [out, in]; q8x16: uint8 [out, in] (q + 128)
    scales: torch.Tensor
    offsets: torch.Tensor
    group: int
    out_features: int
    in_features: int

    def __post_init__(self) -> None:
        n, k, g = self.out_features, self.in_features, self.group
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {self.layout!r}")
        q4 = self.layout in ("q4", "q4x16")
        if g % 16 or k % g or (q4 and g != 32) or (self.layout == "q8x16" and g not in (16, 32)):
            raise ValueError(f"group {g} does not fit layout {self.layout} with {k} input features")
        if self.layout in INTERLEAVED.values() and (n % 16 or k % 32):
            raise ValueError(f"layout {self.layout} needs a multiple of 16 outputs and of 32 inputs, got {n} x {k}")
        want = ((torch.uint8, (n, k // 2)) if q4 else
                (torch.int8 if self.layout == "q8" else torch.uint8, (n, k)))
        if (self.codes.dtype, tuple(self.codes.shape)) != want or not self.codes.is_contiguous():
            raise ValueError(f"{self.layout} codes must be contiguous {want[0]} {want[1]}, got "
                             f"{self.codes.dtype} {tuple(self.codes.shape)}")
        for name in ("scales", "offsets"):
            t = getattr(self, name)
            if t.dtype != torch.float32 or tuple(t.shape) != (n, k // g) or not t.is_contiguous():
                raise ValueError(f"{name} must be contiguous float32 {(n, k // g)}, got {t.dtype} {tuple(t.shape)}")

    @functools.cached_property
    def has_offsets(self) -> bool:
        """False where every offset is 0 (Q8_0, Q6_K): the int8 kernel then skips the offset term and its reads."""
        return bool(self.offsets.any())

    def interleave(self) -> QuantWeight:
        """This weight in the layout this CPU runs fastest: interleaved by 16 output features on AVX512-VNNI
        (q4, and q8 in groups of 16 or 32, where the shape fits), else itself. Only one copy of the codes
        is kept: the float32 paths (``dequantize``, float32 activations) restore the plain layout per call.

        q4x16: block b (features 16 b ..) of group g is 256 bytes, four parts of 64; in part i, bytes
        4 r .. 4 r + 3 hold feature 16 b + r's codes of inputs 32 g + 8 i + j (j < 4) in their low nibbles
        and of 32 g + 8 i + 4 + j in their high nibbles. q8x16: block b is K / 4 vectors of 64 bytes, one
        per 4 inputs, bytes 4 r .. 4 r + 3 feature 16 b + r's codes + 128. Scales and offsets: [N / 16,
        groups, 16] (a block's 16 features together per group)."""
        n, k = self.out_features, self.in_features
        if (self.layout not in INTERLEAVED or n % 16 or k % 32 or vnni() != "avx512-vnni"
                or (self.layout == "q8" and self.group not in (16, 32))):
            return self
        nb, groups = n // 16, k // self.group
        if self.layout == "q4":
            c = self.codes.view(nb, 16, k // 32, 16)  # byte i of a group: weight i | weight i + 16 << 4
            q = torch.cat([c & 15, c >> 4], dim=-1).view(nb, 16, k // 32, 4, 2, 4)  # [b, r, g, part, half, j]
            codes = (q[..., 0, :] | (q[..., 1, :] << 4)).permute(0, 2, 3, 1, 4)  # [b, g, part, r, j]
        else:
            codes = (self.codes.view(torch.uint8) ^ 0x80).view(nb, 16, k // 4, 4).permute(0, 2, 1, 3)  # [b, s, r, j]

        def by_block(t: torch.Tensor) -> torch.Tensor:
            return t.view(nb, 16, groups).permute(0, 2, 1).contiguous().view(n, groups)  # [b, g, r]
        return QuantWeight(INTERLEAVED[self.layout], codes.contiguous().view(self.codes.shape),
                           by_block(self.scales), by_block(self.offsets), self.group, n, k)

    def plain(self) -> QuantWeight:
        """This weight in the plain q4 / q8 layout (itself where it is one)."""
        if self.layout not in ("q4x16", "q8x16"):
            return self
        n, k = self.out_features, self.in_features
        nb, groups = n // 16, k // self.group
        if self.layout == "q4x16":
            p = self.codes.view(nb, k // 32, 4, 16, 4).permute(0, 3, 1, 2, 4)  # [b, r, g, part, j]
            q = torch.stack([p & 15, p >> 4], dim=-2).reshape(nb, 16, k // 32, 32)  # weights in order
            codes, layout = (q[..., :16] | (q[..., 16:] << 4)).reshape(n, k // 2), "q4"
        else:
            u = self.codes.view(nb, k // 4, 16, 4).permute(0, 2, 1, 3).reshape(n, k)
            codes, layout = (u ^ 0x80).view(torch.int8), "q8"

        def by_feature(t: torch.Tensor) -> torch.Tensor:
            return t.view(nb, groups, 16).permute(0, 2, 1).reshape(n, groups)
        return QuantWeight(layout, codes.contiguous(), by_feature(self.scales).contiguous(),
                           by_feature(self.offsets).contiguous(), self.group, n, k)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scales, self.offsets))

    @staticmethod
    def concat(parts: list[QuantWeight]) -> QuantWeight:
        """Stack plain weights of one layout and group along the output features (fused q/k/v, gate/up)."""
        first = parts[0]
        if any((p.layout, p.group, p.in_features) != (first.layout, first.group, first.in_features) for p in parts):
            raise ValueError("only weights of one layout, group and input size can be stacked")
        if first.layout not in INTERLEAVED:
            raise ValueError(f"interleaved ({first.layout}) weights cannot be stacked: stack the plain ones")
        return QuantWeight(first.layout, torch.cat([p.codes for p in parts]), torch.cat([p.scales for p in parts]),
                           torch.cat([p.offsets for p in parts]), first.group,
                           sum(p.out_features for p in parts), first.in_features)


def linear(x: torch.Tensor, w: QuantWeight, bias: torch.Tensor | None = None, *,
           activations: str | None = None) -> torch.Tensor:
    """x [m, in] float32 @ w^T (+ bias) -> a new [m, out] float32.

    ``activations``: one of ACTIVATIONS (the int8 ones raise a ValueError where ``int8_fits`` is false),
    or None for DEFAULT_ACTIVATIONS where it fits and x has at most INT8_MAX_ROWS rows (INTERLEAVED_INT8_MAX_ROWS
    on the interleaved layout), else float32."""
    if x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] != w.in_features:
        raise ValueError(f"x must be float32 [m, {w.in_features}], got {x.dtype} {tuple(x.shape)}")
    x = x.contiguous()
    m = x.shape[0]
    y = torch.empty(m, w.out_features)
    if m == 0:
        return y
    b = None if bias is None else bias.data_ptr()
    if activations is not None and activations not in ACTIVATIONS:
        raise ValueError(f"activations must be one of {', '.join(ACTIVATIONS)}, got {activations!r}")
    fits = int8_fits(w)
    if activations not in (None, "float32") and not fits:
        raise ValueError(f"no int8-activation kernel here for {w.layout} groups of {w.group} (VNNI: {vnni()})")
    if activations is None:
        activations = DEFAULT_ACTIVATIONS if m <= int8_max_rows(w) else "float32"
    threads = torch.get_num_threads()
    if activations != "float32":
        vl, passes = _vnni_library(), ACTIVATIONS[activations]
        if vl is None:  # int8_fits said the VNNI kernels run here
            raise RuntimeError(f"no VNNI kernel library for {activations} activations")
        offsets = w.offsets.data_ptr() if w.has_offsets else None
        args = (w.codes.data_ptr(), w.scales.data_ptr(), offsets, b, y.data_ptr(), w.out_features, passes, threads)
        if w.layout == "q4x16":
            rc = vl.rl_q4x16_linear_i8(x.data_ptr(), m, w.in_features, *args)
        elif w.layout == "q8x16":
            rc = vl.rl_q8x16_linear_i8(x.data_ptr(), m, w.in_features, w.group, *args)
        elif w.layout == "q4":
            rc = vl.rl_q4_linear_i8(x.data_ptr(), m, w.in_features, *args)
        else:
            rc = vl.rl_q8_linear_i8(x.data_ptr(), m, w.in_features, w.group, *args)
        if rc == 0:
            return y
    w = w.plain()  # the float32 kernels read the plain layouts
    lib = _load()
    if w.layout == "q4":
        lib.rl_q4_linear(x.data_ptr(), m, w.in_features, w.codes.data_ptr(), w.scales.data_ptr(),
                         w.offsets.data_ptr(), b, y.data_ptr(), w.out_features, threads)
    else:
        lib.rl_q8_linear(x.data_ptr(), m, w.in_features, w.group, w.codes.data_ptr(), w.scales.data_ptr(),
                         w.offsets.data_ptr(), b, y.data_ptr(), w.out_features, threads)
    return y


def dequantize(w: QuantWeight) -> torch.Tensor:
    """The float32 weight [out, in] (each element code * scale + offset, rounded once)."""
    w = w.plain()
    out = torch.empty(w.out_features, w.in_features)
    lib, threads = _load(), torch.get_num_threads()
    if w.layout == "q4":
        lib.rl_q4_dequantize(w.codes.data_ptr(), w.scales.data_ptr(), w.offsets.data_ptr(), out.data_ptr(),
                             w.out_features, w.in_features, threads)
    else:
        lib.rl_q8_dequantize(w.codes.data_ptr(), w.group, w.scales.data_ptr(), w.offsets.data_ptr(),
                             out.data_ptr(), w.out_features, w.in_features, threads)
    return out


class QuantMoE:
    """A layer's quantized SwiGLU experts for csrc/quant_vnni.c's rl_quant_moe_i8: the sort, gather, SiLU and
    weighted sum in C and every expert on the int8-activation kernels, in one call. ``build`` gives None where
    that kernel does not take these weights here (no VNNI, the experts' layouts or groups differ)."""

    def __init__(self, lib: ctypes.CDLL, w13: list[QuantWeight], w2: list[QuantWeight]) -> None:
        self.lib = lib  # the int8-activation library
        self.w13, self.w2 = w13, w2  # held: the tables below point into their tensors
        self.hidden, self.inter = w2[0].out_features, w2[0].in_features
        self.max_rows = min(int8_max_rows(w13[0]), int8_max_rows(w2[0]))
        self.table13, self.table2 = _addresses(w13), _addresses(w2)

    @classmethod
    def build(cls, w13: list[QuantWeight], w2: list[QuantWeight]) -> QuantMoE | None:
        same = all((w.layout, w.group) == (ws[0].layout, ws[0].group) for ws in (w13, w2) for w in ws)
        lib = _vnni_library()
        if lib is None or not same or not int8_fits(w13[0]) or not int8_fits(w2[0]):
            return None
        return cls(lib, w13, w2)

    def __call__(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor | None:
        """sum_j weights[:, j] * expert_{ids[:, j]}(x) for x [n, hidden] float32, weights [n, k] float32, ids
        [n, k] int64 in range (the router's; not checked) -> [n, hidden], or None (nothing run) where an expert
        holds more than ``max_rows`` rows: the caller's per-expert path runs those (the float32 kernels)."""
        n, k = ids.shape
        pairs = n * k
        x, weights, ids = x.contiguous(), weights.float().contiguous(), ids.contiguous()
        out = torch.empty(n, self.hidden)
        scratch = torch.empty(pairs * (2 * self.hidden + 3 * self.inter))
        index = torch.empty(2 * pairs + len(self.w13) + 1, dtype=torch.int64)
        w13, w2 = self.w13[0], self.w2[0]
        rc = self.lib.rl_quant_moe_i8(x.data_ptr(), ids.data_ptr(), weights.data_ptr(), n, k, self.hidden, self.inter,
                                len(self.w13), LAYOUTS.index(w13.layout), w13.group, self.table13.data_ptr(),
                                LAYOUTS.index(w2.layout), w2.group, self.table2.data_ptr(), self.max_rows,
                                ACTIVATIONS[DEFAULT_ACTIVATIONS], scratch.data_ptr(), index.data_ptr(),
                                out.data_ptr(), torch.get_num_threads())
        if rc < 0:
            raise RuntimeError(f"the int8 kernels declined {w13.layout} / {w2.layout} experts they were built for")
        return out if rc == 0 else None


def _addresses(ws: list[QuantWeight]) -> torch.Tensor:
    """int64 [E, 3]: each weight's codes, scales and offsets addresses (0 where its offsets are all 0)."""
    return torch.tensor([[w.codes.data_ptr(), w.scales.data_ptr(), w.offsets.data_ptr() if w.has_offsets else 0]
                         for w in ws], dtype=torch.int64)
