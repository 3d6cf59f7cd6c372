"""LoRA deltas added to a linear's output, grouped over the adapters of one batch.

A base linear that some loaded adapter targets holds a ``LoRADelta`` (its ``lora``); the linear calls
``add(x, y)`` after its own matmul, whatever its weight method (float, packed, int8 / int4, GGUF blocks).
A fused projection (qkv_proj, gate_up_proj) is several checkpoint modules side by side: each adapter's
pieces are stacked, so one matmul ``x @ A_cat^T`` serves every piece and each piece's B writes its own
column range of the output.

``StepRows`` says which rows of this step belong to which adapter: the runner sets it before a forward
(``LoRAManager.begin_step``) and clears it after. The model's last layer may run on the kept rows only
(``keep_rows`` of the model's forward): a delta tells the two row sets apart by the row count. Requests
without an adapter are left out of every group; a step with no adapter rows adds nothing.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from radixlang.runtime.models.layers.linear import Piece


@dataclass(eq=False)
class StepRows:
    """This step's rows per adapter: (adapter id, row indices or None for every row) for the step's tokens
    and for its kept rows (the last layer's, when the model keeps fewer)."""
    token_groups: list[tuple[int, torch.Tensor | None]] = field(default_factory=list)
    num_tokens: int = 0
    kept_groups: list[tuple[int, torch.Tensor | None]] = field(default_factory=list)
    num_kept: int = -1

    def groups_for(self, num_rows: int) -> list[tuple[int, torch.Tensor | None]]:
        if num_rows == self.num_tokens:
            return self.token_groups
        if num_rows == self.num_kept:
            return self.kept_groups
        raise RuntimeError(f"a LoRA linear ran on {num_rows} rows; this step has {self.num_tokens} tokens and "
                           f"{self.num_kept} kept rows")

    @staticmethod
    def group(row_ids: torch.Tensor) -> list[tuple[int, torch.Tensor | None]]:
        """row_ids [n] int64 (-1: no adapter) -> [(adapter id, its rows, None when it has them all)]."""
        ids = sorted(int(i) for i in torch.unique(row_ids).tolist() if i >= 0)
        if len(ids) == 1 and bool((row_ids == ids[0]).all()):
            return [(ids[0], None)]
        return [(i, torch.nonzero(row_ids == i).flatten()) for i in ids]


@dataclass(frozen=True)
class _Stacked:
    """One adapter's weights on one linear: A_cat [sum r, in]; per piece (offset, size, rank start, rank end,
    B [size, rank] with the scaling folded in)."""
    a_cat: torch.Tensor
    pieces: tuple[tuple[int, int, int, int, torch.Tensor], ...]


class LoRADelta:
    """The LoRA deltas of one base linear: one stacked weight set per loaded adapter that targets it."""

    def __init__(self, rows: StepRowsRef, *, in_features: int, out_features: int) -> None:
        self.rows = rows
        self.in_features, self.out_features = in_features, out_features
        self.adapters: dict[int, _Stacked] = {}

    def set_adapter(self, adapter_id: int, parts: list[tuple[Piece, torch.Tensor, torch.Tensor]], *,
                    dtype: torch.dtype, device: str | torch.device) -> None:
        """parts: (piece, A [r, in], B [size, r] scaled) of every checkpoint module of this linear the adapter
        targets."""
        a_parts, pieces, start = [], [], 0
        for piece, a, b in sorted(parts, key=lambda p: p[0].offset):
            a_parts.append(a)
            pieces.append((piece.offset, piece.size, start, start + a.shape[0],
                           b.to(device=device, dtype=dtype).contiguous()))
            start += a.shape[0]
        a_cat = torch.cat(a_parts).to(device=device, dtype=dtype).contiguous()
        self.adapters[adapter_id] = _Stacked(a_cat, tuple(pieces))

    def drop_adapter(self, adapter_id: int) -> None:
        self.adapters.pop(adapter_id, None)

    def add(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y [..., out] += each adapter's delta on its rows of x [..., in]; returns y (changed in place, or a
        contiguous copy of it)."""
        step = self.rows.current
        if step is None or not self.adapters:
            return y
        if not y.is_contiguous():
            y = y.contiguous()
        x2, y2 = x.reshape(-1, self.in_features), y.view(-1, self.out_features)
        for adapter_id, rows in step.groups_for(x2.shape[0]):
            w = self.adapters.get(adapter_id)
            if w is None:  # this adapter leaves the linear as it is
                continue
            xa = x2 if rows is None else x2.index_select(0, rows)
            h = xa.to(w.a_cat.dtype) @ w.a_cat.T  # [n, sum r]
            for offset, size, r0, r1, b in w.pieces:
                d = (h[:, r0:r1] @ b.T).to(y2.dtype)  # [n, size]
                cols = y2.narrow(1, offset, size)
                if rows is None:
                    cols.add_(d)
                else:
                    cols.index_add_(0, rows, d)
        return y


class StepRowsRef:
    """The one holder of the current step's rows that every LoRADelta of a model reads."""

    def __init__(self) -> None:
        self.current: StepRows | None = None
