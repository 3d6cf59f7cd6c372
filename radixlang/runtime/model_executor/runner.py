"""Runner: what the scheduler needs of a model runner.

``ModelRunner`` is the real one; a test passes a scripted one (tests/runtime/scheduler/scripted_runner.py)
to ``Scheduler(args, runner=...)``. The scheduler owns both pools' bookkeeping (which slots
a request holds); the runner only reads and writes the slots a step names.
"""
from __future__ import annotations

from typing import Any, Protocol

import torch

from radixlang.runtime.lora.manager import LoRAManager
from radixlang.runtime.mem_cache.memory_pool import ReqToTokenPool, TokenToKVPool
from radixlang.runtime.model_executor.forward_batch import StepInputs


class Runner(Protocol):
    tokenizer: Any  # encode / decode (a transformers tokenizer, or anything with the same two calls)
    hf_config: Any  # read for eos_token_id
    vocab_size: int
    context_len: int  # max tokens of one request (prompt + output)
    max_running: int  # max requests in one batch
    req_to_token_pool: ReqToTokenPool
    kv_pool: TokenToKVPool
    model_dir: str  # the model's folder: an embedding server reads its pooling config there
    lora: LoRAManager | None  # the LoRA adapters it serves (--enable-lora), else None

    def forward(self, inputs: StepInputs) -> torch.Tensor:
        """Run one step; logits [len(inputs.logit_rows), vocab_size] float32 on the host.

        Row i scores the token after ``inputs.input_ids[inputs.logit_rows[i]]``. An embedding server's
        runner (--is-embedding) returns those rows' final hidden states instead, [len(logit_rows), hidden].
        """
        ...

    def shutdown(self) -> None:
        """Release what the runner started (tensor-parallel followers); idempotent."""
        ...
