"""Backend selection, FlashInfer plan arguments and CUDA-graph runner checks that need no GPU."""
from __future__ import annotations

import sys

import pytest
import torch

from radixlang.kernels.attention import create_attention_backend
from radixlang.kernels.attention.flashinfer_backend import flashinfer_plan_args
from radixlang.kernels.attention.metadata import build_attention_metadata
from radixlang.kernels.attention.torch_native import TorchNativeAttnBackend
from radixlang.kernels.cuda_graph import CudaGraphRunner, default_capture_sizes


def test_create_torch_backend_accepts_extra_kwargs():
    backend = create_attention_backend("torch", num_heads=4, num_kv_heads=2, head_dim=8, device="cpu",
                                       dtype=torch.float32, max_kv_splits=4)
    assert isinstance(backend, TorchNativeAttnBackend)
    assert (backend.num_heads, backend.num_kv_heads, backend.head_dim) == (4, 2, 8)


def test_create_unknown_backend_names_the_choices():
    with pytest.raises(ValueError, match="torch, cpu, triton, flashinfer.*'fa3'"):
        create_attention_backend("fa3", num_heads=4, num_kv_heads=2, head_dim=8, device="cpu", dtype=torch.float32)


def test_flashinfer_missing_gives_install_hint(monkeypatch):
    monkeypatch.setitem(sys.modules, "flashinfer", None)  # makes `import flashinfer` raise ImportError
    with pytest.raises(ImportError, match=r"pip install 'radixlang\[cuda\]'"):
        create_attention_backend("flashinfer", num_heads=4, num_kv_heads=2, head_dim=64, device="cpu",
                                 dtype=torch.float16)


def test_flashinfer_rejects_float32():
    with pytest.raises(ValueError, match="float16 or bfloat16, got torch.float32"):
        create_attention_backend("flashinfer", num_heads=4, num_kv_heads=2, head_dim=64, device="cpu",
                                 dtype=torch.float32)


def _metadata(prefix_lens, extend_lens):
    table = torch.zeros((3, 16), dtype=torch.int32)
    table[1, :9] = torch.arange(30, 39, dtype=torch.int32)
    table[2, :6] = torch.arange(50, 56, dtype=torch.int32)
    seq = [p + e for p, e in zip(prefix_lens, extend_lens)]
    return build_attention_metadata(table, torch.tensor([1, 2]), seq, prefix_lens, extend_lens)


def test_flashinfer_plan_args_follow_metadata():
    md = _metadata([4, 0], [5, 6])
    args = flashinfer_plan_args(md, num_heads=8, num_kv_heads=2, head_dim=64, page_size=1)
    paged = args["paged_prefix"]
    assert list(paged) == ["qo_indptr", "paged_kv_indptr", "paged_kv_indices", "paged_kv_last_page_len",
                           "num_qo_heads", "num_kv_heads", "head_dim_qk", "page_size", "seq_lens"]
    assert paged["qo_indptr"].tolist() == [0, 5, 11]
    assert paged["paged_kv_indptr"].tolist() == [0, 4, 4]
    assert paged["paged_kv_indices"].tolist() == [30, 31, 32, 33]
    assert paged["paged_kv_last_page_len"].tolist() == [1, 0]  # the second request has no prefix: 0 tokens
    assert paged["seq_lens"].tolist() == [4, 0]
    assert (paged["num_qo_heads"], paged["num_kv_heads"], paged["head_dim_qk"], paged["page_size"]) == (8, 2, 64, 1)
    ragged = args["ragged"]
    assert list(ragged) == ["qo_indptr", "kv_indptr", "num_qo_heads", "num_kv_heads", "head_dim_qk"]
    assert ragged["qo_indptr"].tolist() == ragged["kv_indptr"].tolist() == [0, 5, 11]
    decode = args["decode"]
    assert list(decode) == ["indptr", "indices", "last_page_len", "num_qo_heads", "num_kv_heads", "head_dim",
                            "page_size", "seq_lens"]
    assert decode["seq_lens"].tolist() == [9, 6]
    assert decode["indptr"].tolist() == [0, 9, 15]
    assert decode["indices"].tolist() == list(range(30, 39)) + list(range(50, 56))
    assert all(t.dtype == torch.int32 for t in (*paged.values(),) if isinstance(t, torch.Tensor))
    # the planner reads indptrs and lengths on the host: they are passed as host tensors (no device sync)
    for wrapper in (paged, ragged, decode):
        assert all(t.device.type == "cpu" for k, t in wrapper.items()
                   if isinstance(t, torch.Tensor) and "indices" not in k)


def test_flashinfer_plan_args_skip_prefix_when_none_cached():
    args = flashinfer_plan_args(_metadata([0, 0], [9, 6]), num_heads=4, num_kv_heads=4, head_dim=64, page_size=1)
    assert args["paged_prefix"] is None
    assert args["ragged"]["qo_indptr"].tolist() == [0, 9, 15]


@pytest.mark.parametrize("kwargs,match", [
    (dict(num_heads=6, num_kv_heads=4, head_dim=64, page_size=1), "multiple of num_kv_heads"),
    (dict(num_heads=8, num_kv_heads=2, head_dim=64, page_size=16), "page_size 1, got page_size 16"),
])
def test_flashinfer_plan_args_validate(kwargs, match):
    with pytest.raises(ValueError, match=match):
        flashinfer_plan_args(_metadata([1, 0], [1, 1]), **kwargs)


def test_default_capture_sizes():
    assert default_capture_sizes(1) == [1]
    assert default_capture_sizes(6) == [1, 2, 4, 6]
    assert default_capture_sizes(40) == [1, 2, 4, 8, 16, 24, 32, 40]
    assert default_capture_sizes(45) == [1, 2, 4, 8, 16, 24, 32, 40, 45]


def test_graph_runner_rejects_the_torch_backend():
    backend = TorchNativeAttnBackend(4, 2, 8)
    with pytest.raises(ValueError, match="TorchNativeAttnBackend"):
        CudaGraphRunner(lambda i, p, fb: i, lambda inputs: None, backend, max_bs=4, max_context_len=16)


def test_graph_runner_validates_sizes():
    class Graphable:
        def init_cuda_graph_state(self, max_bs, max_context_len): ...
        def init_forward_metadata_cuda_graph(self, forward_batch): ...
    with pytest.raises(ValueError, match="within \\[1, max_bs=4\\]"):
        CudaGraphRunner(lambda i, p, fb: i, lambda inputs: None, Graphable(), max_bs=4, max_context_len=16,
                        capture_sizes=(2, 8), device="cpu")


def test_triton_on_cpu_needs_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        create_attention_backend("triton", num_heads=4, num_kv_heads=2, head_dim=16, device="cpu",
                                 dtype=torch.float32)


@pytest.mark.parametrize("name,capability,want", [
    ("auto", (9, 0), ("fa3", "fa2", "fa2")),  # Hopper: ragged on fa3, the paged prefix (cache hits) on fa2
    ("auto", (8, 0), ("fa2", "fa2", "fa2")), ("auto", (10, 0), ("fa2", "fa2", "fa2")),
    ("fa2", (9, 0), ("fa2", "fa2", "fa2")), ("fa3", (9, 0), ("fa3", "fa3", "fa2"))])
def test_flashinfer_kernels_per_wrapper(name, capability, want):
    from radixlang.kernels.attention.flashinfer_backend import pick_wrapper_backends
    assert tuple(pick_wrapper_backends(name, capability)) == want
    with pytest.raises(ValueError, match="fa4"):
        pick_wrapper_backends("fa4", capability)


def test_flashinfer_backend_builds_each_wrapper_on_its_kernels(monkeypatch):
    # a stand-in flashinfer records the backend each wrapper is built with, on an emulated Hopper
    import types

    built: dict[str, str] = {}

    def wrapper(kind: str):
        def make(workspace, layout, backend="auto", **kw):
            built[kind] = backend
            return types.SimpleNamespace()
        return make

    fake = types.SimpleNamespace(BatchPrefillWithRaggedKVCacheWrapper=wrapper("ragged"),
                                 BatchPrefillWithPagedKVCacheWrapper=wrapper("paged_prefix"),
                                 BatchDecodeWithPagedKVCacheWrapper=wrapper("decode"))
    monkeypatch.setitem(sys.modules, "flashinfer", fake)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    create_attention_backend("flashinfer", num_heads=8, num_kv_heads=2, head_dim=64, device="cpu",
                             dtype=torch.bfloat16, workspace_bytes=1024)
    assert built == {"ragged": "fa3", "paged_prefix": "fa2", "decode": "fa2"}


def test_triton_kernels_multiply_float32_in_ieee_not_tf32():
    # tl.dot on float32 defaults to TF32 on NVIDIA GPUs: a float32 model on triton would silently lose
    # precision. Every tl.dot of the kernels takes the precision dot_precision picks from the input dtype.
    import ast
    from pathlib import Path

    from radixlang.kernels import triton_ops
    from radixlang.kernels.triton_ops.precision import dot_precision

    assert dot_precision(torch.float32) == "ieee"
    assert dot_precision(torch.float16) is dot_precision(torch.bfloat16) is None  # the target's default
    dots = 0
    for path in sorted(Path(triton_ops.__file__).parent.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and ast.unparse(node.func) == "tl.dot":
                dots += 1
                assert "input_precision" in {kw.arg for kw in node.keywords}, f"{path.name}:{node.lineno}"
    assert dots >= 5  # decode (2), extend (2), fused MoE (1)
