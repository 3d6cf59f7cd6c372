"""GPU-only checks (marker ``cuda``; skipped without a GPU): FlashInfer vs torch, CUDA-graph decode vs eager."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from radixlang.kernels.attention import create_attention_backend
from radixlang.kernels.attention.base import ForwardMode
from radixlang.kernels.cuda_graph import CudaGraphRunner, DecodeGraphInputs
from radixlang.runtime.model_executor.forward_batch import ForwardBatch
from radixlang.runtime.mem_cache.memory_pool import ReqToTokenPool, TokenToKVPool

pytestmark = pytest.mark.cuda


def _cases_module():
    spec = importlib.util.spec_from_file_location("attn_cases", Path(__file__).parent / "test_attention_triton.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


_FLASHINFER_CASES = ["extend_gqa4_mixed_prefix", "extend_mha_prefill", "decode_gqa4", "decode_mha_many_splits"]


@pytest.mark.parametrize("dtype,tol", [("float16", 2e-2), ("bfloat16", 5e-2)])
@pytest.mark.parametrize("name", _FLASHINFER_CASES)
def test_flashinfer_matches_torch(name, dtype, tol):
    pytest.importorskip("flashinfer")
    mod = _cases_module()
    case = {k: v for k, v in mod.CASES[name].items() if k != "backend_kwargs"}
    res = mod.attention_case("flashinfer", device="cuda", dtype=dtype, **case)
    assert res["finite"] and res["kv_written_equal"]
    assert res["max_err"] < tol, res


class _Layer:
    def __init__(self, heads: int, kv_heads: int, head_dim: int, layer_id: int) -> None:
        self.layer_id, self.num_heads, self.num_kv_heads, self.head_dim = layer_id, heads, kv_heads, head_dim
        self.scaling = head_dim ** -0.5


class _TinyAttentionModel:
    """Embedding + two attention layers with residuals: enough to exercise the backend under a graph."""

    def __init__(self, heads: int, kv_heads: int, head_dim: int, vocab: int, dtype: torch.dtype) -> None:
        g = torch.Generator().manual_seed(0)
        hidden = heads * head_dim
        rand = lambda *shape: (torch.randn(*shape, generator=g) * 0.2).to(device="cuda", dtype=dtype)  # noqa: E731
        self.emb, self.pos = rand(vocab, hidden), rand(512, hidden)
        self.layers = [(_Layer(heads, kv_heads, head_dim, i), rand(hidden, hidden), rand(hidden, kv_heads * head_dim),
                        rand(hidden, kv_heads * head_dim), rand(hidden, hidden)) for i in range(2)]
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, fb) -> torch.Tensor:
        x = self.emb[input_ids] + self.pos[positions]  # [bs, hidden]
        for layer, wq, wk, wv, wo in self.layers:
            q = (x @ wq).view(-1, self.heads, self.head_dim)
            k = (x @ wk).view(-1, self.kv_heads, self.head_dim)
            v = (x @ wv).view(-1, self.kv_heads, self.head_dim)
            x = x + fb.attn_backend.forward(q, k, v, layer, fb).reshape(x.shape[0], -1) @ wo
        return x


@pytest.mark.parametrize("backend_name", ["triton", "flashinfer"])
def test_cuda_graph_decode_matches_eager(backend_name):
    if backend_name == "flashinfer":
        pytest.importorskip("flashinfer")
    dtype, heads, kv_heads, head_dim = torch.bfloat16, 8, 2, 64
    model = _TinyAttentionModel(heads, kv_heads, head_dim, vocab=100, dtype=dtype)
    pool = TokenToKVPool(4096, num_layers=2, num_kv_heads=kv_heads, head_dim=head_dim, dtype=dtype, device="cuda")
    reqs = ReqToTokenPool(16, 256, "cuda")
    backend = create_attention_backend(backend_name, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
                                       device="cuda", dtype=dtype, max_kv_splits=4, min_split_len=16)

    def build(inputs: DecodeGraphInputs) -> ForwardBatch:
        bs = len(inputs.seq_lens_cpu)
        return ForwardBatch(forward_mode=ForwardMode.DECODE, batch_size=bs, input_ids=inputs.input_ids,
                            positions=inputs.positions, req_pool_indices=inputs.req_pool_indices,
                            seq_lens=inputs.seq_lens, seq_lens_cpu=inputs.seq_lens_cpu,
                            extend_prefix_lens_cpu=[s - 1 for s in inputs.seq_lens_cpu], extend_seq_lens_cpu=[1] * bs,
                            out_cache_loc=inputs.out_cache_loc, req_to_token=reqs.req_to_token,
                            token_to_kv_pool=pool, attn_backend=backend)

    runner = CudaGraphRunner(model.forward, build, backend, max_bs=8, max_context_len=256, capture_sizes=(1, 2, 4, 8))
    runner.capture()
    gen = torch.Generator().manual_seed(1)
    for seq_lens in ([5, 130, 17], [1, 2, 64, 200, 33]):
        bs = len(seq_lens)
        rows = torch.randperm(16, generator=gen)[:bs]
        for row, n in zip(rows.tolist(), seq_lens):
            slots = pool.alloc(n)
            reqs.req_to_token[row, :n] = slots.to(device="cuda", dtype=torch.int32)
            for layer_id in range(2):
                kv = torch.randn(2, n - 1, kv_heads, head_dim, generator=gen).to(device="cuda", dtype=dtype)
                pool.set_kv_buffer(layer_id, slots[:n - 1].cuda(), kv[0], kv[1])
        out_loc = reqs.req_to_token[rows.cuda(), torch.tensor(seq_lens, device="cuda") - 1].to(torch.int64)
        inputs = DecodeGraphInputs(input_ids=torch.randint(0, 100, (bs,), generator=gen).cuda(),
                                   positions=torch.tensor(seq_lens, device="cuda") - 1,
                                   req_pool_indices=rows.cuda(), seq_lens=torch.tensor(seq_lens, device="cuda"),
                                   out_cache_loc=out_loc, seq_lens_cpu=seq_lens)
        fb = build(inputs)
        with torch.inference_mode():
            backend.init_forward_metadata(fb)
            eager = model.forward(inputs.input_ids, inputs.positions, fb).float()
            written = pool.get_key_buffer(1)[out_loc].clone()
            pool.get_key_buffer(1)[out_loc] = 0
            graphed = runner.replay(inputs.input_ids, inputs.positions, fb).float()
        assert graphed.shape == eager.shape
        assert torch.allclose(graphed, eager, atol=3e-2, rtol=3e-2), float((graphed - eager).abs().max())
        # the graph wrote the new tokens' keys (layer 1's depend on layer 0's attention) where eager did
        assert torch.allclose(pool.get_key_buffer(1)[out_loc].float(), written.float(), atol=3e-2, rtol=3e-2)
