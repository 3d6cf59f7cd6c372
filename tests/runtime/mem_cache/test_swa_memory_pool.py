"""SWATokenToKVPool: two slot spaces, the full -> swa mapping, frees that refuse a double free, and both
CPU attention backends reading window layers through the mapping (freed tokens outside the window)."""
from __future__ import annotations

import pytest
import torch

from radixlang.kernels import cpu as cpu_ops
from radixlang.kernels.attention.base import ForwardMode
from radixlang.kernels.attention.cpu_backend import CpuAttnBackend
from radixlang.kernels.attention.torch_native import TorchNativeAttnBackend
from radixlang.runtime.mem_cache.memory_pool import ReqToTokenPool, TokenToKVPool
from radixlang.runtime.mem_cache.swa_memory_pool import SWATokenToKVPool
from radixlang.runtime.model_executor.forward_batch import ForwardBatch

HEADS, KV_HEADS, DIM = 4, 2, 64
WINDOWS = [6, None, 6]  # layers 0 and 2 slide, layer 1 attends to everything


def _pool(size: int = 40, swa_size: int = 12) -> SWATokenToKVPool:
    return SWATokenToKVPool(size, swa_size, layer_windows=WINDOWS, layer_shapes=[(KV_HEADS, DIM)] * 3,
                            dtype=torch.float32, device="cpu")


def test_alloc_gives_both_slots_and_frees_refuse_double_frees():
    pool = _pool()
    full = pool.alloc(10)
    assert pool.available_size() == 30 and pool.swa_available_size() == 2
    assert bool(pool.has_swa(full).all())
    assert pool.alloc(3) is None  # 30 full slots free, but only 2 swa slots
    pool.free_swa(full[:4])
    assert pool.swa_available_size() == 6 and pool.has_swa(full).tolist() == [False] * 4 + [True] * 6
    with pytest.raises(RuntimeError, match="double free of the swa KV"):
        pool.free_swa(full[3:5])
    pool.free(full)  # frees the 6 swa slots still held and every full slot
    assert pool.available_size() == 40 and pool.swa_available_size() == 12
    with pytest.raises(RuntimeError, match="double free of KV slots"):
        pool.free(full[:1])
    assert int(pool.full_to_swa.abs().sum()) == 0


def test_move_swa_hands_window_kv_to_a_slot_without_it():
    pool = _pool()
    a, b = pool.alloc(2), pool.alloc(2)
    pool.free_swa(b)
    swa_a = pool.full_to_swa[a].clone()
    pool.move_swa(a, b)
    assert torch.equal(pool.full_to_swa[b], swa_a) and not bool(pool.has_swa(a).any())
    with pytest.raises(RuntimeError, match="move_swa needs"):
        pool.move_swa(a, b)
    pool.free(a)
    pool.free(b)
    assert pool.available_size() == 40 and pool.swa_available_size() == 12


def test_buffers_and_bytes_of_both_spaces():
    pool = _pool()
    assert pool.is_swa_layer(0) and not pool.is_swa_layer(1) and pool.window == 6
    assert [pool.get_key_buffer(i).shape[0] for i in range(3)] == [13, 41, 13]
    per_layer = 2 * KV_HEADS * DIM * 4
    assert pool.total_bytes == 41 * per_layer + 13 * 2 * per_layer
    assert pool.per_token_bytes == 3 * per_layer
    loc = pool.alloc(3)
    k = torch.randn(3, KV_HEADS, DIM)
    pool.set_kv_buffer(0, loc, k, -k)
    assert torch.equal(pool.get_key_buffer(0)[pool.full_to_swa[loc]], k)
    pool.set_kv_buffer(1, loc, k, -k)
    assert torch.equal(pool.get_value_buffer(1)[loc], -k)


class _Layer:
    def __init__(self, layer_id: int, window: int | None) -> None:
        self.layer_id, self.sliding_window = layer_id, window
        self.num_heads, self.num_kv_heads, self.head_dim, self.scaling = HEADS, KV_HEADS, DIM, DIM ** -0.5


def _attend(backend_cls, pool: TokenToKVPool, kv: list[tuple[torch.Tensor, torch.Tensor]], q: torch.Tensor,
            *, free_before: int) -> list[torch.Tensor]:
    """Prefill 20 tokens, free the window KV of positions < free_before (swa pools), decode one token."""
    n = 20
    reqs = ReqToTokenPool(1, 32, "cpu")
    loc = pool.alloc(n + 1)
    reqs.req_to_token[0, :n + 1] = loc.to(torch.int32)
    if isinstance(pool, SWATokenToKVPool):  # any one-to-one map will do: one a backend cannot read past
        pool.full_to_swa[loc] = pool.full_to_swa[loc][torch.randperm(n + 1, generator=torch.Generator().manual_seed(1))]
    backend = backend_cls(HEADS, KV_HEADS, DIM)
    outs = []
    for mode, lo, hi in ((ForwardMode.EXTEND, 0, n), (ForwardMode.DECODE, n, n + 1)):
        if mode is ForwardMode.DECODE and isinstance(pool, SWATokenToKVPool):
            pool.free_swa(loc[:free_before])
        fb = ForwardBatch(forward_mode=mode, batch_size=1, input_ids=torch.zeros(hi - lo, dtype=torch.int64),
                          positions=torch.arange(lo, hi), req_pool_indices=torch.tensor([0]),
                          seq_lens=torch.tensor([hi]), seq_lens_cpu=[hi], extend_prefix_lens_cpu=[lo],
                          extend_seq_lens_cpu=[hi - lo], out_cache_loc=loc[lo:hi], req_to_token=reqs.req_to_token,
                          token_to_kv_pool=pool, attn_backend=backend)
        backend.init_forward_metadata(fb)
        for i, w in enumerate(WINDOWS):
            k, v = kv[i]
            outs.append(backend.forward(q[lo:hi].clone(), k[lo:hi].clone(), v[lo:hi].clone(), _Layer(i, w), fb))
    return outs


@pytest.mark.parametrize("backend_cls", [TorchNativeAttnBackend, CpuAttnBackend], ids=["torch", "cpu"])
def test_backends_read_window_layers_through_the_mapping(backend_cls):
    if backend_cls is CpuAttnBackend and not cpu_ops.available():
        pytest.skip(f"CPU kernels unavailable: {cpu_ops.unavailable_reason()}")
    torch.manual_seed(0)
    kv = [(torch.randn(21, KV_HEADS, DIM), torch.randn(21, KV_HEADS, DIM)) for _ in WINDOWS]
    q = torch.randn(21, HEADS, DIM)
    plain = TokenToKVPool(32, num_layers=3, num_kv_heads=KV_HEADS, head_dim=DIM, dtype=torch.float32, device="cpu")
    ref = _attend(backend_cls, plain, kv, q, free_before=0)
    # the decode query at position 20 sees window keys 15..20: positions < 15 may lose their window KV
    got = _attend(backend_cls, _pool(size=32, swa_size=24), kv, q, free_before=15)
    for a, b in zip(ref, got):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    # one position too many (15, which the query still sees) changes a window layer's output
    bad = _attend(backend_cls, _pool(size=32, swa_size=24), kv, q, free_before=16)
    assert not torch.allclose(ref[3], bad[3], atol=1e-3) and torch.allclose(ref[4], bad[4], atol=1e-5)
