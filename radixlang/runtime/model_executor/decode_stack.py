"""A decode step of a quantized (or float32) Llama-family model in one compiled call (kernels/cpu/decode_stack.py).

A batch-1 decode step of the embedded SmolLM2 GGUF spent ~10 ms per token, of which the q4/q8 matmuls
took ~6: the rest was the ~10 small ops per layer crossing from Python into their kernels (views,
checks, allocations, ctypes) and the attention backend's bookkeeping, 30 times. ``DecodeStack`` runs
the same kernels from C instead, every layer in one call: the embeddings and the final norm stay in
Python, and so does every step it does not take (prefill, more than ``KERNEL_MAX_ROWS`` rows, a
backend other than the CPU kernels'), which the layers run as before.

It applies where every layer is the plain Llama layer (optionally with Qwen3's q/k norms, q/k/v biases
and a sliding window per layer: the layer classes that declare ``fused_decode``, models/llama.py) on
quantized weights (each linear's ``kernel_weight``, read through its weight method:
models/layers/linear.py), with the compiled norms and rotary, and no
soft-capping or sinks: Llama, SmolLM, Mistral, Qwen2, Qwen3 served from a quantized GGUF or with
``--quantization int4``; and on float32 PackedLinears with their row-major copy (the default
float32 CPU path) for the 1-4 row steps whose small-row matmul is the C kernel (``float32_rows``: the
step calls that kernel; where calibration picked another, those steps run layer by layer). ``build`` says
why not otherwise (logged once at load). The runner owns the stack and offers it every step before the
model's own forward (model_runner.run_step); the model only declares which of its layers the step computes.
"""
from __future__ import annotations

import logging
from typing import Any

import torch

from radixlang.kernels.attention.cpu_backend import CpuAttnBackend
from radixlang.kernels.cpu import decode_stack as ds
from radixlang.kernels.cpu import quant as qk
from radixlang.runtime.models.gguf_blocks import KERNEL_MAX_ROWS
from radixlang.runtime.models.layers.norm import RMSNorm
from radixlang.runtime.models.packed import SMALL_ROWS

logger = logging.getLogger(__name__)


def why_not(model: Any) -> str | None:
    """None where the fused step can serve ``model``, else the first reason it cannot."""
    if not ds.available():
        return "its library did not build here"
    if model.tp is not None:
        return "tensor parallelism"
    if not model.cpu_kernels or model.num_rope_tables != 1:
        return "the compiled norms and rotary are off, or layers use several rotary tables"
    shapes, scales, qk_norms, kinds = set(), set(), set(), set()
    for i, layer in enumerate(model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        if not layer.fused_decode:
            return f"layer {i} is not the plain Llama layer ({type(layer).__name__})"
        if attn.logit_softcap or attn.sinks is not None:
            return f"layer {i} has soft-capping or sinks"
        if not mlp.fused:
            return f"layer {i}'s MLP activation is {mlp.act_name}, not silu"
        norms = [layer.input_layernorm, layer.post_attention_layernorm]
        if attn.qk_norm:
            norms += [attn.q_norm, attn.k_norm]
        if any(type(n) is not RMSNorm or not n.fused for n in norms):
            return f"layer {i}'s norms are not the compiled RMSNorm"
        weights = [lin.kernel_weight() for lin in _linears(layer)]
        found = {None if w is None else w.kind for w in weights}
        kinds.add(found.pop() if len(found) == 1 and None not in found else
                  f"layer {i} has linears that are not quantized or packed float32 with a row-major copy "
                  f"({', '.join(str(None if w is None else w.kind) for w in weights)})")
        shapes.add((attn.num_heads, attn.num_kv_heads, attn.head_dim))
        scales.add(attn.scaling)
        qk_norms.add(attn.qk_norm)
    if not shapes:
        return "the model has no layers"
    for kind in kinds:
        if kind not in ("quantized", "float32"):
            return kind
    if len(kinds) != 1:
        return "some layers are quantized and some float32"
    if kinds == {"float32"} and not float32_rows(model):
        return "the float32 linears' small-row kernel is not the C one for any row count (calibrated faster)"
    if len(shapes) != 1 or len(scales) != 1 or len(qk_norms) != 1:
        return "the layers differ in heads, head size, scaling or q/k norms"
    heads, kv_heads, _ = next(iter(shapes))
    if heads % kv_heads:
        return "query heads are not a multiple of kv heads"
    return None


def _linears(layer: Any) -> tuple[Any, Any, Any, Any]:
    attn, mlp = layer.self_attn, layer.mlp
    return attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj


def float32_rows(model: Any) -> set[int]:
    """The row counts a float32 model's fused step takes: those whose small-row matmul is the C kernel
    (``rl_linear``, which the step calls) for every linear of every layer (packed.calibrate_small_rows_)."""
    rows = set(range(1, SMALL_ROWS + 1))
    for layer in model.layers:
        for lin in _linears(layer):
            rows &= lin.kernel_weight().c_rows
    return rows


class DecodeStack:
    def __init__(self, model: Any) -> None:
        self.model = model
        attn = model.layers[0].self_attn
        self.heads, self.kv_heads, self.head_dim = attn.num_heads, attn.num_kv_heads, attn.head_dim
        self.hidden = model.config.hidden_size
        self.scale = attn.scaling
        self.qk_eps = attn.q_norm.eps if attn.qk_norm else 0.0
        self.eps = model.layers[0].input_layernorm.eps
        self._pool: Any = None  # the KV pool _layers points into (its buffers are made once, with it)
        self._layers: Any = None
        self._scratch: dict[int, tuple[torch.Tensor, ...]] = {}
        self.float32 = model.layers[0].self_attn.qkv_proj.kernel_weight().kind == "float32"
        # rows a step may have: up to KERNEL_MAX_ROWS on quantized weights; on float32 ones, the row counts
        # whose small-row matmul is the C kernel (more rows are the packed oneDNN matmul's)
        self.rows = float32_rows(model) if self.float32 else set(range(1, KERNEL_MAX_ROWS + 1))

    @classmethod
    def build(cls, model: Any) -> DecodeStack | None:
        reason = why_not(model)
        if reason is not None:
            logger.info("decode steps run layer by layer (the fused decode step does not apply: %s)", reason)
            return None
        stack = cls(model)
        logger.info("decode steps of %s rows run as one compiled call over the %s layers",
                    ", ".join(map(str, sorted(stack.rows))) if stack.float32 else f"up to {KERNEL_MAX_ROWS}",
                    "float32" if stack.float32 else "quantized")
        return stack

    def _layer_array(self, pool: Any) -> Any:
        """The C layer structs for this KV pool (made on its first step)."""
        if pool is self._pool:
            return self._layers
        bufs = [(pool.get_key_buffer(i), pool.get_value_buffer(i)) for i in range(len(self.model.layers))]
        want = (self.kv_heads, self.head_dim)
        for k, v in bufs:
            for t in (k, v):
                if t.dtype != torch.float32 or t.dim() != 3 or tuple(t.shape[1:]) != want or not t.is_contiguous():
                    raise ValueError(f"the fused decode step needs a contiguous float32 KV pool [slots, {want[0]}, "
                                     f"{want[1]}] per layer, got {t.dtype} {tuple(t.shape)}")
        arr = (ds.Layer * len(bufs))()
        for i, (layer, (k, v)) in enumerate(zip(self.model.layers, bufs)):
            attn = layer.self_attn
            weights = [lin.kernel_weight() for lin in _linears(layer)]
            arr[i] = ds.Layer(layer.input_layernorm.weight.data_ptr(), layer.post_attention_layernorm.weight.data_ptr(),
                              attn.q_norm.weight.data_ptr() if attn.qk_norm else None,
                              attn.k_norm.weight.data_ptr() if attn.qk_norm else None,
                              *((ds.QWeight.of_float if self.float32 else ds.QWeight.of)(w.weight, w.bias)
                                for w in weights),
                              k.data_ptr(), v.data_ptr(), attn.sliding_window or 0, int(pool.is_swa_layer(i)))
        self._pool, self._layers = pool, arr
        return arr

    def _buffers(self, m: int) -> tuple[torch.Tensor, ...]:
        if m not in self._scratch:
            first = self.model.layers[0]
            qkv, inter = first.self_attn.qkv_proj.out_features, first.mlp.gate_up_proj.out_features // 2
            self._scratch[m] = (torch.empty(m, qkv), torch.empty(m, self.heads * self.head_dim),
                                torch.empty(m, self.hidden), torch.empty(m, 2 * inter), torch.empty(m, inter))
        return self._scratch[m]

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, forward_batch: Any) -> torch.Tensor | None:
        """The hidden states after the final norm, [m, hidden]; None where this step is not one it takes
        (a row count not in ``rows``, another attention backend, an extend the extend kernel does not
        take)."""
        m = input_ids.numel()
        backend = forward_batch.attn_backend
        if m not in self.rows or type(backend) is not CpuAttnBackend:
            return None
        if forward_batch.forward_mode.is_decode():
            (req_idx, seq_lens), extend = backend.decode_metadata(), None
        else:  # a few new tokens per request (a speculative verify, a short turn): the extend kernel
            extend = backend.extend_metadata()
            if extend is None:
                return None
            req_idx, seq_lens = extend[0], extend[3]  # seq_lens is read only by a decode step
        layers = self._layer_array(forward_batch.token_to_kv_pool)
        model = self.model
        rope = model._rotary(positions, 0, forward_batch)  # checks the positions against the table
        if rope.positions is not positions:  # prompt rows of a length-dependent rotary rule: layer by layer
            return None
        r2t, loc = forward_batch.req_to_token, forward_batch.out_cache_loc
        bs = req_idx.shape[0]
        if (positions.dtype != torch.int64 or positions.shape != (m,) or loc.dtype != torch.int64
                or loc.shape != (m,) or seq_lens.shape != (bs,) or (extend is None and bs != m)
                or (extend is not None and int(extend[3].sum()) != m)
                or r2t.dtype != torch.int32 or r2t.stride(1) != 1):
            raise ValueError("decode metadata: positions, out_cache_loc, req_pool_indices and seq_lens must be "
                             "int64 [batch] and req_to_token int32 rows")
        positions, loc = positions.contiguous(), loc.contiguous()
        # window layers in their own slot space read translated rows (the backend checked and built them)
        swa = backend.swa_metadata() or (r2t, req_idx, loc)
        x = model.embed_tokens(input_ids)
        if model.embed_scale is not None:
            x = x * model.embed_scale
        x = x.float().contiguous()
        residual = torch.empty_like(x)
        qkv, attn, h, gu, act = self._buffers(m)
        step = ds.Step(m, self.hidden, self.heads, self.kv_heads, self.head_dim,
                       qk.ACTIVATIONS[qk.DEFAULT_ACTIVATIONS], torch.get_num_threads(), r2t.stride(0),
                       0 if extend is None else bs, self.eps, self.qk_eps, self.scale,
                       positions.data_ptr(), loc.data_ptr(), req_idx.data_ptr(), seq_lens.data_ptr(),
                       *((None,) * 3 if extend is None else (t.data_ptr() for t in extend[1:])), r2t.data_ptr(),
                       rope.cos_cache.data_ptr(), rope.sin_cache.data_ptr(), x.data_ptr(), residual.data_ptr(),
                       qkv.data_ptr(), attn.data_ptr(), h.data_ptr(), gu.data_ptr(), act.data_ptr(),
                       swa[0].stride(0), swa[2].data_ptr(), swa[1].data_ptr(), swa[0].data_ptr())
        ds.run(layers, step)
        return model.norm.add_norm(x, residual)[0]
