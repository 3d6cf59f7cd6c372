"""A LoRA adapter (float) on a GGUF-quantized base (Q8_0, Q5_0 and Q5_1 blocks, served natively): the
quantized server with the adapter gives what the same file dequantized to float32 gives with it, as
closely as the two bases agree without one, and the float32 server equals PEFT (tests/e2e/test_lora.py)."""
from __future__ import annotations

import gguf
import torch

from radixlang import Engine
from lora_adapters import save_peft_adapters
from test_gguf_families import _write_gguf
from tiny_model import save_tiny_hf_model

PROMPT = [1, 400, 2000, 7, 31000, 12, 99, 5, 48000, 3, 17, 250, 4096, 88]
Q = gguf.GGMLQuantizationType
# llama.cpp's mixes put Q5_0 / Q5_1 beside Q8_0 and the K types; q/k/v share one q8 layout
QUANT = {"attn_q": Q.Q8_0, "attn_k": Q.Q8_0, "attn_v": Q.Q5_0, "attn_output": Q.Q5_1, "ffn_gate": Q.Q8_0,
         "ffn_up": Q.Q8_0, "ffn_down": Q.Q5_0}


def _logprobs(engine: Engine, adapter: str | None) -> torch.Tensor:
    out = engine.generate(input_ids=PROMPT, sampling_params={"max_new_tokens": 4, "min_new_tokens": 4,
                                                             "temperature": 0},
                          return_logprob=True, logprob_start_len=0, lora_path=adapter)
    meta = out["meta_info"]
    return torch.tensor([lp for lp, _, _ in meta["input_token_logprobs"][1:]])


def test_adapter_on_a_quantized_gguf_base(tmp_path):
    folder = save_tiny_hf_model(str(tmp_path / "hf"), "LlamaForCausalLM", seed=5, hidden_size=128,
                                intermediate_size=256, num_attention_heads=8, head_dim=16)
    path = str(tmp_path / "tiny-q8.gguf")
    _write_gguf(folder, path, "llama", quant=QUANT)
    adapters = save_peft_adapters(folder, tmp_path)
    lora = [f"{n}={p}" for n, p in adapters.items()]
    got: dict[str, dict[str | None, torch.Tensor]] = {}
    for kind, opts in (("quantized", {}), ("float32", {"dtype": "float32"})):
        with Engine(model_path=path, lora_paths=lora, max_total_tokens=2048, **opts) as engine:
            if kind == "quantized":
                assert engine.get_server_info()["quantization"] == "gguf"
                layer = engine.scheduler.runner.model.layers[0]  # every linear from the file's blocks
                kinds = [layer.self_attn.qkv_proj.kernel.source_type, layer.self_attn.o_proj.kernel.source_type,
                         layer.mlp.down_proj.kernel.source_type]
                assert kinds == ["Q5_0/Q8_0", "Q5_1", "Q5_0"], kinds
            got[kind] = {a: _logprobs(engine, a) for a in (None, "r8", "r64")}
    base_gap = float((got["quantized"][None] - got["float32"][None]).abs().max())
    for adapter in ("r8", "r64"):
        quantized, dense = got["quantized"][adapter], got["float32"][adapter]
        assert float((dense - got["float32"][None]).abs().max()) > 0.1  # the adapter moves the logprobs
        assert float((quantized - dense).abs().max()) <= 2 * base_gap + 1e-3, adapter
