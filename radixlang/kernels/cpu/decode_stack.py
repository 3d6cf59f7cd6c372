"""A whole decode step over quantized or float32 weights in one C call (csrc/decode_stack.c), through ctypes.

The library links decode_stack.c with cpu_ops.c, quant_ops.c and quant_vnni.c, and runs their kernels
layer after layer as the Python layers would call them (see the C header for the order). ``Layer`` and
``Step`` mirror the C structs; ``QWeight.of`` describes a ``QuantWeight``, ``QWeight.of_float`` a
row-major float32 weight (run by cpu_ops.c's small-row ``rl_linear``). The C code trusts every
pointer and size: the caller (runtime/model_executor/decode_stack.py) checks the step's shapes, dtypes and index
ranges before ``run``.
"""
from __future__ import annotations

import ctypes
import functools
import logging

import torch

from radixlang.kernels.cpu import quant as qk
from radixlang.kernels.cpu.build import (DECODE_STACK_SOURCE, QUANT_SOURCE, QUANT_VNNI_SOURCE, SOURCE, BuildError,
                                         load_library)

logger = logging.getLogger(__name__)

_P, _I64, _D = ctypes.c_void_p, ctypes.c_int64, ctypes.c_double
FLOAT32_LAYOUT = len(qk.LAYOUTS)  # after the quantized layouts: a float32 weight (decode_stack.c: qlin)


class QWeight(ctypes.Structure):
    _fields_ = [("layout", _I64), ("group", _I64), ("out", _I64), ("in_", _I64), ("has_offsets", _I64),
                ("int8_rows", _I64), ("codes", _P), ("scales", _P), ("offsets", _P), ("bias", _P)]

    @staticmethod
    def of(w: qk.QuantWeight, bias: torch.Tensor | None) -> QWeight:
        if bias is not None and (bias.dtype != torch.float32 or bias.shape != (w.out_features,)
                                 or not bias.is_contiguous()):
            raise ValueError(f"bias must be contiguous float32 [{w.out_features}]")
        return QWeight(qk.LAYOUTS.index(w.layout), w.group, w.out_features, w.in_features, w.has_offsets,
                       qk.int8_max_rows(w), w.codes.data_ptr(), w.scales.data_ptr(), w.offsets.data_ptr(),
                       None if bias is None else bias.data_ptr())

    @staticmethod
    def of_float(weight: torch.Tensor, bias: torch.Tensor | None) -> QWeight:
        n, k = weight.shape
        if weight.dtype != torch.float32 or weight.dim() != 2 or not weight.is_contiguous():
            raise ValueError(f"a float32 weight must be contiguous float32 [out, in], got {weight.dtype} "
                             f"{tuple(weight.shape)}")
        if bias is not None and (bias.dtype != torch.float32 or bias.shape != (n,) or not bias.is_contiguous()):
            raise ValueError(f"bias must be contiguous float32 [{n}]")
        return QWeight(FLOAT32_LAYOUT, 0, n, k, 0, 0, weight.data_ptr(), None, None,
                       None if bias is None else bias.data_ptr())


class Layer(ctypes.Structure):
    _fields_ = [("ln1", _P), ("ln2", _P), ("q_norm", _P), ("k_norm", _P), ("qkv", QWeight), ("o", QWeight),
                ("gate_up", QWeight), ("down", QWeight), ("k_buf", _P), ("v_buf", _P), ("window", _I64),
                ("swa", _I64)]


class Step(ctypes.Structure):
    _fields_ = [(name, _I64) for name in ("m", "hidden", "heads", "kv_heads", "head_dim", "passes", "nthreads",
                                          "r2t_stride", "bs")] + \
               [("eps", _D), ("qk_eps", _D), ("scale", _D)] + \
               [(name, _P) for name in ("pos", "loc", "req_idx", "seq_lens", "q_start", "prefix_lens",
                                        "extend_lens", "req_to_token", "cos", "ssin", "x", "residual", "qkv",
                                        "attn", "h", "gu", "act")] + \
               [("swa_r2t_stride", _I64), ("swa_loc", _P), ("swa_req_idx", _P), ("swa_req_to_token", _P)]


@functools.cache
def _library() -> ctypes.CDLL | str:
    try:
        return load_library({"rl_decode_stack": (ctypes.c_int, [_P, _I64, _P])}, DECODE_STACK_SOURCE,
                            (SOURCE, QUANT_SOURCE, QUANT_VNNI_SOURCE))
    except (BuildError, OSError, AttributeError) as e:
        logger.warning("radixlang's fused decode step is unavailable (the layers run one op at a time): %s", e)
        return str(e)


def available() -> bool:
    return not isinstance(_library(), str)


def run(layers: ctypes.Array, step: Step) -> None:
    """Run the step's layers (an array of Layer). The caller has checked what ``Step`` points at."""
    lib = _library()
    if isinstance(lib, str):
        raise RuntimeError(f"the fused decode step is unavailable: {lib}")
    if lib.rl_decode_stack(ctypes.addressof(layers), len(layers), ctypes.byref(step)) != 0:
        raise MemoryError("the fused decode step could not allocate its buffers")
