"""Runner: what the scheduler needs of a model runner.

``ModelRunner`` is the real one; a test passes a scripted one (tests/runtime/scheduler/scripted_runner.py)
to ``Scheduler(args, runner=...)``. As vLLM v1 splits it: the scheduler decides the batch and its plan
(grammar bitmasks included); the runner executes it, samples (or verifies drafts) and returns token ids
and the logprobs asked for; the scheduler only does bookkeeping from that output. The scheduler owns both
pools' bookkeeping (which slots a request holds); the runner only reads and writes the slots a step names.
"""
from __future__ import annotations

from typing import Any, Protocol

import torch

from radixlang.runtime.lora.manager import LoRAManager
from radixlang.runtime.mem_cache.memory_pool import ReqToTokenPool, TokenToKVPool
from radixlang.runtime.model_executor.forward_batch import StepInputs
from radixlang.runtime.sampling.step_io import StepOutput, StepPlan


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
    generator: torch.Generator  # the draws of requests without a sampling_seed (seeded with --random-seed)

    def execute(self, inputs: StepInputs, plan: StepPlan) -> StepOutput:
        """Run one step and choose its tokens: one ``ReqOutput`` per ``plan.reqs`` (sampling/step_io.py).

        Logit row i scores the token after ``inputs.input_ids[inputs.logit_rows[i]]``; the plan names rows
        by i. An embedding server's runner (--is-embedding) returns those rows' final hidden states
        instead, [len(logit_rows), hidden] in ``StepOutput.hidden``, and chooses nothing.
        """
        ...

    def rope_length_key(self, prompt_len: int) -> tuple | None:
        """None when a prompt of this length takes the per-position rotary rows; else a key naming the rows
        it takes (prompts share KV only under equal keys: the radix tree's namespace)."""
        ...

    def shutdown(self) -> None:
        """Release what the runner started (tensor-parallel followers); idempotent."""
        ...
