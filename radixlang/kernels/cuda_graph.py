"""CUDA-graph capture and replay of decode steps.

What the model runner provides:

* ``model_forward(input_ids, positions, forward_batch) -> Tensor`` whose output's
  first axis is the batch (hidden states [bs, hidden] or logits [bs, vocab]). In
  DECODE mode it must be capturable: no host syncs, no shapes that depend on
  tensor values, no ``.item()``/``.tolist()``; it reaches attention only through
  ``forward_batch.attn_backend.forward(q, k, v, layer, forward_batch)``.
* ``build_forward_batch(inputs: DecodeGraphInputs) -> ForwardBatch``: a DECODE
  forward batch that uses the tensors of ``inputs`` as they are (no copies:
  the captured kernels read those addresses), i.e. ``forward_mode=DECODE,
  batch_size=len(inputs.seq_lens_cpu), input_ids=inputs.input_ids,
  positions=inputs.positions, req_pool_indices=inputs.req_pool_indices,
  seq_lens=inputs.seq_lens, seq_lens_cpu=inputs.seq_lens_cpu,
  extend_prefix_lens_cpu=[s - 1 for s in seq_lens_cpu], extend_seq_lens_cpu=[1] * bs,
  out_cache_loc=inputs.out_cache_loc``, plus the runner's ``req_to_token``,
  ``token_to_kv_pool`` and ``attn_backend`` (the same objects every step).
* an attention backend with CUDA-graph support (``GraphAttnBackend``: the
  triton and flashinfer backends; the torch reference is not capturable).

The runner captures one graph per size in ``capture_sizes`` (largest first,
sharing one memory pool). ``replay`` copies the real batch into the static
buffers, pads it to the next captured size with dummy requests (KV slot
``pad_slot``, the pool's reserved slot 0; ``seq_len`` 1; request row
``pad_req_index``, only read), refreshes the backend's metadata in place and
replays; the output rows of the padding are dropped. For a replayed step the
model runner calls ``runner.replay(fb.input_ids, fb.positions, fb)`` *instead of*
``attn_backend.init_forward_metadata(fb)`` + ``model_forward``; extend steps and
batches above ``max_bs`` stay eager (``runner.can_run(bs)``).
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Callable, Protocol, Sequence, runtime_checkable

import torch

from radixlang.kernels.attention.base import ForwardBatchLike


@runtime_checkable
class GraphAttnBackend(Protocol):
    def init_cuda_graph_state(self, max_bs: int, max_context_len: int) -> None: ...
    def init_forward_metadata_cuda_graph(self, forward_batch: ForwardBatchLike) -> None: ...


@dataclass(eq=False, kw_only=True)
class DecodeGraphInputs:
    input_ids: torch.Tensor  # [bs] int64, a view of the static buffer
    positions: torch.Tensor  # [bs] int64
    req_pool_indices: torch.Tensor  # [bs] int64
    seq_lens: torch.Tensor  # [bs] int64
    out_cache_loc: torch.Tensor  # [bs] int64
    seq_lens_cpu: list[int]


def default_capture_sizes(max_bs: int) -> list[int]:
    sizes = [s for s in (1, 2, 4, 8) if s <= max_bs] + list(range(16, max_bs + 1, 8))
    if not sizes or sizes[-1] != max_bs:
        sizes.append(max_bs)
    return sizes


class CudaGraphRunner:
    def __init__(self, model_forward: Callable[[torch.Tensor, torch.Tensor, ForwardBatchLike], torch.Tensor],
                 build_forward_batch: Callable[[DecodeGraphInputs], ForwardBatchLike],
                 attn_backend: object, *, max_bs: int, max_context_len: int,
                 capture_sizes: Sequence[int] | None = None, device: str | torch.device = "cuda",
                 pad_slot: int = 0, pad_req_index: int = 0, num_warmups: int = 2) -> None:
        if not isinstance(attn_backend, GraphAttnBackend):
            raise ValueError(f"CUDA graphs need an attention backend with init_cuda_graph_state and "
                             f"init_forward_metadata_cuda_graph (triton, flashinfer), "
                             f"got {type(attn_backend).__name__}")
        sizes = sorted(set(default_capture_sizes(max_bs) if capture_sizes is None else capture_sizes))
        if not sizes or sizes[0] < 1 or sizes[-1] > max_bs:
            raise ValueError(f"capture_sizes must be non-empty and within [1, max_bs={max_bs}], got {list(sizes)}")
        self.model_forward = model_forward
        self.build_forward_batch = build_forward_batch
        self.attn_backend = attn_backend
        self.capture_sizes = sizes
        self.max_bs = sizes[-1]
        self.max_context_len = max_context_len
        self.device = torch.device(device)
        self.pad_slot, self.pad_req_index = pad_slot, pad_req_index
        self.num_warmups = num_warmups
        zeros = lambda: torch.zeros(self.max_bs, dtype=torch.int64, device=self.device)  # noqa: E731
        self.input_ids, self.positions, self.req_pool_indices = zeros(), zeros(), zeros()
        self.seq_lens, self.out_cache_loc = zeros(), zeros()
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self._pool = None

    def can_run(self, batch_size: int) -> bool:
        return bool(self.graphs) and 1 <= batch_size <= self.max_bs

    def _inputs(self, bs: int, seq_lens_cpu: list[int]) -> DecodeGraphInputs:
        return DecodeGraphInputs(input_ids=self.input_ids[:bs], positions=self.positions[:bs],
                                 req_pool_indices=self.req_pool_indices[:bs], seq_lens=self.seq_lens[:bs],
                                 out_cache_loc=self.out_cache_loc[:bs], seq_lens_cpu=seq_lens_cpu)

    def _pad(self, start: int, end: int) -> None:
        if start >= end:
            return
        self.input_ids[start:end] = 0
        self.positions[start:end] = 0
        self.req_pool_indices[start:end] = self.pad_req_index
        self.seq_lens[start:end] = 1
        self.out_cache_loc[start:end] = self.pad_slot

    def capture(self) -> None:
        """Capture every size; the padding requests only write the dummy KV slot."""
        self.attn_backend.init_cuda_graph_state(self.max_bs, self.max_context_len)
        self._pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(device=self.device)
        with torch.inference_mode():
            for bs in reversed(self.capture_sizes):
                self._pad(0, bs)
                fb = self.build_forward_batch(self._inputs(bs, [1] * bs))
                self.attn_backend.init_forward_metadata_cuda_graph(fb)
                stream.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(stream):
                    for _ in range(self.num_warmups):  # compiles kernels, settles allocator state
                        self.model_forward(self.input_ids[:bs], self.positions[:bs], fb)
                torch.cuda.current_stream(self.device).wait_stream(stream)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self._pool, stream=stream):
                    out = self.model_forward(self.input_ids[:bs], self.positions[:bs], fb)
                self.graphs[bs], self.outputs[bs] = graph, out
        torch.cuda.synchronize(self.device)

    def replay(self, input_ids: torch.Tensor, positions: torch.Tensor,
               forward_batch: ForwardBatchLike) -> torch.Tensor:
        """Run a DECODE batch through the smallest captured graph that fits; returns [bs, ...]."""
        bs = forward_batch.batch_size
        if not forward_batch.forward_mode.is_decode() or not self.can_run(bs):
            raise ValueError(f"replay needs a captured DECODE batch of 1..{self.max_bs} requests, got "
                             f"{forward_batch.forward_mode.name} with {bs}")
        graph_bs = self.capture_sizes[bisect.bisect_left(self.capture_sizes, bs)]
        self.input_ids[:bs].copy_(input_ids)
        self.positions[:bs].copy_(positions)
        self.req_pool_indices[:bs].copy_(forward_batch.req_pool_indices)
        self.seq_lens[:bs].copy_(forward_batch.seq_lens)
        self.out_cache_loc[:bs].copy_(forward_batch.out_cache_loc)
        self._pad(bs, graph_bs)
        seq_lens_cpu = list(forward_batch.seq_lens_cpu) + [1] * (graph_bs - bs)
        static_fb = self.build_forward_batch(self._inputs(graph_bs, seq_lens_cpu))
        self.attn_backend.init_forward_metadata_cuda_graph(static_fb)
        self.graphs[graph_bs].replay()
        return self.outputs[graph_bs][:bs]
