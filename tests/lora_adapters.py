"""LoRA adapters PEFT itself saves, and PEFT's log-probabilities: the reference of tests/e2e/test_lora.py and
tests/runtime/models/test_gguf_lora.py."""
from __future__ import annotations

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# name -> LoraConfig keywords: the ranks the issue names, rslora, a per-module alpha, a partial target set
ADAPTERS = {
    "r8": dict(r=8, lora_alpha=16, target_modules=TARGETS),
    "r16": dict(r=16, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], use_rslora=True),
    "r64": dict(r=64, lora_alpha=32, target_modules=TARGETS, alpha_pattern={"o_proj": 128}),
}


def save_peft_adapters(base: str, root, *, seed: int = 0) -> dict[str, str]:
    """ADAPTERS saved by PEFT over ``base``: name -> folder."""
    paths = {}
    for i, (name, kw) in enumerate(ADAPTERS.items()):
        torch.manual_seed(seed + i)
        model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
        peft_model = get_peft_model(model, LoraConfig(init_lora_weights=False, **kw))
        with torch.no_grad():  # B drawn large enough that every adapter moves the logits by ~1 nat
            for pname, p in peft_model.named_parameters():
                if "lora_B" in pname:
                    p.copy_(0.5 * torch.randn_like(p))
        path = str(root / name)
        peft_model.save_pretrained(path)
        paths[name] = path
    return paths


def reference_logprobs(base: str, adapter: str | None, ids: list[int]) -> torch.Tensor:
    """PEFT's log p(ids[i] | ids[:i]) for i >= 1."""
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter).eval()
    with torch.no_grad():
        logp = model(torch.tensor([ids])).logits[0].float().log_softmax(-1)
    return logp[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
