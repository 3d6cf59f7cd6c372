"""A model runner without a model, for Scheduler unit tests.

``ScriptedRunner`` satisfies ``model_executor.runner.Runner`` with real pools of a few slots. Its
"model" reads the KV pool: a forward writes each input token id into its KV slot (layer 0's key
buffer), and the next token of a sequence is a function of every token id stored in that
sequence's KV row. So the sampled tokens are known in advance (``next_token``), and they change
if the scheduler hands the runner wrong slots, wrong positions or a stale prefix (after a
retraction, a prefix-cache hit or a chunked prefill).

``script`` replaces the rule: it gets (call number, sequence so far) and returns the token id the
"model" favours (or, for a test of sampling, a whole logits row). The runner then does what a model
runner does after its forward: the shared sampling code (sampling/step_sampler.py) applies the plan's
grammar masks and bans and chooses the tokens, so masks and min_new_tokens are honoured. ``calls``
records every step's inputs, ``plans`` every step's plan.
"""
from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace

import torch

from radixlang.kernels.attention.base import ForwardMode
from radixlang.runtime.mem_cache.memory_pool import ReqToTokenPool, TokenToKVPool
from radixlang.runtime.model_executor.forward_batch import StepInputs
from radixlang.runtime.sampling.step_io import StepOutput, StepPlan
from radixlang.runtime.sampling.step_sampler import run_plan

EOS = 0
CHARS = "abcdefghijklmnopqrstuvwxyz01234"  # token i (1..31) spells CHARS[i - 1]
VOCAB = len(CHARS) + 1


class CharTokenizer:
    """One character per token; id 0 is EOS ("</s>", special)."""

    eos_token_id = EOS
    all_special_tokens = ("</s>",)

    def get_vocab(self) -> dict[str, int]:
        return {"</s>": EOS, **{c: i + 1 for i, c in enumerate(CHARS)}}

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [CHARS.index(c) + 1 for c in text]

    def decode(self, ids: list[int], skip_special_tokens: bool = True, **_: object) -> str:
        return "".join(CHARS[i - 1] if i != EOS else ("" if skip_special_tokens else "</s>") for i in ids)

    def __len__(self) -> int:
        return VOCAB


def next_token(seq: list[int]) -> int:
    """The default rule: a non-EOS token that depends on every token of ``seq`` and its position."""
    return 1 + sum((j + 1) * t for j, t in enumerate(seq)) % (VOCAB - 1)


def greedy_continuation(prompt: list[int], n: int) -> list[int]:
    """The tokens greedy decoding produces under the default rule."""
    seq = list(prompt)
    for _ in range(n):
        seq.append(next_token(seq))
    return seq[len(prompt):]


def one_hot(token: int, *, value: float = 10.0) -> torch.Tensor:
    row = torch.zeros(VOCAB, dtype=torch.float32)
    row[token] = value
    return row


Script = Callable[[int, list[int]], "int | torch.Tensor"]


class ScriptedRunner:
    def __init__(self, *, kv_size: int = 64, max_running: int = 8, context_len: int = 64,
                 script: Script | None = None, seed: int = 0) -> None:
        self.tokenizer = CharTokenizer()
        self.hf_config = SimpleNamespace(eos_token_id=EOS, vocab_size=VOCAB)
        self.vocab_size = VOCAB
        self.context_len = context_len
        self.max_running = max_running
        self.req_to_token_pool = ReqToTokenPool(max_running + 2, context_len + 8, "cpu")
        self.kv_pool = TokenToKVPool(kv_size, num_layers=1, num_kv_heads=1, head_dim=1, dtype=torch.float32,
                                     device="cpu")
        self.script = script
        self.calls: list[StepInputs] = []
        self.plans: list[StepPlan] = []
        self.lora = None  # no LoRA adapters (a scheduler test of LoRA batching passes its own manager)
        self.generator = torch.Generator().manual_seed(seed)

    def rope_length_key(self, prompt_len: int) -> tuple | None:
        return None  # every prompt takes the per-position rows

    def execute(self, inputs: StepInputs, plan: StepPlan) -> StepOutput:
        self.plans.append(plan)
        return run_plan(self._logits(inputs), plan, self.generator)

    def _logits(self, inputs: StepInputs) -> torch.Tensor:
        self.calls.append(inputs)
        loc = inputs.out_cache_loc
        if loc.numel() != inputs.input_ids.numel() or bool((loc <= 0).any()):
            raise AssertionError(f"bad out_cache_loc {loc.tolist()} for {inputs.input_ids.numel()} tokens")
        keys = self.kv_pool.k_buffer[0]  # [size + 1, 1, 1]: token id per KV slot
        keys[loc, 0, 0] = inputs.input_ids.to(torch.float32)
        rows = []
        for r in inputs.logit_rows.tolist():
            b = self._owner(inputs, r)
            pos = int(inputs.positions[r])
            slots = self.req_to_token_pool.req_to_token[int(inputs.req_pool_indices[b]), :pos + 1].to(torch.int64)
            seq = [int(t) for t in keys[slots, 0, 0].tolist()]
            picked = self.script(len(self.calls) - 1, seq) if self.script else next_token(seq)
            rows.append(picked if isinstance(picked, torch.Tensor) else one_hot(picked))
        return torch.stack(rows) if rows else torch.empty(0, VOCAB)

    @staticmethod
    def _owner(inputs: StepInputs, row: int) -> int:
        if inputs.mode is ForwardMode.DECODE:
            return row
        end = 0
        for b, n in enumerate(inputs.extend_lens):
            end += n
            if row < end:
                return b
        raise AssertionError(f"logit row {row} past the batch's {end} tokens")

    def shutdown(self) -> None:
        pass
