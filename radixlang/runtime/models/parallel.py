"""Tensor-parallel layers: each rank holds a slice of a weight and the ranks combine results.

Megatron-style splits of the Llama block:
- column-parallel (fused q/k/v, fused gate/up): each rank owns some output features (its heads,
  its slice of the MLP) and needs no communication; it is a ``Linear`` of the local size,
  sharded at load time by ``shard_tensor``;
- row-parallel (o_proj, down_proj): each rank owns some input features, computes a partial sum,
  and the ranks all-reduce it;
- vocab-parallel embedding and logits: each rank owns a contiguous range of the (padded)
  vocabulary; lookups outside the range give zeros and are summed away by an all-reduce; the
  logits of every range are all-gathered into the full vocabulary.

The model builds these only when ``tp.size > 1``; a single rank keeps plain layers and no
communication at all. ``TPComm`` is the one thing the layers need from a process group, so tests can
run the ranks in threads.
"""
from __future__ import annotations

from itertools import accumulate
from typing import Protocol, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from radixlang.runtime.models.layers.linear import (Linear, LinearMethod, Piece, default_weight_loader,
                                                    set_weight_loader)


class TPComm(Protocol):
    """A tensor-parallel group as the layers see it. Every rank calls the same ops in the same order."""

    rank: int
    size: int

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of ``x`` over the ranks (may reuse ``x``'s storage)."""
        ...

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """The ranks' ``x`` [..., n] concatenated in rank order along the last dim -> [..., size * n]."""
        ...


def split_evenly(total: int, size: int, what: str) -> int:
    """Per-rank share of ``total`` units; a ValueError naming ``what`` when it does not divide."""
    if total % size:
        raise ValueError(f"tensor parallelism needs {what} divisible by tp_size: {total} {what} "
                         f"cannot be split over {size} ranks")
    return total // size


def kv_heads_per_rank(num_heads: int, num_kv_heads: int, size: int) -> tuple[int, int]:
    """(query heads, kv heads) held by each rank.

    Query heads are split evenly. KV heads are split evenly when there are at least as many as
    ranks; with fewer, each rank keeps the one kv head its query heads read (replicated), which
    needs ``size`` to be a multiple of the kv heads.
    """
    if num_heads % size:
        raise ValueError(f"tp_size {size} does not divide the model's {num_heads} attention heads "
                         f"({num_kv_heads} kv heads); uneven head splits are not supported, "
                         f"use a tp_size that divides {num_heads}")
    if num_kv_heads >= size:
        if num_kv_heads % size:
            raise ValueError(f"tp_size {size} does not divide the model's {num_kv_heads} kv heads "
                             f"({num_heads} attention heads)")
        return num_heads // size, num_kv_heads // size
    if size % num_kv_heads:
        raise ValueError(f"tp_size {size} is larger than the model's {num_kv_heads} kv heads but not a "
                         f"multiple of them, so kv heads cannot be replicated evenly")
    return num_heads // size, 1


def kv_head_range(num_kv_heads: int, rank: int, size: int) -> tuple[int, int]:
    """[first, end) of the full model's kv heads that ``rank`` holds."""
    if num_kv_heads >= size:
        per = num_kv_heads // size
        return rank * per, (rank + 1) * per
    first = rank * num_kv_heads // size  # ranks sharing a replicated head are adjacent
    return first, first + 1


def shard_tensor(x: torch.Tensor, rank: int, size: int, *, dim: int = 0) -> torch.Tensor:
    """The ``rank``-th of ``size`` equal slices of ``x`` along ``dim`` (a view)."""
    n = x.shape[dim]
    assert n % size == 0, f"dim {dim} of size {n} does not split over {size} ranks"
    per = n // size
    return x.narrow(dim, rank * per, per)


def padded_vocab(vocab_size: int, size: int) -> int:
    """The vocabulary rounded up so every rank holds the same number of rows."""
    return -(-vocab_size // size) * size


def shard_vocab(x: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """Rows of an embedding / lm_head [vocab, hidden] for ``rank``, zero-padded past the vocabulary."""
    per = padded_vocab(x.shape[0], size) // size
    start = rank * per
    rows = x[start:start + per]
    if rows.shape[0] < per:
        rows = torch.cat([rows, rows.new_zeros(per - rows.shape[0], *rows.shape[1:])])
    return rows


class RowParallelLinear(Linear):
    """y = x W^T summed over ranks: each rank holds ``in_features / size`` input columns of W. Its method
    (the plain float one: WeightMethods.row_parallel; or a GGUF file's blocks, whole input groups a rank:
    models/gguf_quant.py) multiplies without the bias, which is whole on every rank and added once, after
    the sum."""

    def __init__(self, in_features: int, out_features: int, *, tp: TPComm, bias: bool = False,
                 method: LinearMethod | None = None) -> None:
        super().__init__(split_evenly(in_features, tp.size, "input features"), out_features, bias=bias,
                         method=method)
        self.tp = tp
        self.set_weight_loader(RowLoader(tp))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x [n, in_features / size] -> [n, out_features]
        y = self.tp.all_reduce(self.method.apply(self, x, with_bias=False))
        return y if self.bias is None else y + self.bias

    def partial_sum(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's term of ``forward`` (the bias in rank 0's): the caller all-reduces."""
        y = self.method.apply(self, x, with_bias=False)
        return y if self.bias is None or self.tp.rank != 0 else y + self.bias


class VocabParallelEmbedding(nn.Embedding):
    """Each rank holds rows [rank * per, (rank + 1) * per) of the padded vocabulary."""

    def __init__(self, vocab_size: int, hidden: int, *, tp: TPComm) -> None:
        self.per_rank = padded_vocab(vocab_size, tp.size) // tp.size
        super().__init__(self.per_rank, hidden)
        set_weight_loader(self.weight, VocabLoader(tp))
        self.tp = tp
        self.vocab_size = vocab_size
        self.start = tp.rank * self.per_rank

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        # ids [n] int64 -> [n, hidden]; ids outside this rank's range look up row 0 and are zeroed
        local = ids - self.start
        outside = (local < 0) | (local >= self.per_rank)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.tp.all_reduce(out.masked_fill_(outside[:, None], 0.0))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [n, hidden] -> logits [n, vocab_size] over the full vocabulary (tied weights)."""
        return vocab_parallel_logits(hidden, self.weight, self.tp, self.vocab_size)


class ParallelLMHead(nn.Module):
    """An untied lm_head split by vocabulary rows like ``VocabParallelEmbedding``."""

    def __init__(self, vocab_size: int, hidden: int, *, tp: TPComm) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(padded_vocab(vocab_size, tp.size) // tp.size, hidden))
        set_weight_loader(self.weight, VocabLoader(tp))
        self.tp = tp
        self.vocab_size = vocab_size

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_logits(hidden, self.weight, self.tp, self.vocab_size)


class VocabParallelHead(Linear):
    """A logits projection split by vocabulary rows as ``ParallelLMHead`` is (``padded_vocab / size`` rows
    a rank, zero past the vocabulary), whose rows are held and multiplied by a weight method of its own (a
    GGUF file's blocks: models/gguf_quant.py); the ranks' logits are all-gathered."""

    def __init__(self, vocab_size: int, hidden: int, *, tp: TPComm, method: LinearMethod) -> None:
        super().__init__(hidden, padded_vocab(vocab_size, tp.size) // tp.size, method=method)
        self.tp, self.vocab_size = tp, vocab_size

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        # hidden [n, hidden] -> this rank's [n, per_rank] -> gathered [n, padded] -> [n, vocab]
        return self.tp.all_gather(super().forward(hidden).contiguous())[:, :self.vocab_size]


def vocab_parallel_logits(hidden: torch.Tensor, weight: torch.Tensor, tp: TPComm, vocab_size: int) -> torch.Tensor:
    # hidden [n, hidden] x weight [per_rank, hidden] -> [n, per_rank] -> gathered [n, padded] -> [n, vocab]
    local = F.linear(hidden, weight)
    return tp.all_gather(local.contiguous())[:, :vocab_size]


def column_part_rows(part: str, rows: int, tp: TPComm, *, num_kv_heads: int) -> tuple[int, int]:
    """[first, end) of the ``rows`` output rows of one part of a column-parallel projection that ``tp.rank``
    holds: for a ``k`` or ``v`` part its kv heads (``kv_head_range``, replicated when fewer than ranks), for
    any other (q, gate, up) its even share. The rule ``ColumnLoader`` applies to float checkpoint tensors,
    for weights that are not float tensors (a quantized GGUF's blocks: models/gguf_quant.py)."""
    if part in ("k", "v"):
        head_dim = rows // num_kv_heads
        first, end = kv_head_range(num_kv_heads, tp.rank, tp.size)
        return first * head_dim, end * head_dim
    per = split_evenly(rows, tp.size, f"{part} rows")
    return tp.rank * per, (tp.rank + 1) * per


class ColumnLoader:
    """The ``weight_loader`` of a column-parallel parameter (a linear's weight [out, in] and bias [out], or
    any weight split by output rows). It holds one checkpoint piece, or several side by side (q, k, v in
    qkv_proj; gate, up in gate_up_proj): ``parts`` names each with its rows on this rank, in shard order.
    Piece ``shard`` fills its rows of the parameter (``pieces[shard]``) with this rank's rows of the full
    checkpoint tensor (``column_part_rows``: its kv heads for ``k`` and ``v``, an even share for any other
    part; every row without ``tp``). A tensor of no piece (``shard`` None) fills the whole parameter: one
    piece, or an already fused tensor without tensor parallelism (Phi-3's qkv_proj)."""

    def __init__(self, parts: Sequence[tuple[str, int]], tp: TPComm | None, *, num_kv_heads: int = 0) -> None:
        if not parts:
            raise ValueError("a column-parallel parameter needs at least one checkpoint piece")
        self.names = tuple(name for name, _ in parts)
        sizes = [size for _, size in parts]
        self.pieces = tuple(Piece(offset, size) for offset, size in zip(accumulate([0] + sizes[:-1]), sizes))
        self.tp, self.num_kv_heads = tp, num_kv_heads

    def __call__(self, param: nn.Parameter, tensor: torch.Tensor, shard: int | None = None) -> None:
        # tensor [rows of the full checkpoint piece(s), ...] -> param [rows on this rank, ...]
        if shard is None and len(self.pieces) > 1:
            if self.tp is not None:
                raise ValueError(f"a tensor-parallel parameter fused of {', '.join(self.names)} takes its checkpoint "
                                 f"pieces one at a time: cut the fused tensor into them first (llama.unfused_pieces)")
            part, (offset, size), (first, end) = "fused", Piece(0, param.shape[0]), (0, tensor.shape[0])
        else:
            shard = 0 if shard is None else shard
            if not 0 <= shard < len(self.pieces):
                raise ValueError(f"checkpoint piece {shard} of a parameter fused of {len(self.pieces)} pieces")
            part, (offset, size) = self.names[shard], self.pieces[shard]
            first, end = self._rank_rows(shard, tensor.shape[0])
        if end - first != size:
            raise ValueError(f"the checkpoint's {part} tensor of {tensor.shape[0]} rows gives this rank {end - first} "
                             f"rows, where the model holds {size}: does the config match the checkpoint?")
        param.data[offset:offset + size].copy_(tensor[first:end])

    def _rank_rows(self, shard: int, rows: int) -> tuple[int, int]:
        """[first, end) of a full tensor's ``rows`` that this rank keeps of piece ``shard``."""
        if self.tp is None:
            return 0, rows
        return column_part_rows(self.names[shard], rows, self.tp, num_kv_heads=self.num_kv_heads)


class RowLoader:
    """The ``weight_loader`` of a row-parallel linear: this rank's input columns of the weight [out, in]; a
    bias [out] whole (added once, after the ranks' sum)."""

    def __init__(self, tp: TPComm) -> None:
        self.tp = tp

    def __call__(self, param: nn.Parameter, tensor: torch.Tensor, shard: int | None = None) -> None:
        if tensor.dim() > 1:
            split_evenly(tensor.shape[1], self.tp.size, "input features")
            tensor = shard_tensor(tensor, self.tp.rank, self.tp.size, dim=1)
        default_weight_loader(param, tensor, shard)


class VocabLoader:
    """The ``weight_loader`` of a vocabulary-parallel table (embedding, lm_head): this rank's rows of the
    padded vocabulary (``shard_vocab``)."""

    def __init__(self, tp: TPComm) -> None:
        self.tp = tp

    def __call__(self, param: nn.Parameter, tensor: torch.Tensor, shard: int | None = None) -> None:
        default_weight_loader(param, shard_vocab(tensor, self.tp.rank, self.tp.size), shard)


def column_linear(in_features: int, parts: Sequence[tuple[str, int]], tp: TPComm | None, method: LinearMethod, *,
                  bias: bool = False, num_kv_heads: int = 0) -> Linear:
    """A column-parallel linear of one or more checkpoint pieces side by side (``parts``: name and rows on
    this rank, as ``ColumnLoader`` takes them); whole without ``tp``. Its ``pieces`` say where each piece's
    output columns lie (LoRA reads them: llama.lora_target)."""
    loader = ColumnLoader(parts, tp, num_kv_heads=num_kv_heads)
    linear = Linear(in_features, sum(size for _, size in parts), bias=bias, method=method)
    linear.set_weight_loader(loader)
    linear.pieces = loader.pieces
    return linear
