"""Quantized linear kernels (csrc/quant_ops.c) through ctypes: weight = code * scale + offset per group.

``QuantWeight`` holds one weight matrix in one of two layouts (see the C source): ``q4`` (two 4-bit codes a
byte, groups of 32) or ``q8`` (int8 codes, groups of 16 or 32), with float32 scales and offsets per group.
``linear`` multiplies float32 activations by it without forming the float32 weight; ``dequantize`` forms
it (the weight of a float32 GEMM over many rows). Built on first use like the other CPU kernels.

Two kernels do ``linear``: csrc/quant_ops.c decodes each weight to float32 and multiplies it by the float32
activations (the result is the dequantized matmul's up to the order of the sums), and csrc/quant_vnni.c,
on CPUs with AVX512-VNNI or AVX-VNNI, quantizes each activation row to int8 per group of 32 and takes
integer dot products of codes and activations (lossy by the activation rounding; see its header).
``linear(..., int8_activations=None)`` takes the int8 kernel where the CPU has it and the layout fits.
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
    "rl_q4_linear_i8": (_INT, [_P, _I64, _I64, _P, _P, _P, _P, _P, _I64, _INT]),
    "rl_q8_linear_i8": (_INT, [_P, _I64, _I64, _I64, _P, _P, _P, _P, _P, _I64, _INT]),
}
VNNI_LEVELS = {2: "avx512-vnni", 1: "avx-vnni"}
LAYOUTS = ("q4", "q8")


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
    return vnni() is not None and (w.layout == "q4" or 64 % w.group == 0 or w.group % 64 == 0)


def available() -> bool:
    return not isinstance(_library(), str)


def _load() -> ctypes.CDLL:
    lib = _library()
    if isinstance(lib, str):
        raise RuntimeError(f"radixlang quantized CPU kernels are unavailable: {lib}")
    return lib


@dataclass(frozen=True)
class QuantWeight:
    """One [out_features, in_features] weight: codes, and float32 scales / offsets [out, in / group]."""
    layout: str
    codes: torch.Tensor  # q4: uint8 [out, in / 2]; q8: int8 [out, in]
    scales: torch.Tensor
    offsets: torch.Tensor
    group: int
    out_features: int
    in_features: int

    def __post_init__(self) -> None:
        n, k, g = self.out_features, self.in_features, self.group
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {self.layout!r}")
        if g % 16 or k % g or (self.layout == "q4" and g != 32):
            raise ValueError(f"group {g} does not fit layout {self.layout} with {k} input features")
        want = (torch.uint8, (n, k // 2)) if self.layout == "q4" else (torch.int8, (n, k))
        if (self.codes.dtype, tuple(self.codes.shape)) != want or not self.codes.is_contiguous():
            raise ValueError(f"{self.layout} codes must be contiguous {want[0]} {want[1]}, got "
                             f"{self.codes.dtype} {tuple(self.codes.shape)}")
        for name in ("scales", "offsets"):
            t = getattr(self, name)
            if t.dtype != torch.float32 or tuple(t.shape) != (n, k // g) or not t.is_contiguous():
                raise ValueError(f"{name} must be contiguous float32 {(n, k // g)}, got {t.dtype} {tuple(t.shape)}")

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scales, self.offsets))

    @staticmethod
    def concat(parts: list[QuantWeight]) -> QuantWeight:
        """Stack weights of one layout and group along the output features (fused q/k/v, gate/up)."""
        first = parts[0]
        if any((p.layout, p.group, p.in_features) != (first.layout, first.group, first.in_features) for p in parts):
            raise ValueError("only weights of one layout, group and input size can be stacked")
        return QuantWeight(first.layout, torch.cat([p.codes for p in parts]), torch.cat([p.scales for p in parts]),
                           torch.cat([p.offsets for p in parts]), first.group,
                           sum(p.out_features for p in parts), first.in_features)


def linear(x: torch.Tensor, w: QuantWeight, bias: torch.Tensor | None = None, *,
           int8_activations: bool | None = None) -> torch.Tensor:
    """x [m, in] float32 @ w^T (+ bias) -> a new [m, out] float32.

    ``int8_activations``: True runs the int8-activation kernel (a ValueError where ``int8_fits`` is
    false), False the float32 one, None the int8 one where it fits."""
    if x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] != w.in_features:
        raise ValueError(f"x must be float32 [m, {w.in_features}], got {x.dtype} {tuple(x.shape)}")
    x = x.contiguous()
    m = x.shape[0]
    y = torch.empty(m, w.out_features)
    if m == 0:
        return y
    b = None if bias is None else bias.data_ptr()
    fits = int8_fits(w)
    if int8_activations and not fits:
        raise ValueError(f"no int8-activation kernel here for {w.layout} groups of {w.group} (VNNI: {vnni()})")
    threads = torch.get_num_threads()
    if fits and int8_activations is not False:
        vl = _vnni_library()
        assert vl is not None
        if w.layout == "q4":
            rc = vl.rl_q4_linear_i8(x.data_ptr(), m, w.in_features, w.codes.data_ptr(), w.scales.data_ptr(),
                                    w.offsets.data_ptr(), b, y.data_ptr(), w.out_features, threads)
        else:
            rc = vl.rl_q8_linear_i8(x.data_ptr(), m, w.in_features, w.group, w.codes.data_ptr(),
                                    w.scales.data_ptr(), w.offsets.data_ptr(), b, y.data_ptr(), w.out_features, threads)
        if rc == 0:
            return y
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
    out = torch.empty(w.out_features, w.in_features)
    lib, threads = _load(), torch.get_num_threads()
    if w.layout == "q4":
        lib.rl_q4_dequantize(w.codes.data_ptr(), w.scales.data_ptr(), w.offsets.data_ptr(), out.data_ptr(),
                             w.out_features, w.in_features, threads)
    else:
        lib.rl_q8_dequantize(w.codes.data_ptr(), w.group, w.scales.data_ptr(), w.offsets.data_ptr(),
                             out.data_ptr(), w.out_features, w.in_features, threads)
    return out
