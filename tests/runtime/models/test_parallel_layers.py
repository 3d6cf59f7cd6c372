"""Tensor-parallel layers and the sharded model against their dense versions, the ranks run as threads."""
from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from torch import nn
from transformers import AutoConfig

from radixlang.runtime.models.layers.linear import LinearMethod, weight_loader_of
from radixlang.runtime.models.llama import LlamaForCausalLM, check_tensor_parallel
from radixlang.runtime.models.loader.model_loader import random_weights
from radixlang.runtime.models.parallel import (ParallelLMHead, RowParallelLinear, VocabParallelEmbedding,
                                               column_linear, kv_head_range, kv_heads_per_rank, shard_tensor,
                                               shard_vocab)
from test_models import _run_ours
from tiny_model import MLA_FAMILIES, make_tiny_model_dir, save_tiny_hf_model


class ThreadGroup:
    """``size`` ranks in threads of one process: the collectives meet at a barrier."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.slots: list[torch.Tensor | None] = [None] * size
        self.barrier = threading.Barrier(size)

    def comm(self, rank: int) -> ThreadComm:
        return ThreadComm(self, rank)


class ThreadComm:
    def __init__(self, group: ThreadGroup, rank: int) -> None:
        self.group, self.rank, self.size = group, rank, group.size

    def _exchange(self, x: torch.Tensor) -> list[torch.Tensor]:
        self.group.slots[self.rank] = x.clone()
        self.group.barrier.wait()
        parts = list(self.group.slots)
        self.group.barrier.wait()  # nobody overwrites a slot before every rank has read it
        return parts

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return torch.stack(self._exchange(x)).sum(0)

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat(self._exchange(x), dim=-1)


def _on_ranks(size: int, fn):
    """fn(comm) on every rank at once; the results in rank order."""
    group = ThreadGroup(size)
    with ThreadPoolExecutor(size) as pool:
        return list(pool.map(lambda r: fn(group.comm(r)), range(size)))


def test_row_parallel_linear_matches_dense():
    torch.manual_seed(0)
    dense = nn.Linear(12, 5, bias=True)
    x = torch.randn(3, 12)

    def rank(comm):
        layer = RowParallelLinear(12, 5, tp=comm, bias=True)
        layer.weight.data.copy_(shard_tensor(dense.weight.data, comm.rank, comm.size, dim=1))
        layer.bias.data.copy_(dense.bias.data)
        return layer(shard_tensor(x, comm.rank, comm.size, dim=1))
    for out in _on_ranks(3, rank):
        torch.testing.assert_close(out, dense(x), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("vocab", [10, 11])  # 11: the last rank's rows are padding
def test_vocab_parallel_embedding_and_logits_match_dense(vocab):
    torch.manual_seed(0)
    dense = nn.Embedding(vocab, 6)
    ids = torch.tensor([0, 3, 4, 5, vocab - 1, 3])
    hidden = torch.randn(4, 6)

    def rank(comm):
        emb = VocabParallelEmbedding(vocab, 6, tp=comm)
        emb.weight.data.copy_(shard_vocab(dense.weight.data, comm.rank, comm.size))
        head = ParallelLMHead(vocab, 6, tp=comm)
        head.weight.data.copy_(shard_vocab(dense.weight.data, comm.rank, comm.size))
        return emb(ids), emb.logits(hidden), head(hidden)
    for looked_up, tied, untied in _on_ranks(2, rank):
        assert torch.equal(looked_up, dense(ids))  # exactly one rank holds each row
        assert tied.shape == (4, vocab)
        torch.testing.assert_close(tied, hidden @ dense.weight.T)
        torch.testing.assert_close(untied, hidden @ dense.weight.T)


class _Rank:
    """A rank as the weight loaders see it: its place only (they slice; they never communicate)."""

    def __init__(self, rank: int, size: int) -> None:
        self.rank, self.size = rank, size


def _load(param: nn.Parameter, tensor: torch.Tensor, shard: int | None = None) -> None:
    weight_loader_of(param)(param, tensor, shard)


@pytest.mark.parametrize("num_kv_heads", [2, 1])  # 1: fewer kv heads than ranks, each rank keeps a copy
def test_weight_loaders_take_their_rank_slice(num_kv_heads):
    """At tp 2 a column-parallel parameter takes its rows of the full tensor, a row-parallel one its columns
    (its bias whole), a fused one each piece's rank rows at that piece's offset; a replicated one all."""
    gen = torch.Generator().manual_seed(0)
    hidden, head_dim, heads = 4, 2, 4
    q = torch.randn(heads * head_dim, hidden, generator=gen)
    k, v = (torch.randn(num_kv_heads * head_dim, hidden, generator=gen) for _ in range(2))
    col, col_bias = torch.randn(6, hidden, generator=gen), torch.randn(6, generator=gen)
    row, row_bias = torch.randn(hidden, 6, generator=gen), torch.randn(hidden, generator=gen)
    for r in range(2):
        tp = _Rank(r, 2)
        column = column_linear(hidden, [("q_b", 3)], tp, LinearMethod(), bias=True)
        _load(column.weight, col)
        _load(column.bias, col_bias)
        assert torch.equal(column.weight, col[3 * r:3 * r + 3]) and torch.equal(column.bias, col_bias[3 * r:3 * r + 3])
        down = RowParallelLinear(6, hidden, tp=tp, bias=True)
        _load(down.weight, row)
        _load(down.bias, row_bias)
        assert torch.equal(down.weight, row[:, 3 * r:3 * r + 3]) and torch.equal(down.bias, row_bias)
        kv_local = max(num_kv_heads // 2, 1) * head_dim
        qkv = column_linear(hidden, [("q", 2 * head_dim), ("k", kv_local), ("v", kv_local)], tp, LinearMethod(),
                            num_kv_heads=num_kv_heads)
        torch.nn.init.zeros_(qkv.weight)
        for shard, piece in enumerate((q, k, v)):
            _load(qkv.weight, piece, shard)
        kv = slice(*(i * head_dim for i in kv_head_range(num_kv_heads, r, 2)))
        want = torch.cat([q[2 * head_dim * r:2 * head_dim * (r + 1)], k[kv], v[kv]])
        assert torch.equal(qkv.weight, want)
        assert qkv.pieces == ((0, 2 * head_dim), (2 * head_dim, kv_local), (2 * head_dim + kv_local, kv_local))
        with pytest.raises(ValueError, match="one at a time"):
            _load(qkv.weight, torch.cat([q, k, v]))  # a fused tensor under tp: cut it first
        norm = nn.Parameter(torch.empty(hidden), requires_grad=False)  # no loader of its own: copied whole
        _load(norm, row_bias)
        assert torch.equal(norm, row_bias)


def test_head_splits_and_refusals():
    assert kv_heads_per_rank(9, 3, 3) == (3, 1)  # SmolLM2 at tp=3: both split
    assert kv_heads_per_rank(4, 2, 2) == (2, 1)
    assert kv_heads_per_rank(8, 2, 4) == (2, 1)  # fewer kv heads than ranks: replicated
    assert [kv_head_range(2, r, 4) for r in range(4)] == [(0, 1), (0, 1), (1, 2), (1, 2)]
    with pytest.raises(ValueError, match="9 attention heads"):
        kv_heads_per_rank(9, 3, 2)
    with pytest.raises(ValueError, match="3 kv heads"):
        kv_heads_per_rank(12, 3, 2)
    with pytest.raises(ValueError, match="multiple"):
        kv_heads_per_rank(12, 4, 6)


@pytest.mark.parametrize("kw,size", [
    ({}, 2),  # 4 heads / 2 kv heads: both split
    ({}, 4),  # 2 kv heads over 4 ranks: replicated
    ({"hidden": 72, "heads": 9, "kv_heads": 3}, 3),  # SmolLM2's 9 heads / 3 kv heads at tp=3
    ({"tie": False, "model_type": "qwen2"}, 2),  # untied lm_head, q/k/v biases
])
def test_sharded_model_matches_single_rank(tmp_path, kw, size):
    config = AutoConfig.from_pretrained(make_tiny_model_dir(str(tmp_path), **kw))
    ids = [5, 17, 300, 4000, 12, 49000, 7]
    dense = LlamaForCausalLM(config)
    dense.load_weights(random_weights(config, seed=1))
    want = _run_ours(dense, ids, decode_last=True)

    def rank(comm):
        model = LlamaForCausalLM(config, tp=comm)
        model.load_weights(random_weights(config, seed=1))
        return _run_ours(model, ids, decode_last=True)
    for got in _on_ranks(size, rank):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_check_tensor_parallel_names_the_heads(tmp_path):
    config = AutoConfig.from_pretrained(make_tiny_model_dir(str(tmp_path)))  # 4 heads, 2 kv heads
    check_tensor_parallel(config, 2)
    with pytest.raises(ValueError, match="4 attention heads"):
        check_tensor_parallel(config, 3)


@pytest.mark.parametrize("name", sorted(MLA_FAMILIES))
def test_sharded_deepseek_matches_single_rank(tmp_path, name):
    """MLA split by heads (q_b / kv_b rows, o_proj columns; the latent replicated), routed and shared
    experts and the dense first layer split by intermediate features: two ranks give one rank's logits."""
    from radixlang.runtime.models.loader.model_loader import load_model
    arch, overrides = MLA_FAMILIES[name]
    folder = save_tiny_hf_model(str(tmp_path / name), arch, seed=3, **overrides)
    ids = [5, 17, 300, 4000, 12, 49000, 7]
    want = _run_ours(load_model(folder).model, ids, decode_last=True)

    def rank(comm):
        model = load_model(folder, tp=comm).model
        attn = model.layers[0].self_attn
        assert attn.num_heads == 3 and attn.kv_b_proj.weight.shape[0] == 3 * (16 + 24)
        return _run_ours(model, ids, decode_last=True)
    for got in _on_ranks(2, rank):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_expert_stack_loaders_take_each_experts_rank_slice():
    """At tp 2 a float expert stack takes expert e's gate and up (pieces 2e, 2e + 1 of w13) as its rank's
    rows of each, and its down (piece e of w2) as its rank's columns; an expert past the stack is refused."""
    from radixlang.runtime.models.layers.moe import Experts, expert_checkpoint_param
    gen = torch.Generator().manual_seed(0)
    n, hidden, inter = 3, 4, 6
    gate, up = torch.randn(n, inter, hidden, generator=gen), torch.randn(n, inter, hidden, generator=gen)
    down = torch.randn(n, hidden, inter, generator=gen)
    assert expert_checkpoint_param("layers.0.mlp.experts.2.up_proj.weight") == ("layers.0.mlp.experts.w13", 5)
    assert expert_checkpoint_param("layers.0.mlp.experts.2.w2.weight") == ("layers.0.mlp.experts.w2", 2)
    assert expert_checkpoint_param("layers.0.mlp.gate_proj.weight") is None
    for r in range(2):
        experts = Experts(n, hidden, inter, torch.nn.functional.silu, act_is_silu=True, tp=_Rank(r, 2))
        for e in range(n):
            _load(experts.w13, gate[e], 2 * e)
            _load(experts.w13, up[e], 2 * e + 1)
            _load(experts.w2, down[e], e)
        rows = slice(3 * r, 3 * r + 3)
        assert torch.equal(experts.w13, torch.cat([gate[:, rows], up[:, rows]], dim=1))
        assert torch.equal(experts.w2, down[:, :, rows])
        with pytest.raises(ValueError, match="the model has 3 experts"):
            _load(experts.w2, down[0], 3)
