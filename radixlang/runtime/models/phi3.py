"""Phi-3 / Phi-3.5 / Phi-4-mini: the Llama decoder; the checkpoint already holds q/k/v fused as
``qkv_proj`` and gate/up as ``gate_up_proj`` (our own layout, so they load as they are); longrope and
partial rotary come from the config (layers/rotary.py)."""
from __future__ import annotations

from typing import Any

from radixlang.runtime.models.llama import LlamaForCausalLM
from radixlang.runtime.models.parallel import TPComm


class Phi3ForCausalLM(LlamaForCausalLM):
    def __init__(self, config: Any, *, tp: TPComm | None = None, **kw: Any) -> None:
        if tp is not None:  # the fused checkpoint tensors would need cutting per head before the rank slice
            raise ValueError("Phi3ForCausalLM does not run with tensor parallelism yet (tp_size must be 1)")
        super().__init__(config, tp=tp, **kw)
