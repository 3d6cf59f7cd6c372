"""radixlang's compiled CPU kernels (csrc/cpu_ops.c), called through ctypes.

What they replace, and why: at a decode step a Llama layer runs a dozen small PyTorch ops besides
its four matmuls (two RMSNorms of several ATen ops each, the residual adds, rotary embedding, SiLU
and the multiply, the KV write), and on a CPU each op costs microseconds of dispatch plus a pass
over memory. Fused here, one loop does each step. Paged decode attention reads every request's
keys and values straight from the KV pool through ``req_to_token``, where the torch path first
gathers them into a padded copy and runs SDPA over it with a mask.

The library is compiled on first use (build.py) and links the ``libgomp.so.1`` PyTorch already
loaded, so its parallel loops share PyTorch's OpenMP threads. Every function takes float32 CPU
tensors; the wrappers check what the C code relies on (dtype, strides, sizes, index ranges) and
raise ValueError otherwise. Callers that checked once per step what every layer then passes (the
model, the cpu attention backend) call with ``check=False``: over every op of every layer, the
checks were a visible share of a decode step (docs/cpu.md). Where no compiler is available,
``available()`` is False and the model and the attention backend keep their torch ops.
"""
from __future__ import annotations

import ctypes
import dataclasses
import functools
import logging
from collections.abc import Sequence

import torch

from radixlang.kernels.cpu.build import MOE_SOURCE, BuildError, load_library

logger = logging.getLogger(__name__)

_P, _I64, _F, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
_SIGNATURES = {
    "rl_rms_norm": (None, [_P, _I64, _P, _P, _I64, _I64, _F, _INT]),
    "rl_add_rms_norm": (None, [_P, _P, _P, _I64, _I64, _F, _INT]),
    "rl_rope": (None, [_P, _I64, _I64, _I64, _I64, _P, _P, _P, _INT]),
    "rl_silu_mul": (None, [_P, _P, _I64, _I64, _INT]),
    "rl_store_kv": (None, [_P, _I64, _P, _I64, _P, _P, _P, _I64, _I64]),
    "rl_linear": (None, [_P, _P, _P, _P, _I64, _I64, _I64, _INT]),
    "rl_decode_attention": (_INT, [_P, _I64, _P, _P, _P, _I64, _P, _P, _P, _I64, _I64, _I64, _I64, _F,
                                   _I64, _F, _P, _INT]),
    "rl_extend_attention": (_INT, [_P, _I64, _P, _P, _P, _I64, _P, _P, _P, _P, _P, _I64, _I64, _I64, _I64, _F,
                                   _I64, _F, _P, _INT]),
    "rl_moe_experts": (None, [_P, _P, _P, _P, _P, _P, _P, _P, _I64, _I64, _I64, _I64, _I64, _INT]),  # csrc/moe.c
}


@functools.cache
def _library() -> ctypes.CDLL | str:
    """The loaded library, or why it could not be built or loaded; computed once per process (two
    threads racing here may both build: the build renames a finished file into place)."""
    try:
        return load_library(_SIGNATURES, extra=(MOE_SOURCE,))
    except (BuildError, OSError, AttributeError) as e:
        logger.warning("radixlang CPU kernels unavailable, using torch ops: %s", e)
        return str(e)


def _load() -> ctypes.CDLL:
    lib = _library()
    if isinstance(lib, str):
        raise RuntimeError(f"radixlang CPU kernels are unavailable: {lib}")
    return lib


def available() -> bool:
    """Whether the kernels are built and loaded (building them now if needed)."""
    return not isinstance(_library(), str)


def unavailable_reason() -> str | None:
    lib = _library()
    return lib if isinstance(lib, str) else None


def _f32(name: str, t: torch.Tensor, dims: int, *, contiguous: bool = False) -> None:
    """t must be a dims-D float32 CPU tensor with unit stride in its last dim (and wholly contiguous
    when ``contiguous``)."""
    if t.dtype != torch.float32 or t.device.type != "cpu" or t.dim() != dims:
        raise ValueError(f"{name} must be a {dims}-D float32 CPU tensor, got {t.dtype} {tuple(t.shape)} "
                         f"on {t.device}")
    if t.stride(-1) != 1:
        raise ValueError(f"{name} must have unit stride in its last dim, got strides {t.stride()}")
    if contiguous and not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous, got strides {t.stride()} for shape {tuple(t.shape)}")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, *, check: bool = True) -> torch.Tensor:
    """x [n, d] (rows may be strided) -> x / rms(x) * weight, a new contiguous [n, d]."""
    if check:
        _f32("x", x, 2)
        _f32("weight", weight, 1)
        if weight.shape[0] != x.shape[1]:
            raise ValueError(f"weight has {weight.shape[0]} features, x has {x.shape[1]}")
    n, d = x.shape
    out = torch.empty(n, d)
    _load().rl_rms_norm(x.data_ptr(), x.stride(0), weight.data_ptr(), out.data_ptr(), n, d, eps,
                        torch.get_num_threads())
    return out


def add_rms_norm_(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, *,
                  check: bool = True) -> None:
    """In place: residual += x, then x = rms_norm(residual) * weight. Both contiguous [n, d]."""
    if check:
        _f32("x", x, 2, contiguous=True)
        _f32("residual", residual, 2, contiguous=True)
        _f32("weight", weight, 1)
        if x.shape != residual.shape or weight.shape[0] != x.shape[1]:
            raise ValueError(f"shapes differ: x {tuple(x.shape)}, residual {tuple(residual.shape)}, "
                             f"weight {tuple(weight.shape)}")
    _load().rl_add_rms_norm(x.data_ptr(), residual.data_ptr(), weight.data_ptr(), x.shape[0], x.shape[1], eps,
                            torch.get_num_threads())


def rope_(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor, *,
          check: bool = True) -> None:
    """Rotate x [n, heads, d] in place (heads packed d apart, rows strided), HF's rotate_half layout.

    cos and signed_sin are the [max_pos, d] tables (sin with its first half negated); positions [n] int64.
    """
    n, heads, d = x.shape
    if check:
        _f32("x", x, 3)
        _f32("cos", cos, 2, contiguous=True)
        _f32("signed_sin", signed_sin, 2, contiguous=True)
        if x.stride(1) != d or d % 2 or cos.shape != signed_sin.shape or cos.shape[1] != d:
            raise ValueError(f"x {tuple(x.shape)} strides {x.stride()} does not fit tables {tuple(cos.shape)}")
        _indices("positions", positions, n, cos.shape[0])
    _load().rl_rope(x.data_ptr(), x.stride(0), n, heads, d, positions.data_ptr(), cos.data_ptr(),
                    signed_sin.data_ptr(), torch.get_num_threads())


def silu_mul(gate_up: torch.Tensor, *, check: bool = True) -> torch.Tensor:
    """gate_up [n, 2 * inter] (gate then up) -> silu(gate) * up, a new [n, inter]."""
    n, width = gate_up.shape
    if check:
        _f32("gate_up", gate_up, 2, contiguous=True)
        if width % 2:
            raise ValueError(f"gate_up must have an even width, got {width}")
    out = torch.empty(n, width // 2)
    _load().rl_silu_mul(gate_up.data_ptr(), out.data_ptr(), n, width // 2, torch.get_num_threads())
    return out


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
           check: bool = True) -> torch.Tensor:
    """x [m, k] @ weight[n, k]^T (+ bias) -> a new [m, n], for the few rows of a decode step: the weight is
    streamed once in its row-major layout. (Many rows are the packed oneDNN matmul's job.)"""
    m, k = x.shape
    n = weight.shape[0]
    if check:
        _f32("x", x, 2, contiguous=True)
        _f32("weight", weight, 2, contiguous=True)
        if weight.shape[1] != k:
            raise ValueError(f"x has {k} features, weight {tuple(weight.shape)} expects {weight.shape[1]}")
        if bias is not None:
            _f32("bias", bias, 1, contiguous=True)
            if bias.shape[0] != n:
                raise ValueError(f"bias has {bias.shape[0]} features, weight has {n} outputs")
    y = torch.empty(m, n)
    _load().rl_linear(x.data_ptr(), weight.data_ptr(), None if bias is None else bias.data_ptr(), y.data_ptr(),
                      m, n, k, torch.get_num_threads())
    return y


@dataclasses.dataclass(frozen=True, eq=False)
class PackedExperts:
    """SwiGLU experts in the panels csrc/moe.c reads (``moe_pack`` makes them): p13 [E, ip / 16, hidden, 32]
    (16 gate then the same 16 up features per input feature, ip = inter rounded up to 16, zeros past
    inter), p2 [E, hp / 32, inter, 32] (32 down features per input feature, hp = hidden rounded up to 32)."""
    p13: torch.Tensor
    p2: torch.Tensor
    num_experts: int
    hidden: int
    inter: int

    @property
    def scratch_per_pair(self) -> int:
        """csrc/moe.c's scratch floats per (token, choice) pair: its rows of x, act and y (padded widths)."""
        return self.hidden + self.p13.shape[1] * 16 + self.p2.shape[1] * 32


def moe_pack(w13: Sequence[torch.Tensor], w2: Sequence[torch.Tensor]) -> PackedExperts:
    """Each expert's float32 w13 [2 * inter, hidden] (gate rows, then up rows) and w2 [hidden, inter] (a
    stacked [E, ...] tensor is such a sequence) -> the panels ``moe_experts`` reads, a copy filled one expert
    at a time: the caller may drop the plain weights, and packing holds one expert's copy besides them."""
    if len(w13) != len(w2) or len(w13) == 0:
        raise ValueError(f"one w13 and one w2 per expert, got {len(w13)} and {len(w2)}")
    hidden, inter = w2[0].shape
    for e, (a, b) in enumerate(zip(w13, w2)):
        _f32(f"w13[{e}]", a, 2)
        _f32(f"w2[{e}]", b, 2)
        if a.shape != (2 * inter, hidden) or b.shape != (hidden, inter):
            raise ValueError(f"expert {e}: w13 {tuple(a.shape)} and w2 {tuple(b.shape)} do not fit hidden "
                             f"{hidden}, inter {inter} (w13 [{2 * inter}, {hidden}], w2 [{hidden}, {inter}])")
    ip, hp = -(-inter // 16) * 16, -(-hidden // 32) * 32
    p13 = torch.empty(len(w13), ip // 16, hidden, 32)
    p2 = torch.empty(len(w2), hp // 32, inter, 32)

    def padded(w: torch.Tensor, rows: int, width: int) -> torch.Tensor:  # [n, k] -> [rows / width, width, k]
        return torch.nn.functional.pad(w, (0, 0, 0, rows - w.shape[0])).view(rows // width, width, w.shape[1])

    for e, (a, b) in enumerate(zip(w13, w2)):
        gate, up = a.split(inter)
        p13[e, ..., :16].permute(0, 2, 1).copy_(padded(gate, ip, 16))
        p13[e, ..., 16:].permute(0, 2, 1).copy_(padded(up, ip, 16))
        p2[e].permute(0, 2, 1).copy_(padded(b, hp, 32))
    return PackedExperts(p13, p2, len(w13), hidden, inter)


# the most scratch floats one kernel call takes (64 MiB); a larger prefill runs in token chunks, each still
# hundreds of tokens (SmolMoE-sized experts, top-4: ~1,600), so the weights are read a few times at most
MOE_SCRATCH_FLOATS = 16 << 20


def moe_experts(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, packed: PackedExperts, *,
                check: bool = True) -> torch.Tensor:
    """sum_j weights[:, j] * expert_{ids[:, j]}(x) with SwiGLU experts (csrc/moe.c): every expert's weights
    read once for all the tokens (in chunks of tokens past MOE_SCRATCH_FLOATS of scratch). x [n, hidden];
    weights [n, k] float32; ids [n, k] int64 in [0, E); ``packed`` from ``moe_pack`` -> a new [n, hidden]."""
    n, hidden = x.shape
    k = ids.shape[1] if ids.dim() == 2 else 0
    if check:
        _f32("x", x, 2, contiguous=True)
        _f32("weights", weights, 2, contiguous=True)
        if hidden != packed.hidden:
            raise ValueError(f"x has {hidden} features, the experts take {packed.hidden}")
        if weights.shape != ids.shape or weights.shape[0] != n or not ids.is_contiguous():
            raise ValueError(f"weights {tuple(weights.shape)} and ids {tuple(ids.shape)} must both be [{n}, k] "
                             f"(ids contiguous)")
        _indices("ids", ids.view(-1), ids.numel(), packed.num_experts)
    chunk = max(1, min(n, MOE_SCRATCH_FLOATS // max(1, k * packed.scratch_per_pair)))
    out = torch.empty(n, hidden)
    scratch = torch.empty(chunk * k * packed.scratch_per_pair)  # one allocation for every chunk
    index = torch.empty(2 * chunk * k + packed.num_experts + 1, dtype=torch.int64)
    lib, threads = _load(), torch.get_num_threads()
    for t0 in range(0, n, chunk):
        m = min(chunk, n - t0)
        lib.rl_moe_experts(x[t0].data_ptr(), ids[t0].data_ptr(), weights[t0].data_ptr(), packed.p13.data_ptr(),
                           packed.p2.data_ptr(), out[t0].data_ptr(), scratch.data_ptr(), index.data_ptr(), m, k,
                           hidden, packed.inter, packed.num_experts, threads)
    return out


def store_kv(k: torch.Tensor, v: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, loc: torch.Tensor, *,
             check: bool = True) -> None:
    """k_buf[loc] = k; v_buf[loc] = v. k, v [n, heads, d] (rows may be strided, e.g. views into qkv);
    buffers [slots, heads, d] contiguous; loc [n] int64 slots inside the buffers."""
    n, heads, d = k.shape
    if check:
        _f32("k", k, 3)
        _f32("v", v, 3)
        _f32("k_buf", k_buf, 3, contiguous=True)
        _f32("v_buf", v_buf, 3, contiguous=True)
        if (v.shape != k.shape or k.stride(1) != d or v.stride(1) != d or k_buf.shape[1:] != (heads, d)
                or v_buf.shape != k_buf.shape):
            raise ValueError(f"k {tuple(k.shape)} {k.stride()}, v {tuple(v.shape)} {v.stride()} do not fit the "
                             f"buffers {tuple(k_buf.shape)}")
        _indices("loc", loc, n, k_buf.shape[0])
    _load().rl_store_kv(k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), k_buf.data_ptr(), v_buf.data_ptr(),
                        loc.data_ptr(), n, heads * d)


def _features(hq: int, window: int | None, softcap: float | None, sinks: torch.Tensor | None,
              check: bool) -> tuple[int, float, int | None]:
    """The optional attention features as the C kernels take them: (window or 0, softcap or 0, sinks' pointer)."""
    if check:
        if window is not None and window < 0 or softcap is not None and softcap < 0:
            raise ValueError(f"window and softcap must be positive, got {window} and {softcap}")
        if sinks is not None:
            _f32("sinks", sinks, 1, contiguous=True)
            if sinks.shape[0] != hq:
                raise ValueError(f"sinks must hold one logit per query head ({hq}), got {sinks.shape[0]}")
    return window or 0, softcap or 0.0, None if sinks is None else sinks.data_ptr()


def decode_attention(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, req_to_token: torch.Tensor,
                     req_pool_indices: torch.Tensor, seq_lens: torch.Tensor, scale: float, *,
                     window: int | None = None, softcap: float | None = None, sinks: torch.Tensor | None = None,
                     check: bool = True) -> torch.Tensor:
    """One query per request over its first seq_lens[b] KV slots -> [bs, hq, d].

    q [bs, hq, d] (rows may be strided); k_buf, v_buf [slots, hkv, d]; req_to_token [rows, cols] int32;
    req_pool_indices, seq_lens [bs] int64. The slots themselves are trusted (the pool wrote them).
    Optional, as transformers applies them: ``window`` (the query sees its last ``window`` keys),
    ``softcap`` (scores become softcap * tanh(score / softcap)), ``sinks`` ([hq] float32 logits that join
    each head's softmax denominator).
    """
    bs, hq, d = q.shape
    hkv = k_buf.shape[1]
    if check:
        _check_paged(q, k_buf, v_buf, req_to_token, hq % hkv == 0)
        _indices("req_pool_indices", req_pool_indices, bs, req_to_token.shape[0])
        _indices("seq_lens", seq_lens, bs, req_to_token.shape[1] + 1)
    feats = _features(hq, window, softcap, sinks, check)
    out = torch.empty(bs, hq, d)
    rc = _load().rl_decode_attention(q.data_ptr(), q.stride(0), k_buf.data_ptr(), v_buf.data_ptr(),
                                     req_to_token.data_ptr(), req_to_token.stride(0), req_pool_indices.data_ptr(),
                                     seq_lens.data_ptr(), out.data_ptr(), bs, hq, hkv, d, scale, *feats,
                                     torch.get_num_threads())
    if rc != 0:
        raise MemoryError("decode attention could not allocate its score buffer")
    return out


def extend_fits(head_dim: int, num_heads: int, num_kv_heads: int) -> bool:
    """Whether extend_attention takes these heads (the C kernel's register blocks are 64 dims wide)."""
    return head_dim % 64 == 0 and head_dim <= 256 and num_heads % num_kv_heads == 0


def extend_attention(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, req_to_token: torch.Tensor,
                     req_pool_indices: torch.Tensor, q_start: torch.Tensor, prefix_lens: torch.Tensor,
                     extend_lens: torch.Tensor, scale: float, *, window: int | None = None,
                     softcap: float | None = None, sinks: torch.Tensor | None = None,
                     check: bool = True) -> torch.Tensor:
    """Causal attention of each request's new tokens over its KV slots -> [tokens, hq, d].

    q [tokens, hq, d] (rows may be strided); request b's queries are rows q_start[b] ..
    q_start[b] + extend_lens[b] - 1, and query t sees the first prefix_lens[b] + t + 1 slots of its
    req_to_token row, its own new k/v included (write them to the pool first), the last ``window`` of
    them with a window. Index tensors: int64 [bs]. ``window``, ``softcap``, ``sinks``: as decode_attention.
    """
    tokens, hq, d = q.shape
    hkv = k_buf.shape[1]
    bs = len(req_pool_indices)
    if check:
        _check_paged(q, k_buf, v_buf, req_to_token, extend_fits(d, hq, hkv),
                     " (head_dim must be a multiple of 64, at most 256)")
        _indices("req_pool_indices", req_pool_indices, bs, req_to_token.shape[0])
        _indices("extend_lens", extend_lens, bs, tokens + 1)
        _indices("prefix_lens", prefix_lens, bs, req_to_token.shape[1])
        _indices("q_start", q_start, bs, max(tokens, 1))
        if bs and (int((q_start + extend_lens).max()) > tokens
                   or int((prefix_lens + extend_lens).max()) > req_to_token.shape[1]):
            raise ValueError("a request's queries or slots run past q or its req_to_token row")
    feats = _features(hq, window, softcap, sinks, check)
    out = torch.empty(tokens, hq, d)
    rc = _load().rl_extend_attention(q.data_ptr(), q.stride(0), k_buf.data_ptr(), v_buf.data_ptr(),
                                     req_to_token.data_ptr(), req_to_token.stride(0), req_pool_indices.data_ptr(),
                                     q_start.data_ptr(), prefix_lens.data_ptr(), extend_lens.data_ptr(),
                                     out.data_ptr(), bs, hq, hkv, d, scale, *feats, torch.get_num_threads())
    if rc != 0:
        raise MemoryError("extend attention could not allocate its buffers")
    return out


def _check_paged(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, req_to_token: torch.Tensor,
                 heads_fit: bool, why: str = "") -> None:
    """What both paged attention kernels read: q [tokens, hq, d] with packed heads, contiguous float32
    [slots, hkv, d] buffers, int32 req_to_token rows; ``heads_fit``: the kernel takes these head counts."""
    _f32("q", q, 3)
    _f32("k_buf", k_buf, 3, contiguous=True)
    _f32("v_buf", v_buf, 3, contiguous=True)
    d = q.shape[2]
    if q.stride(1) != d or k_buf.shape[2] != d or v_buf.shape != k_buf.shape or not heads_fit:
        raise ValueError(f"q {tuple(q.shape)} {q.stride()} does not fit the buffers {tuple(k_buf.shape)}{why}")
    if req_to_token.dtype != torch.int32 or req_to_token.dim() != 2 or req_to_token.stride(1) != 1:
        raise ValueError(f"req_to_token must be int32 [rows, cols] with unit column stride, got "
                         f"{req_to_token.dtype} {tuple(req_to_token.shape)}")


def _indices(name: str, t: torch.Tensor, n: int, bound: int) -> None:
    """t must be a contiguous int64 [n] with every value in [0, bound)."""
    if t.dtype != torch.int64 or t.shape != (n,) or not t.is_contiguous():
        raise ValueError(f"{name} must be a contiguous int64 [{n}], got {t.dtype} {tuple(t.shape)}")
    if n and (int(t.min()) < 0 or int(t.max()) >= bound):
        raise ValueError(f"{name} must lie in [0, {bound}), got {int(t.min())}..{int(t.max())}")
