"""The tensor-parallel process group and the step message rank 0 broadcasts to its followers.

One torch.distributed group spans the ranks (gloo on the CPU, nccl on CUDA). Messages are int64
tensors only, never pickled objects: a fixed-size header saying what follows, then one payload
tensor whose length the header fixes. Every rank makes the same calls in the same order.
"""
from __future__ import annotations

import datetime
import socket

import torch
import torch.distributed as dist

from radixlang.kernels.attention.base import ForwardMode
from radixlang.runtime.model_executor.forward_batch import StepInputs

# an idle server sends nothing for hours: a follower waiting for the next step must not time out
_COLLECTIVE_TIMEOUT = datetime.timedelta(days=30)

MSG_STOP, MSG_STEP = 0, 1
HEADER_LEN = 6  # [kind, forward mode, batch size, num tokens, num logit rows, num changed req_to_token entries]


class DistComm:
    """A TPComm over the default torch.distributed group of this process."""

    def __init__(self, rank: int, size: int, device: str) -> None:
        self.rank, self.size = rank, size
        # nccl moves device tensors only; gloo moves host tensors
        self.comm_device = "cuda" if device == "cuda" else "cpu"

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(x)
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x)
        return torch.cat(parts, dim=-1)

    def broadcast_ints(self, values: list[int]) -> list[int]:
        """Rank 0's ``values`` on every rank (the others pass a list of the same length)."""
        t = torch.tensor(values, dtype=torch.int64, device=self.comm_device)
        dist.broadcast(t, src=0)
        return t.tolist()

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


def init_group(*, rank: int, size: int, init_addr: str, device: str) -> DistComm:
    """Join the tensor-parallel group at ``init_addr`` (host:port of rank 0); blocks until all ranks join."""
    if dist.is_initialized():
        raise RuntimeError("this process already belongs to a torch.distributed group: one tensor-parallel "
                           "engine per process (shut the other one down first)")
    backend = "nccl" if device == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://{init_addr}", rank=rank, world_size=size,
                            timeout=_COLLECTIVE_TIMEOUT)
    return DistComm(rank, size, device)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- the step message ----------------------------------------------------------------------------
def req_to_token_changes(req_to_token: torch.Tensor, sent: torch.Tensor, req_pool_indices: torch.Tensor,
                         seq_lens: list[int]) -> torch.Tensor:
    """The req_to_token entries the batch reads that differ from what the followers hold, as [3, n] int64
    (row, column, slot) on the host; ``sent`` (rank 0's copy of the followers' table, same shape and device
    as ``req_to_token``) is brought up to date.

    Mostly the step's new slots, one per request in decode; whatever rank 0 rewrote between steps comes too
    (a radix-cache insert points a running request at the tree's copy of its prefix and frees its duplicate
    slots for reuse; a reused request row holds the previous request's entries), so the followers read the
    same KV slots as rank 0. The rows are compared where they live; only the changes cross the group.
    """
    dev = req_to_token.device
    width = max(seq_lens, default=0)
    rows = req_pool_indices.to(device=dev, dtype=torch.int64)
    cur = req_to_token[rows, :width]  # [bs, width] int32
    lens = torch.tensor(seq_lens, dtype=torch.int64, device=dev)
    changed = (cur != sent[rows, :width]) & (torch.arange(width, device=dev)[None, :] < lens[:, None])
    at = changed.nonzero()  # [n, 2]: (batch row, column); one device-to-host sync for the count
    row_ids, cols = rows[at[:, 0]], at[:, 1]
    values = cur[at[:, 0], cols]
    sent[row_ids, cols] = values
    return torch.stack([row_ids, cols, values.to(torch.int64)]).cpu()


def send_step(comm: DistComm, inputs: StepInputs, req_to_token: torch.Tensor, sent: torch.Tensor) -> None:
    """Rank 0: broadcast one forward's inputs and the req_to_token entries the batch reads that changed since
    the followers last got them (``req_to_token_changes``)."""
    seq_lens = torch.tensor(inputs.seq_lens, dtype=torch.int64)
    # the payload is built on the host (out_cache_loc and req_to_token may be on the device) and moved once
    changes = req_to_token_changes(req_to_token, sent, inputs.req_pool_indices, inputs.seq_lens)
    header = [MSG_STEP, int(inputs.mode), len(inputs.seq_lens), int(inputs.input_ids.numel()),
              int(inputs.logit_rows.numel()), int(changes.shape[1])]
    payload = torch.cat([inputs.input_ids, inputs.positions, inputs.req_pool_indices, seq_lens,
                         torch.tensor(inputs.prefix_lens, dtype=torch.int64),
                         torch.tensor(inputs.extend_lens, dtype=torch.int64),
                         torch.tensor(inputs.prompt_lens or [0] * len(inputs.seq_lens), dtype=torch.int64),
                         inputs.out_cache_loc.to(device="cpu", dtype=torch.int64),
                         inputs.logit_rows.to(device="cpu", dtype=torch.int64),
                         changes.flatten()])
    dist.broadcast(torch.tensor(header, dtype=torch.int64, device=comm.comm_device), src=0)
    dist.broadcast(payload.to(comm.comm_device), src=0)


def send_stop(comm: DistComm) -> None:
    header = [MSG_STOP] + [0] * (HEADER_LEN - 1)
    dist.broadcast(torch.tensor(header, dtype=torch.int64, device=comm.comm_device), src=0)


def recv_step(comm: DistComm) -> tuple[StepInputs, torch.Tensor] | None:
    """Followers: the next step's inputs and the changed req_to_token entries [3, n] int64 (row, column,
    slot); None at stop."""
    header = torch.empty(HEADER_LEN, dtype=torch.int64, device=comm.comm_device)
    dist.broadcast(header, src=0)
    kind, mode, bs, num_tokens, num_rows, num_r2t = header.tolist()
    if kind == MSG_STOP:
        return None
    if kind != MSG_STEP:
        raise RuntimeError(f"unknown tensor-parallel message kind {kind}")
    sizes = [num_tokens, num_tokens, bs, bs, bs, bs, bs, num_tokens, num_rows, 3 * num_r2t]
    payload = torch.empty(sum(sizes), dtype=torch.int64, device=comm.comm_device)
    dist.broadcast(payload, src=0)
    (input_ids, positions, req_pool_indices, seq_lens, prefix_lens, extend_lens, prompt_lens, out_cache_loc,
     logit_rows, r2t) = payload.cpu().split(sizes)
    inputs = StepInputs(mode=ForwardMode(mode), input_ids=input_ids, positions=positions,
                        req_pool_indices=req_pool_indices, seq_lens=seq_lens.tolist(),
                        prefix_lens=prefix_lens.tolist(), extend_lens=extend_lens.tolist(),
                        out_cache_loc=out_cache_loc, logit_rows=logit_rows,
                        prompt_lens=prompt_lens.tolist() if bool(prompt_lens.any()) else None)
    return inputs, r2t.view(3, num_r2t)
