"""The torch backend against a plain attention written out by hand, on a real paged pool."""
from __future__ import annotations

import pytest
import torch

from radixlang.kernels import cpu as cpu_ops
from radixlang.kernels.attention.base import ForwardMode
from radixlang.kernels.attention.cpu_backend import CpuAttnBackend
from radixlang.kernels.attention import torch_native
from radixlang.kernels.attention.torch_native import TorchNativeAttnBackend
from radixlang.runtime.model_executor.forward_batch import ForwardBatch
from radixlang.runtime.mem_cache.memory_pool import ReqToTokenPool, TokenToKVPool


class Layer:
    def __init__(self, heads: int, kv_heads: int, head_dim: int) -> None:
        self.layer_id, self.num_heads, self.num_kv_heads, self.head_dim = 0, heads, kv_heads, head_dim
        self.scaling = head_dim ** -0.5


def _reference(q, k, v, layer):  # q [t, h, d], k/v [s, kvh, d]; the query i sits at position s - t + i
    rep = layer.num_heads // layer.num_kv_heads
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    scores = torch.einsum("thd,shd->hts", q, k) * layer.scaling
    t, s = q.shape[0], k.shape[0]
    mask = torch.arange(s)[None, :] <= (torch.arange(t)[:, None] + s - t)
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.einsum("hts,shd->thd", scores.softmax(-1), v)


CASES = {
    "extend": (ForwardMode.EXTEND, [0, 5, 3], [7, 3, 1]),
    # a mixed batch: a fresh prompt, a jump-forward, and decodes riding along as one-token extends
    "mixed": (ForwardMode.EXTEND, [0, 5, 3, 8, 2], [7, 1, 4, 1, 1]),
    "one_token_extends": (ForwardMode.EXTEND, [0, 6, 2], [1, 1, 1]),
    "decode": (ForwardMode.DECODE, [4, 9, 1], [1, 1, 1]),
}

# requests whose rows begin with the same pool slots (a prefix the radix cache shares): the backend
# attends to the shared run once per group; (shared slots, members) per group
SHARED_CASES = {
    "decode_one_group": (ForwardMode.DECODE, [40, 45, 30, 50], [1, 1, 1, 1], [(24, [0, 1, 2, 3])]),
    "decode_groups_and_loner": (ForwardMode.DECODE, [40, 45, 30, 50, 9, 33], [1] * 6,
                                [(20, [0, 2]), (30, [1, 3, 5])]),
    # a partial run: members 1 and 2 share 28 slots with each other but only 18 with member 0
    "decode_partial_run": (ForwardMode.DECODE, [40, 45, 30], [1, 1, 1], [(18, [0, 1, 2]), (28, [1, 2])]),
    # extends after a shared prefix (few-shot questions), decodes riding along, a fresh prompt, a long extend
    "extend_shared": (ForwardMode.EXTEND, [40, 35, 30, 0, 20, 26, 41], [3, 1, 5, 7, 1, 70, 1],
                      [(25, [0, 1, 2, 5]), (18, [4, 6])]),
    # a shared run that is a member's whole cached prefix
    "extend_whole_prefix": (ForwardMode.EXTEND, [20, 20, 32], [4, 2, 1], [(20, [0, 1, 2])]),
}


@pytest.mark.parametrize("backend_name,flash,d", [("torch", True, 16), ("torch", False, 16), ("cpu", True, 16),
                                                  ("cpu", True, 64)],
                         ids=["flash_lse", "matmul", "cpu_decode_kernel", "cpu_kernels"])
@pytest.mark.parametrize("heads,kv_heads", [(4, 1), (4, 4), (6, 2)])
@pytest.mark.parametrize("case", list(CASES) + list(SHARED_CASES))
def test_matches_reference(heads, kv_heads, case, backend_name, flash, d, monkeypatch):
    # multi-token queries over a shared run merge two flash attentions by log-sum-exp; without that
    # kernel (or off the CPU) they take the single-softmax matmul path: both must be exact. The cpu
    # backend runs decodes on its compiled kernel (paged, no groups), and extends too when the head
    # size is a multiple of 64 (d=16: the torch backend's extend)
    if backend_name == "cpu" and not cpu_ops.available():
        pytest.skip(f"CPU kernels unavailable: {cpu_ops.unavailable_reason()}")
    if not flash:
        monkeypatch.setattr(torch_native, "_FLASH_LSE", None)
    torch.manual_seed(0)
    layer = Layer(heads, kv_heads, d)
    mode, prefix_lens, extend_lens, shared = CASES[case] + ([],) if case in CASES else SHARED_CASES[case]
    n = len(prefix_lens)
    pool = TokenToKVPool(1000, num_layers=1, num_kv_heads=kv_heads, head_dim=d, dtype=torch.float32, device="cpu")
    reqs = ReqToTokenPool(n + 1, 128, "cpu")
    # the shared runs: the same slots (and so the same k/v) at the start of every member's row
    common: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
    for length, members in shared:
        base = common.get(members[0])
        slots = pool.alloc(length)[torch.randperm(length)]
        k, v = torch.randn(length, kv_heads, d), torch.randn(length, kv_heads, d)
        if base is not None:  # a longer run inside an outer one: keep the outer part
            keep = base[0].shape[0]
            slots, k, v = (torch.cat([base[0], slots[keep:]]), torch.cat([base[1], k[keep:]]),
                           torch.cat([base[2], v[keep:]]))
        pool.set_kv_buffer(0, slots, k, v)
        for m in members:
            common[m] = (slots, k, v)
    full_k, full_v, locs = [], [], []
    for i, (p, e) in enumerate(zip(prefix_lens, extend_lens)):
        c_slots, c_k, c_v = common.get(i, (torch.zeros(0, dtype=torch.int64), torch.zeros(0, kv_heads, d),
                                           torch.zeros(0, kv_heads, d)))
        c = c_slots.shape[0]
        assert c <= p
        own = pool.alloc(p + e - c)[torch.randperm(p + e - c)]  # scattered slots: the pool is not contiguous
        slots = torch.cat([c_slots, own])
        reqs.req_to_token[i, :p + e] = slots.to(torch.int32)
        k = torch.cat([c_k, torch.randn(p + e - c, kv_heads, d)])
        v = torch.cat([c_v, torch.randn(p + e - c, kv_heads, d)])
        pool.set_kv_buffer(0, slots[c:p], k[c:p], v[c:p])
        full_k.append(k)
        full_v.append(v)
        locs.append(slots[p:])
    q = torch.randn(sum(extend_lens), heads, d)
    new_k = torch.cat([k[p:] for k, p in zip(full_k, prefix_lens)])
    new_v = torch.cat([v[p:] for v, p in zip(full_v, prefix_lens)])
    seq = [p + e for p, e in zip(prefix_lens, extend_lens)]
    backend = (TorchNativeAttnBackend if backend_name == "torch" else CpuAttnBackend)(heads, kv_heads, d)
    fb = ForwardBatch(forward_mode=mode, batch_size=n, input_ids=torch.zeros(len(q), dtype=torch.int64),
                      positions=torch.zeros(len(q), dtype=torch.int64), req_pool_indices=torch.arange(n),
                      seq_lens=torch.tensor(seq), seq_lens_cpu=seq, extend_prefix_lens_cpu=prefix_lens,
                      extend_seq_lens_cpu=extend_lens, out_cache_loc=torch.cat(locs),
                      req_to_token=reqs.req_to_token, token_to_kv_pool=pool, attn_backend=backend)
    backend.init_forward_metadata(fb)
    # the shared runs were found: each group attends to the run its members have in common
    runs = sorted((g.members, 0 if g.shared_loc is None else len(g.shared_loc)) for g in backend._groups)
    expect, seen = [], set()
    for length, members in shared:
        if not seen & set(members):  # a run nested in an earlier one is part of that group
            expect.append(([m for m in members if not (mode.is_extend() and extend_lens[m] > 64)], length))
        seen |= set(members)
    if backend_name == "torch" or (mode.is_extend() and not backend._extend_kernel):  # the kernels need no groups
        assert [r for r in runs if r[1]] == sorted(expect)
    out = backend.forward(q, new_k, new_v, layer, fb)
    start = 0
    for i, e in enumerate(extend_lens):
        ref = _reference(q[start:start + e], full_k[i], full_v[i], layer)
        assert torch.allclose(out[start:start + e], ref, atol=1e-5)
        start += e
