"""CSR-style attention metadata shared by the Triton and FlashInfer backends.

One step's batch is described by index tensors in the layout FlashInfer calls
"page table in CSR form": request i's queries are rows
``qo_indptr[i]:qo_indptr[i+1]`` of q, and its KV pages are
``kv_indices[kv_indptr[i]:kv_indptr[i+1]]``, the last page holding
``kv_last_page_len[i]`` valid tokens. With ``page_size == 1`` (the pool is
token-granular) a page is a KV slot and kv_indices are slot indices.

For an EXTEND step the ``prefix_*`` variants describe only the tokens already
in the pool before this step: the "ragged new tokens + paged prefix" split,
where the new tokens' k/v are read straight from the step's k/v tensors and
the prefix through the pool.

The indptrs and last-page lengths are built on the host from the host-side lengths and kept
there too (``*_cpu``, int32): FlashInfer's planner reads them on the host, so passing the host
copies removes a device-to-host sync per wrapper and step. Their device copies (one host-to-device
copy each) and the gathered ``kv_indices`` are int32 on the device of ``req_to_token``.

An empty request (a request without a cached prefix, in the ``prefix_*`` variant) has 0 pages
and a last-page length of 0: FlashInfer's planner derives the KV length as
``max(num_pages - 1, 0) * page_size + last_page_len``, so any other value would plan a KV length
of 1 for it (and its FA3 kernels trust the plan).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(eq=False, kw_only=True)
class AttentionMetadata:
    batch_size: int
    page_size: int
    qo_indptr: torch.Tensor  # [bs + 1] int32
    kv_indptr: torch.Tensor  # [bs + 1] int32, in pages
    kv_indices: torch.Tensor  # [total_kv_pages] int32
    kv_last_page_len: torch.Tensor  # [bs] int32
    prefix_kv_indptr: torch.Tensor  # [bs + 1] int32, in pages
    prefix_kv_indices: torch.Tensor  # [total_prefix_pages] int32
    prefix_kv_last_page_len: torch.Tensor  # [bs] int32
    seq_lens_cpu: list[int]
    extend_prefix_lens_cpu: list[int]
    extend_seq_lens_cpu: list[int]
    # host copies, int32 (what FlashInfer's plan() reads)
    qo_indptr_cpu: torch.Tensor  # [bs + 1]
    kv_indptr_cpu: torch.Tensor  # [bs + 1]
    kv_last_page_len_cpu: torch.Tensor  # [bs]
    prefix_kv_indptr_cpu: torch.Tensor  # [bs + 1]
    prefix_kv_last_page_len_cpu: torch.Tensor  # [bs]
    seq_lens_cpu_i32: torch.Tensor  # [bs] KV length of each request after this step
    prefix_lens_cpu_i32: torch.Tensor  # [bs] KV length of each request's cached prefix

    @property
    def max_seq_len(self) -> int:
        return max(self.seq_lens_cpu, default=0)

    @property
    def max_extend_len(self) -> int:
        return max(self.extend_seq_lens_cpu, default=0)

    @property
    def num_tokens(self) -> int:
        return sum(self.extend_seq_lens_cpu)


def _as_list(x: torch.Tensor | list[int], name: str) -> list[int]:
    if isinstance(x, torch.Tensor):
        if x.dim() != 1:
            raise ValueError(f"{name} must be a 1-D tensor, got shape {tuple(x.shape)}")
        return [int(v) for v in x.tolist()]
    return [int(v) for v in x]


def _indptr(lens: list[int]) -> torch.Tensor:
    out = [0]
    for n in lens:
        out.append(out[-1] + n)
    return torch.tensor(out, dtype=torch.int32)  # host


def _num_pages(length: int, page_size: int) -> int:
    return (length + page_size - 1) // page_size


def _last_page_len(lens: list[int], page_size: int) -> torch.Tensor:
    # 1 <= last <= page_size for a non-empty request; 0 for an empty one (0 pages), so that FlashInfer's
    # host-side kv_len = max(num_pages - 1, 0) * page_size + last_page_len is 0 for it
    last = [0 if n == 0 else n - (_num_pages(n, page_size) - 1) * page_size for n in lens]
    return torch.tensor(last, dtype=torch.int32)  # host


def gather_kv_indices(req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, lens: list[int],
                      page_size: int = 1) -> torch.Tensor:
    """Pages of the first lens[i] tokens of each request, concatenated: [sum(num_pages)] int32.

    With page_size > 1 the pool must keep every page's tokens in one aligned
    page (slot // page_size is the page); the page of a request's j-th page is
    read from its first token.
    """
    device = req_to_token.device
    pages = [_num_pages(n, page_size) for n in lens]
    total = sum(pages)
    if total == 0:
        return torch.empty(0, dtype=torch.int32, device=device)
    counts = torch.tensor(pages, dtype=torch.int64, device=device)
    # output_size: the total is known on the host, so no device sync
    rows = torch.repeat_interleave(req_pool_indices.to(device=device, dtype=torch.int64), counts,
                                   output_size=total)
    starts = torch.repeat_interleave(torch.cumsum(counts, 0) - counts, counts, output_size=total)
    cols = (torch.arange(total, device=device) - starts) * page_size
    slots = req_to_token[rows, cols]  # [total] int32
    if page_size > 1:
        slots = torch.div(slots, page_size, rounding_mode="floor")
    return slots.to(torch.int32)


def build_attention_metadata(req_to_token: torch.Tensor, req_pool_indices: torch.Tensor,
                             seq_lens: torch.Tensor | list[int],
                             extend_prefix_lens: torch.Tensor | list[int] | None = None,
                             extend_seq_lens: torch.Tensor | list[int] | None = None,
                             page_size: int = 1) -> AttentionMetadata:
    """Build the CSR metadata of one step.

    req_to_token [max_reqs, max_context_len] int32; req_pool_indices [bs] int;
    seq_lens [bs]: tokens per request after this step (prefix + new).
    Without extend lengths the step is a decode: one new token per request.
    """
    if page_size < 1:
        raise ValueError(f"page_size must be >= 1, got {page_size}")
    seq = _as_list(seq_lens, "seq_lens")
    bs = len(seq)
    if req_pool_indices.shape != (bs,):
        raise ValueError(f"req_pool_indices must have shape ({bs},) like seq_lens, "
                         f"got {tuple(req_pool_indices.shape)}")
    if extend_seq_lens is None:
        ext = [1] * bs
    else:
        ext = _as_list(extend_seq_lens, "extend_seq_lens")
    if extend_prefix_lens is None:
        prefix = [s - e for s, e in zip(seq, ext)]
    else:
        prefix = _as_list(extend_prefix_lens, "extend_prefix_lens")
    if len(ext) != bs or len(prefix) != bs:
        raise ValueError(f"extend lengths must have {bs} entries like seq_lens, got {len(prefix)} prefix "
                         f"and {len(ext)} extend lengths")
    for i, (s, p, e) in enumerate(zip(seq, prefix, ext)):
        if p < 0 or e < 1 or p + e != s:
            raise ValueError(f"request {i}: expected prefix_len >= 0, extend_len >= 1 and "
                             f"prefix_len + extend_len == seq_len, got {p} + {e} vs {s}")
    if seq and max(seq) > req_to_token.shape[1]:
        raise ValueError(f"seq_len {max(seq)} exceeds req_to_token's max_context_len {req_to_token.shape[1]}")
    device = req_to_token.device
    host = {"qo_indptr": _indptr(ext), "kv_indptr": _indptr([_num_pages(s, page_size) for s in seq]),
            "kv_last_page_len": _last_page_len(seq, page_size),
            "prefix_kv_indptr": _indptr([_num_pages(p, page_size) for p in prefix]),
            "prefix_kv_last_page_len": _last_page_len(prefix, page_size)}
    on_device = {k: v.to(device, non_blocking=True) for k, v in host.items()}  # host-to-device only
    return AttentionMetadata(
        batch_size=bs, page_size=page_size, **on_device,
        kv_indices=gather_kv_indices(req_to_token, req_pool_indices, seq, page_size),
        prefix_kv_indices=gather_kv_indices(req_to_token, req_pool_indices, prefix, page_size),
        seq_lens_cpu=seq, extend_prefix_lens_cpu=prefix, extend_seq_lens_cpu=ext,
        **{f"{k}_cpu": v for k, v in host.items()},
        seq_lens_cpu_i32=torch.tensor(seq, dtype=torch.int32),
        prefix_lens_cpu_i32=torch.tensor(prefix, dtype=torch.int32))
