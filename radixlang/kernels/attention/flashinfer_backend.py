"""FlashInfer attention backend (CUDA, float16/bfloat16).

EXTEND: the new tokens attend to each other causally through
``BatchPrefillWithRaggedKVCacheWrapper`` (k/v straight from the step's
tensors) and to the cached prefix through ``BatchPrefillWithPagedKVCacheWrapper``
(non-causal: every prefix token precedes every new one); the two partial
results are combined with ``flashinfer.merge_state``. A step where no request
has a prefix runs only the ragged kernel. DECODE: ``BatchDecodeWithPagedKVCacheWrapper``. By default the
ragged wrapper runs fa3 on Hopper and the paged ones fa2 (``pick_wrapper_backends``).

Every wrapper is planned once per step in ``init_forward_metadata`` from the
metadata's host-side indptrs (no device-to-host sync) and run by every layer; all
wrappers, the CUDA-graph decode ones included, share one float workspace buffer. The KV pool is
token-granular, i.e. pages of one token in FlashInfer's NHD layout:
``[size + 1, num_kv_heads, head_dim]`` viewed as ``[size + 1, 1, num_kv_heads, head_dim]``.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from radixlang.kernels.attention.base import AttentionBackend, AttentionLayerLike, ForwardBatchLike
from radixlang.kernels.attention.metadata import AttentionMetadata, build_attention_metadata

_PAGE_SIZE = 1


def import_flashinfer():
    try:
        import flashinfer
    except ImportError as e:
        raise ImportError("the flashinfer attention backend needs FlashInfer and a CUDA GPU: "
                          "pip install 'radixlang[cuda]' (package flashinfer-python, built for your "
                          f"torch and CUDA versions); import failed with: {e}") from e
    return flashinfer


FLASHINFER_BACKENDS = ("auto", "fa2", "fa3")


class WrapperBackends(NamedTuple):
    """The FlashInfer kernel family ("fa2" / "fa3") each wrapper is built with."""
    ragged: str  # the new tokens against each other (BatchPrefillWithRaggedKVCacheWrapper)
    paged_prefix: str  # the new tokens against the cached prefix: the radix-cache-hit path
    decode: str


def pick_wrapper_backends(name: str, capability: tuple[int, int]) -> WrapperBackends:
    """Each wrapper's kernels for ``--flashinfer-backend`` ``name`` on a GPU of compute ``capability``.

    "auto" does what SGLang does: the ragged prefill on fa3 on Hopper (sm90), fa2 elsewhere; the paged
    prefix prefill and decode on fa2 everywhere, because FlashInfer's fa3 paged prefill runs slower
    than fa2 on Hopper (FlashInfer issue #2400; docs/serving.md). "fa2" / "fa3" put both prefill
    wrappers on that family (fa3 needs sm90). Decode is always fa2."""
    if name not in FLASHINFER_BACKENDS:
        raise ValueError(f"flashinfer backend must be one of {', '.join(FLASHINFER_BACKENDS)}, got {name!r}")
    if name != "auto":
        return WrapperBackends(ragged=name, paged_prefix=name, decode="fa2")
    return WrapperBackends(ragged="fa3" if capability[0] == 9 else "fa2", paged_prefix="fa2", decode="fa2")


def flashinfer_plan_args(metadata: AttentionMetadata, num_heads: int, num_kv_heads: int, head_dim: int,
                         page_size: int) -> dict:
    """Keyword plan() arguments of each FlashInfer wrapper (flashinfer-python 0.7's parameter names).

    Keys: "decode" (BatchDecodeWithPagedKVCacheWrapper.plan), "ragged"
    (BatchPrefillWithRaggedKVCacheWrapper.plan; the new tokens' kv rows coincide with their q rows)
    and "paged_prefix" (BatchPrefillWithPagedKVCacheWrapper.plan; None when no request has a cached
    prefix). Indptrs, last-page lengths and ``seq_lens`` are the metadata's host copies: the planner
    reads them on the host, so no device-to-host copy happens; only the page indices are on the device.
    ``seq_lens`` (the true KV length of every request, 0 for an empty prefix) makes the planner's
    lengths exact whatever it would derive from the pages.
    """
    if metadata.page_size != page_size:
        raise ValueError(f"metadata was built for page_size {metadata.page_size}, got page_size {page_size}")
    if num_kv_heads < 1 or num_heads % num_kv_heads:
        raise ValueError(f"num_heads must be a positive multiple of num_kv_heads, got {num_heads} and {num_kv_heads}")
    heads = {"num_qo_heads": num_heads, "num_kv_heads": num_kv_heads}
    has_prefix = any(n > 0 for n in metadata.extend_prefix_lens_cpu)
    return {
        "decode": {"indptr": metadata.kv_indptr_cpu, "indices": metadata.kv_indices,
                   "last_page_len": metadata.kv_last_page_len_cpu, **heads, "head_dim": head_dim,
                   "page_size": page_size, "seq_lens": metadata.seq_lens_cpu_i32},
        "ragged": {"qo_indptr": metadata.qo_indptr_cpu, "kv_indptr": metadata.qo_indptr_cpu, **heads,
                   "head_dim_qk": head_dim},
        "paged_prefix": None if not has_prefix else {
            "qo_indptr": metadata.qo_indptr_cpu, "paged_kv_indptr": metadata.prefix_kv_indptr_cpu,
            "paged_kv_indices": metadata.prefix_kv_indices,
            "paged_kv_last_page_len": metadata.prefix_kv_last_page_len_cpu, **heads, "head_dim_qk": head_dim,
            "page_size": page_size, "seq_lens": metadata.prefix_lens_cpu_i32},
    }


class FlashInferAttnBackend(AttentionBackend):
    """``flashinfer_backend`` picks the prefill kernels ("fa2", "fa3", or "auto": the ragged prefill on fa3 on
    sm90, the paged prefix prefill on fa2; see ``pick_wrapper_backends``); decode runs fa2's kernels. One
    workspace buffer is shared by every wrapper, eager and CUDA-graph ones alike: a step plans and runs only
    one decode wrapper, and extend steps are never captured."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int,
                 device: str | torch.device = "cuda", dtype: torch.dtype = torch.float16, *,
                 workspace_bytes: int = 128 << 20, sm_scale: float | None = None, flashinfer_backend: str = "auto",
                 **_: object) -> None:
        if dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(f"the flashinfer backend runs float16 or bfloat16, got {dtype}")
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads must be a multiple of num_kv_heads, got {num_heads} and {num_kv_heads}")
        self.flashinfer = import_flashinfer()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.device = torch.device(device)
        self.dtype = dtype
        self.sm_scale = head_dim ** -0.5 if sm_scale is None else sm_scale
        self.backends = pick_wrapper_backends(flashinfer_backend, torch.cuda.get_device_capability(self.device))
        self.workspace = torch.zeros(workspace_bytes, dtype=torch.uint8, device=self.device)
        self._use_tensor_cores = num_heads // num_kv_heads >= 4
        fi = self.flashinfer
        self.ragged = fi.BatchPrefillWithRaggedKVCacheWrapper(self.workspace, "NHD", backend=self.backends.ragged)
        self.paged_prefix = fi.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD",
                                                                   backend=self.backends.paged_prefix)
        self.decode = fi.BatchDecodeWithPagedKVCacheWrapper(self.workspace, "NHD", backend=self.backends.decode,
                                                            use_tensor_cores=self._use_tensor_cores)
        self._decode_wrapper = self.decode  # the eager one, or a CUDA-graph one per batch size
        self._graph_wrappers: dict[int, object] = {}
        self._graph_buffers: dict[str, torch.Tensor] | None = None
        self._extend_has_prefix = False
        self.metadata: AttentionMetadata | None = None

    def _dtypes(self) -> dict:
        return {"q_data_type": self.dtype, "kv_data_type": self.dtype, "sm_scale": self.sm_scale}

    def _plan_decode(self, wrapper: object, md: AttentionMetadata) -> None:
        args = flashinfer_plan_args(md, self.num_heads, self.num_kv_heads, self.head_dim, _PAGE_SIZE)["decode"]
        wrapper.plan(**args, **self._dtypes())

    def init_forward_metadata(self, forward_batch: ForwardBatchLike) -> None:
        is_decode = forward_batch.forward_mode.is_decode()
        md = build_attention_metadata(
            forward_batch.req_to_token, forward_batch.req_pool_indices, forward_batch.seq_lens_cpu,
            None if is_decode else forward_batch.extend_prefix_lens_cpu,
            None if is_decode else forward_batch.extend_seq_lens_cpu)
        self.metadata = md
        if is_decode:
            self._decode_wrapper = self.decode
            self._plan_decode(self.decode, md)
            return
        args = flashinfer_plan_args(md, self.num_heads, self.num_kv_heads, self.head_dim, _PAGE_SIZE)
        self.ragged.plan(**args["ragged"], causal=True, **self._dtypes())
        self._extend_has_prefix = args["paged_prefix"] is not None
        if self._extend_has_prefix:
            self.paged_prefix.plan(**args["paged_prefix"], causal=False, **self._dtypes())

    # ---- CUDA graph support (decode only) ----
    def init_cuda_graph_state(self, max_bs: int, max_context_len: int) -> None:
        self._graph_buffers = {
            "indptr": torch.zeros(max_bs + 1, dtype=torch.int32, device=self.device),
            "indices": torch.zeros(max_bs * max_context_len, dtype=torch.int32, device=self.device),
            "last_page_len": torch.ones(max_bs, dtype=torch.int32, device=self.device),
        }

    def init_forward_metadata_cuda_graph(self, forward_batch: ForwardBatchLike) -> None:
        """Plan the CUDA-graph decode wrapper of this batch size (one per size, all on the shared workspace
        and static index buffers; plan() copies the step's indices into them, so replays read new ones)."""
        if self._graph_buffers is None:
            raise RuntimeError("call init_cuda_graph_state before init_forward_metadata_cuda_graph")
        if not forward_batch.forward_mode.is_decode():
            raise ValueError("only decode steps are captured as CUDA graphs")
        bs = forward_batch.batch_size
        wrapper = self._graph_wrappers.get(bs)
        if wrapper is None:
            buf = self._graph_buffers
            wrapper = self.flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                self.workspace, "NHD", use_cuda_graph=True, use_tensor_cores=self._use_tensor_cores,
                backend=self.backends.decode,
                paged_kv_indptr_buffer=buf["indptr"][:bs + 1], paged_kv_indices_buffer=buf["indices"],
                paged_kv_last_page_len_buffer=buf["last_page_len"][:bs])
            self._graph_wrappers[bs] = wrapper
        md = build_attention_metadata(forward_batch.req_to_token, forward_batch.req_pool_indices,
                                      forward_batch.seq_lens_cpu)
        self.metadata = md
        self._plan_decode(wrapper, md)
        self._decode_wrapper = wrapper

    # ---- forward ----
    def _kv_cache(self, forward_batch: ForwardBatchLike, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        pool = forward_batch.token_to_kv_pool
        # [size + 1, num_kv_heads, head_dim] -> [num_pages, page_size=1, num_kv_heads, head_dim]
        return pool.get_key_buffer(layer_id).unsqueeze(1), pool.get_value_buffer(layer_id).unsqueeze(1)

    def _check_layer(self, layer: AttentionLayerLike) -> None:
        if abs(layer.scaling - self.sm_scale) >= 1e-6:
            raise ValueError(f"the flashinfer plan uses sm_scale {self.sm_scale}, layer {layer.layer_id} wants "
                             f"{layer.scaling}; pass sm_scale= to the backend")

    def forward_extend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       layer: AttentionLayerLike, forward_batch: ForwardBatchLike) -> torch.Tensor:
        self._check_layer(layer)
        forward_batch.token_to_kv_pool.set_kv_buffer(layer.layer_id, forward_batch.out_cache_loc, k, v)
        q = q.contiguous()  # [num_tokens, num_heads, head_dim]
        k, v = k.to(self.dtype).contiguous(), v.to(self.dtype).contiguous()  # [num_tokens, num_kv_heads, head_dim]
        if not self._extend_has_prefix:
            return self.ragged.run(q, k, v)
        out_new, lse_new = self.ragged.run(q, k, v, return_lse=True)  # lse [num_tokens, num_heads] fp32
        out_prefix, lse_prefix = self.paged_prefix.run(q, self._kv_cache(forward_batch, layer.layer_id),
                                                       return_lse=True)
        out, _ = self.flashinfer.merge_state(out_new, lse_new, out_prefix, lse_prefix)
        return out

    def forward_decode(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       layer: AttentionLayerLike, forward_batch: ForwardBatchLike) -> torch.Tensor:
        self._check_layer(layer)
        forward_batch.token_to_kv_pool.set_kv_buffer(layer.layer_id, forward_batch.out_cache_loc, k, v)
        return self._decode_wrapper.run(q.contiguous(), self._kv_cache(forward_batch, layer.layer_id))
