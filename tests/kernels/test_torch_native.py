"""The torch backend against a plain attention written out by hand, on a real paged pool."""
from __future__ import annotations

import pytest
import torch

from radixlang.kernels.attention.base import ForwardMode
from radixlang.kernels.attention.torch_native import TorchNativeAttnBackend
from radixlang.runtime.forward_batch import ForwardBatch
from radixlang.runtime.memory_pool import ReqToTokenPool, TokenToKVPool


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


@pytest.mark.parametrize("heads,kv_heads", [(4, 1), (4, 4), (6, 2)])
@pytest.mark.parametrize("case", list(CASES))
def test_matches_reference(heads, kv_heads, case):
    torch.manual_seed(0)
    d = 16
    layer = Layer(heads, kv_heads, d)
    mode, prefix_lens, extend_lens = CASES[case]
    n = len(prefix_lens)
    pool = TokenToKVPool(100, num_layers=1, num_kv_heads=kv_heads, head_dim=d, dtype=torch.float32, device="cpu")
    reqs = ReqToTokenPool(n + 1, 64, "cpu")
    full_k, full_v, locs = [], [], []
    for i, (p, e) in enumerate(zip(prefix_lens, extend_lens)):
        slots = pool.alloc(p + e)[torch.randperm(p + e)]  # scattered slots: the pool is not contiguous
        reqs.req_to_token[i, :p + e] = slots.to(torch.int32)
        k, v = torch.randn(p + e, kv_heads, d), torch.randn(p + e, kv_heads, d)
        pool.set_kv_buffer(0, slots[:p], k[:p], v[:p])
        full_k.append(k)
        full_v.append(v)
        locs.append(slots[p:])
    q = torch.randn(sum(extend_lens), heads, d)
    new_k = torch.cat([k[p:] for k, p in zip(full_k, prefix_lens)])
    new_v = torch.cat([v[p:] for v, p in zip(full_v, prefix_lens)])
    seq = [p + e for p, e in zip(prefix_lens, extend_lens)]
    backend = TorchNativeAttnBackend(heads, kv_heads, d)
    fb = ForwardBatch(forward_mode=mode, batch_size=n, input_ids=torch.zeros(len(q), dtype=torch.int64),
                      positions=torch.zeros(len(q), dtype=torch.int64), req_pool_indices=torch.arange(n),
                      seq_lens=torch.tensor(seq), seq_lens_cpu=seq, extend_prefix_lens_cpu=prefix_lens,
                      extend_seq_lens_cpu=extend_lens, out_cache_loc=torch.cat(locs),
                      req_to_token=reqs.req_to_token, token_to_kv_pool=pool, attn_backend=backend)
    backend.init_forward_metadata(fb)
    out = backend.forward(q, new_k, new_v, layer, fb)
    start = 0
    for i, e in enumerate(extend_lens):
        ref = _reference(q[start:start + e], full_k[i], full_v[i], layer)
        assert torch.allclose(out[start:start + e], ref, atol=1e-5)
        start += e
