"""build_attention_metadata against hand-built CSR tensors."""
from __future__ import annotations

import pytest
import torch

from radixlang.kernels.attention.metadata import build_attention_metadata


def _i32(values):
    return torch.tensor(values, dtype=torch.int32)


@pytest.fixture
def req_to_token() -> torch.Tensor:
    table = torch.zeros((4, 8), dtype=torch.int32)
    table[2, :3] = _i32([10, 11, 12])
    table[0, :5] = _i32([20, 21, 22, 23, 24])
    table[1, :4] = _i32([99, 98, 97, 96])  # a row not in the batch
    return table


def test_extend_metadata_exact(req_to_token):
    md = build_attention_metadata(req_to_token, torch.tensor([2, 0]), [3, 5], extend_prefix_lens=[1, 3],
                                  extend_seq_lens=[2, 2])
    assert md.qo_indptr.tolist() == [0, 2, 4]
    assert md.kv_indptr.tolist() == [0, 3, 8]
    assert md.kv_indices.tolist() == [10, 11, 12, 20, 21, 22, 23, 24]
    assert md.kv_last_page_len.tolist() == [1, 1]
    assert md.prefix_kv_indptr.tolist() == [0, 1, 4]
    assert md.prefix_kv_indices.tolist() == [10, 20, 21, 22]
    assert md.prefix_kv_last_page_len.tolist() == [1, 1]
    for t in (md.qo_indptr, md.kv_indptr, md.kv_indices, md.kv_last_page_len, md.prefix_kv_indptr,
              md.prefix_kv_indices):
        assert t.dtype == torch.int32
    assert (md.max_extend_len, md.max_seq_len, md.num_tokens) == (2, 5, 4)


def test_extend_with_empty_prefix(req_to_token):
    md = build_attention_metadata(req_to_token, torch.tensor([0, 2]), torch.tensor([5, 3]),
                                  extend_prefix_lens=torch.tensor([0, 2]), extend_seq_lens=torch.tensor([5, 1]))
    assert md.qo_indptr.tolist() == [0, 5, 6]
    assert md.prefix_kv_indptr.tolist() == [0, 0, 2]
    assert md.prefix_kv_indices.tolist() == [10, 11]
    # an empty prefix has last-page length 0: FlashInfer's planner computes max(0 - 1, 0) * 1 + last == last
    # tokens, so 1 here would plan one row of KV for a request with none
    assert md.prefix_kv_last_page_len.tolist() == [0, 1]
    assert md.kv_indices.tolist() == [20, 21, 22, 23, 24, 10, 11, 12]


def test_decode_metadata_defaults_to_one_new_token(req_to_token):
    md = build_attention_metadata(req_to_token, torch.tensor([2, 0]), [3, 5])
    assert md.qo_indptr.tolist() == [0, 1, 2]
    assert md.extend_prefix_lens_cpu == [2, 4]
    assert md.prefix_kv_indices.tolist() == [10, 11, 20, 21, 22, 23]
    assert md.kv_indices.tolist() == [10, 11, 12, 20, 21, 22, 23, 24]


def test_paged_metadata_page_size_2():
    table = torch.zeros((3, 8), dtype=torch.int32)
    table[2, :4] = _i32([4, 5, 6, 7])  # pages 2, 3
    table[0, :5] = _i32([10, 11, 12, 13, 14])  # pages 5, 6, 7
    md = build_attention_metadata(table, torch.tensor([2, 0]), [4, 5], extend_prefix_lens=[3, 2],
                                  extend_seq_lens=[1, 3], page_size=2)
    assert md.kv_indptr.tolist() == [0, 2, 5]
    assert md.kv_indices.tolist() == [2, 3, 5, 6, 7]
    assert md.kv_last_page_len.tolist() == [2, 1]
    assert md.prefix_kv_indptr.tolist() == [0, 2, 3]
    assert md.prefix_kv_indices.tolist() == [2, 3, 5]
    assert md.prefix_kv_last_page_len.tolist() == [1, 2]


@pytest.mark.parametrize("kwargs,match", [
    (dict(seq_lens=[3, 5], extend_prefix_lens=[1, 3], extend_seq_lens=[1, 2]), "prefix_len \\+ extend_len"),
    (dict(seq_lens=[3, 5], extend_prefix_lens=[3, 3], extend_seq_lens=[0, 2]), "extend_len >= 1"),
    (dict(seq_lens=[3, 5], extend_seq_lens=[1]), "2 entries"),
    (dict(seq_lens=[3, 9]), "max_context_len"),
    (dict(seq_lens=[3]), "req_pool_indices must have shape"),
    (dict(seq_lens=[3, 5], page_size=0), "page_size"),
])
def test_invalid_inputs_raise(req_to_token, kwargs, match):
    with pytest.raises(ValueError, match=match):
        build_attention_metadata(req_to_token, torch.tensor([2, 0]), **kwargs)


def test_empty_prefix_last_page_len_gives_zero_tokens_in_flashinfer_formula():
    table = torch.zeros((2, 8), dtype=torch.int32)
    table[1, :3] = _i32([8, 9, 10])
    md = build_attention_metadata(table, torch.tensor([1]), [3], extend_prefix_lens=[0], extend_seq_lens=[3],
                                  page_size=4)
    pages = int(md.prefix_kv_indptr[1] - md.prefix_kv_indptr[0])
    # flashinfer.page.get_seq_lens clamps the page count: clamp(pages - 1, min=0) * page_size + last_page_len
    assert max(pages - 1, 0) * 4 + int(md.prefix_kv_last_page_len[0]) == 0
    assert md.kv_indices.tolist() == [2] and md.kv_last_page_len.tolist() == [3]


def _flashinfer_kv_lens(indptr: torch.Tensor, last_page_len: torch.Tensor, page_size: int) -> list[int]:
    # FlashInfer's host-side planner (flashinfer.page.get_seq_lens): the KV length it plans per request
    pages = indptr[1:] - indptr[:-1]
    return ((pages - 1).clamp(min=0) * page_size + last_page_len).tolist()


@pytest.mark.parametrize("page_size", [1, 4])
def test_flashinfer_plans_the_true_kv_lengths_empty_prefixes_included(page_size):
    table = torch.arange(4 * 16, dtype=torch.int32).view(4, 16) * page_size
    prefix, ext = [0, 5, 0, 8], [3, 2, 1, 4]
    seq = [p + e for p, e in zip(prefix, ext)]
    md = build_attention_metadata(table, torch.tensor([3, 1, 0, 2]), seq, extend_prefix_lens=prefix,
                                  extend_seq_lens=ext, page_size=page_size)
    assert _flashinfer_kv_lens(md.prefix_kv_indptr_cpu, md.prefix_kv_last_page_len_cpu, page_size) == prefix
    assert _flashinfer_kv_lens(md.kv_indptr_cpu, md.kv_last_page_len_cpu, page_size) == seq
    assert md.prefix_lens_cpu_i32.tolist() == prefix and md.seq_lens_cpu_i32.tolist() == seq


def test_host_copies_stay_on_the_host_and_building_never_reads_the_device():
    from device_tags import FakeDeviceMode

    with FakeDeviceMode() as mode:
        table = torch.arange(64, dtype=torch.int32, device="cuda").view(4, 16)
        md = build_attention_metadata(table, torch.tensor([2, 0], device="cuda"), [5, 3],
                                      extend_prefix_lens=[0, 2], extend_seq_lens=[5, 1])
        for name in ("qo_indptr", "kv_indptr", "kv_last_page_len", "prefix_kv_indptr", "prefix_kv_last_page_len"):
            host, dev = getattr(md, f"{name}_cpu"), getattr(md, name)
            assert host.device.type == "cpu" and host.dtype == torch.int32, name
            assert dev.device.type == "cuda" and dev.dtype == torch.int32, name
        assert md.kv_indices.device.type == "cuda" and md.prefix_kv_indices.device.type == "cuda"
        assert md.seq_lens_cpu_i32.device.type == "cpu" and md.prefix_lens_cpu_i32.device.type == "cpu"
        assert mode.num_syncs == 0  # the lengths came from the host: nothing was read back from the device
        assert md.kv_indices.tolist() == [32, 33, 34, 35, 36, 0, 1, 2] and mode.num_syncs == 1
    assert md.qo_indptr_cpu.tolist() == [0, 5, 6] and md.prefix_kv_indptr_cpu.tolist() == [0, 0, 2]
