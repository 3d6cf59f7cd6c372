"""Linear layers whose weights are pre-packed in oneDNN's blocked layout (the CPU default).

``F.linear`` on a plain ``[out, in]`` weight leaves the CPU matmul library to re-read the weight
in a layout it was not made for on every call. oneDNN can reorder the weight once into its
blocked layout; its matmul then runs larger tiles for batches and reads the weight faster for a
decode's few rows. Measured on a 2-core AVX-512 VM over SmolLM2-135M's 30 layers
of linears: float32 at 1 row 20 ms against 40 ms for ``F.linear``, at 32 rows 48 ms against
87 ms, at 600 rows 0.69 s against 0.97 s; bfloat16 at 1 row 14.5 ms against 25.6 ms.

The packed weight is opaque (an mkldnn-layout tensor): only its matmul can read it. So packing
runs once, after the weights are loaded, as the linears' weight method (layers/weight_methods.py:
``PackedMethod``, chosen before loading); with tied embeddings the logits projection gets its own
packed copy (the embedding lookup keeps the plain table), which costs vocab x hidden more weight
memory and halves the logits matmul. The ops are PyTorch's own (the ones its compiler's CPU
freezing pass uses); where they are missing the linears keep the plain float method.

At a few rows oneDNN's matmul still reads the weights at only about half the memory
bandwidth. With radixlang's CPU kernels on (the default), float32 layers also keep their row-major
weight, at the cost of holding both copies (+425 MB for SmolLM2 in float32; the tied logits read the
embedding table itself), and run steps of up to ``SMALL_ROWS`` rows on whichever of three matmuls is
fastest on this CPU: radixlang's streaming C kernel, PyTorch's own ``F.linear`` on the row-major
weight, or the packed one. Which wins depends on the CPU: over SmolLM2's linears on an AMD EPYC (Zen 4)
the C kernel was 1.6x faster than packed at 1 row and ``F.linear`` 2x slower; over a 0.5B-class model's
on an Intel Xeon, ``F.linear`` took 15.5 ms, packed 21.5 and the C kernel 24 at 1 row. So
``calibrate_small_rows_`` times the three once per process on the model's own weights (streamed: at
least CALIBRATE_BYTES of them) for each row count, and a layer runs the fastest; the C kernel stays
where nothing beats it by 15%. ``--disable-cpu-kernels`` keeps only the packed copy.
"""
from __future__ import annotations

import logging
import time

import torch
import torch.nn.functional as F
from torch import nn

from radixlang.kernels import cpu as cpu_ops

logger = logging.getLogger(__name__)

# the batch size oneDNN is told to expect when it picks a blocking; measured: a hint of 32 is as fast
# as a hint of 1 at one row and up to 2x faster from 2 rows on (float32)
PACK_ROWS_HINT = 32
PACKABLE_DTYPES = (torch.float32, torch.bfloat16)
# oneDNN compiles and caches kernels per row count: ~0.25 MB each here, ~490 MB once 500 distinct
# row counts had gone through four layer shapes (measured), and a server's memory grew with every
# new prompt length. So a matmul runs in slices of at most CHUNK_ROWS rows, and a slice of more than
# EXACT_ROWS rows is padded up to one of 8 sizes per power of two (at most 1/8 more rows): 56 row
# counts in all, compiled once per weight shape when the model is packed (``warm_up``).
EXACT_ROWS = 32
CHUNK_ROWS = 256
# up to this many rows (a decode step of one to four requests), a linear that kept its row-major
# weight runs radixlang's streaming C kernel instead (kernels/cpu): measured over SmolLM2's linears
# at 1 row 21 ms against 34 ms packed, 2-3 rows 18-24 against 31-40, 4 rows 30-32 against 32-33;
# from 5 rows on packed is as fast or faster. Whole decode runs on SmolLM2 (48 tokens, 300-token
# prompts): batch 2 1.4x faster, batches 3 and 4 the same within noise
SMALL_ROWS = 4
# the matmuls a step of at most SMALL_ROWS rows can run on (see the module docstring)
SMALL_ROW_KERNELS = ("c", "aten", "packed")
# calibration streams at least this many weight bytes per timing (past the caches), and is skipped for a
# model whose float32 linears hold less (there the choice hardly matters, and tests stay deterministic)
CALIBRATE_BYTES = 256 << 20
CALIBRATE_MIN_BYTES = 64 << 20
# another matmul replaces the C kernel only when it is at least this much faster (timings are noisy)
CALIBRATE_MARGIN = 0.85


# PackedLinear.warm_up compiles the row counts up to this at load (decode steps); the larger ones compile on
# their first prefill, which costs less than running them all at every start (docs/cpu.md, "Packed weights")
WARM_ROWS = 16


def bucket_rows(m: int) -> int:
    """The row count a slice of m <= CHUNK_ROWS rows runs at: m itself up to EXACT_ROWS, then rounded
    up to a multiple of 2^(bit_length(m) - 4)."""
    if m <= EXACT_ROWS:
        return m
    step = 1 << (m.bit_length() - 4)
    return -(-m // step) * step


def row_counts() -> list[int]:
    """Every row count a packed matmul runs at."""
    return sorted({bucket_rows(m) for m in range(1, CHUNK_ROWS + 1)})


def packing_available(dtype: torch.dtype = torch.float32) -> bool:
    """Whether oneDNN can pack a ``dtype`` weight on this CPU. bfloat16 packing needs AVX-512 BW/VL/DQ
    or AVX-NE-CONVERT; without them (an AVX2-only CPU) oneDNN refuses it and bfloat16 linears stay plain."""
    return dtype in _packable_dtypes()


_PACKABLE: tuple[torch.dtype, ...] | None = None


def _packable_dtypes() -> tuple[torch.dtype, ...]:
    global _PACKABLE
    if _PACKABLE is None:
        _PACKABLE = tuple(d for d in PACKABLE_DTYPES if _can_pack(d))
    return _PACKABLE


def _can_pack(dtype: torch.dtype) -> bool:
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(torch.ones(16, 16, dtype=dtype), PACK_ROWS_HINT)
        y = torch.ops.mkldnn._linear_pointwise(torch.ones(1, 16, dtype=dtype), packed, None, "none", [], "")
    except (AttributeError, RuntimeError):
        return False
    return bool((y.float() == 16).all())


class PackedLinear(nn.Module):
    """y = x W^T + b with W held in oneDNN's blocked layout; same numbers as nn.Linear to float rounding."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, *, keep_plain: bool = False) -> None:
        """``keep_plain``: also keep the row-major float32 weight (the same storage, no copy) for the C
        kernel that runs matmuls of at most SMALL_ROWS rows; the packed copy then adds to memory."""
        super().__init__()
        if weight.device.type != "cpu" or weight.dtype not in PACKABLE_DTYPES:
            raise ValueError(f"PackedLinear takes a float32 or bfloat16 CPU weight, got {weight.dtype} "
                             f"on {weight.device}")
        if not packing_available(weight.dtype):
            raise ValueError(f"oneDNN cannot pack a {weight.dtype} weight on this CPU")
        self.out_features, self.in_features = weight.shape
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), PACK_ROWS_HINT)
        self.bias = None if bias is None else bias.detach().clone()
        self.dtype = weight.dtype
        # not a buffer: state_dict and parameters() stay what they were
        self.plain = (weight.detach().contiguous() if keep_plain and weight.dtype == torch.float32
                      and cpu_ops.available() else None)
        if self.bias is not None and self.plain is not None:
            self.bias = self.bias.contiguous()
        # the matmul of a step of m <= SMALL_ROWS rows, at index m (calibrate_small_rows_ may change it)
        self.small_kernels: list[str] = ["c"] * (SMALL_ROWS + 1)

    @classmethod
    def from_linear(cls, linear: nn.Linear, *, keep_plain: bool = False) -> PackedLinear:
        return cls(linear.weight, linear.bias, keep_plain=keep_plain)

    def weight_bytes(self) -> int:
        return self.out_features * self.in_features * torch.empty(0, dtype=self.dtype).element_size()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features).contiguous()
        m = x2.shape[0]
        if self.plain is not None and m <= SMALL_ROWS and x2.dtype == torch.float32:
            y = self._small(x2, self.small_kernels[m])
        elif m <= CHUNK_ROWS:
            y = self._matmul(x2)
        else:
            y = torch.cat([self._matmul(x2[i:i + CHUNK_ROWS]) for i in range(0, m, CHUNK_ROWS)])
        return y.view(*lead, self.out_features)

    def _small(self, x2: torch.Tensor, kernel: str) -> torch.Tensor:
        """A step of at most SMALL_ROWS float32 rows on one of SMALL_ROW_KERNELS (needs the row-major weight)."""
        assert self.plain is not None
        if kernel == "c":
            return cpu_ops.linear(x2, self.plain, self.bias, check=False)
        if kernel == "aten":
            return F.linear(x2, self.plain, self.bias)
        return self._matmul(x2)

    def _matmul(self, x2: torch.Tensor) -> torch.Tensor:
        m = x2.shape[0]
        rows = bucket_rows(m)
        if rows != m:
            x2 = torch.cat([x2, x2.new_zeros(rows - m, self.in_features)])
        y = torch.ops.mkldnn._linear_pointwise(x2, self.packed, self.bias, "none", [], "")
        return y if rows == m else y[:m]

    def warm_up(self) -> None:
        """Run the decode-sized row counts (up to WARM_ROWS) once, so that oneDNN compiles this weight shape's
        kernels for them now. Larger row counts compile on their first prefill: a few milliseconds there,
        where running all of them here cost seconds of every start."""
        with torch.inference_mode():
            for rows in (m for m in row_counts() if m <= WARM_ROWS):
                self._matmul(torch.zeros(rows, self.in_features, dtype=self.dtype))

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, dtype={self.dtype}, packed"


def pick_small_row_kernels(times: dict[int, dict[str, float]]) -> list[str]:
    """From seconds per row count and kernel, the kernel each row count runs: the fastest, unless the C
    kernel is within CALIBRATE_MARGIN of it (then the C kernel). Index m of the list is m rows."""
    picks = ["c"] * (SMALL_ROWS + 1)
    for m, by_kernel in times.items():
        fastest = min(by_kernel, key=by_kernel.__getitem__)
        if by_kernel[fastest] < CALIBRATE_MARGIN * by_kernel["c"]:
            picks[m] = fastest
    return picks


def calibrate_small_rows_(kernels: list[PackedLinear], *, min_bytes: int | None = None,
                          stream_bytes: int | None = None, repeats: int = 3) -> list[str] | None:
    """Time SMALL_ROW_KERNELS on a model's float32 PackedLinears that kept their row-major weight, for 1 to
    SMALL_ROWS rows, and set every such layer to the fastest per row count (``pick_small_row_kernels``).

    Each timing runs one step over layers holding at least ``stream_bytes`` of weights (all of them in a
    smaller model), so the weights come from memory as in a decode step, not from the caches; the kernels
    take turns, best of ``repeats``. Skipped (returns None) where the layers hold less than ``min_bytes``
    or the C kernels are off (default: CALIBRATE_MIN_BYTES, CALIBRATE_BYTES). Returns the picks, index m for
    m rows."""
    min_bytes = CALIBRATE_MIN_BYTES if min_bytes is None else min_bytes
    stream_bytes = CALIBRATE_BYTES if stream_bytes is None else stream_bytes
    layers = [m for m in kernels if m.plain is not None]
    total = sum(m.weight_bytes() for m in layers)
    if not layers or total < min_bytes:
        return None
    sample, size = [], 0
    for layer in layers:
        sample.append(layer)
        size += layer.weight_bytes()
        if size >= stream_bytes:
            break
    times: dict[int, dict[str, float]] = {}
    with torch.inference_mode():
        for rows in range(1, SMALL_ROWS + 1):
            xs = {k: torch.randn(rows, k) for k in {layer.in_features for layer in sample}}
            best = dict.fromkeys(SMALL_ROW_KERNELS, float("inf"))
            for _ in range(repeats):
                for kernel in SMALL_ROW_KERNELS:
                    t = time.perf_counter()
                    for layer in sample:
                        layer._small(xs[layer.in_features], kernel)
                    best[kernel] = min(best[kernel], time.perf_counter() - t)
            times[rows] = best
    picks = pick_small_row_kernels(times)
    for layer in layers:
        layer.small_kernels = picks
    logger.info("small-row linears over %d MB of weights: %s", size >> 20, "; ".join(
        f"{rows} row(s) {picks[rows]} (" + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in by.items()) + ")"
        for rows, by in times.items()))
    return picks
