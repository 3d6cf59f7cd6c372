"""Greedy decoding of the embedded SmolLM2 through the paged pool matches transformers' generate."""
from __future__ import annotations

import pytest
import torch

from radixlang.kernels.attention.base import ForwardMode
from radixlang.kernels.attention.torch_native import TorchNativeAttnBackend
from radixlang.runtime.model_executor.forward_batch import ForwardBatch
from radixlang.runtime.mem_cache.memory_pool import ReqToTokenPool, TokenToKVPool
from radixlang.runtime.models.llama import LlamaForCausalLM
from radixlang.runtime.models.loader.model_loader import load_model
from tiny_model import smollm_hf_model

PROMPTS = ("The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,")
NEW_TOKENS = 32


def _greedy(model: LlamaForCausalLM, ids: list[int], new_tokens: int) -> list[int]:
    """Prefill once (EXTEND), then one DECODE step per token, all through the KV pool."""
    cap = len(ids) + new_tokens + 1
    pool = TokenToKVPool(cap, num_layers=len(model.layers), num_kv_heads=model.num_kv_heads,
                         head_dim=model.head_dim, dtype=torch.float32, device="cpu")
    reqs = ReqToTokenPool(1, cap, "cpu")
    row = reqs.alloc(1)[0]
    backend = TorchNativeAttnBackend(model.num_heads, model.num_kv_heads, model.head_dim)
    out: list[int] = []
    tokens, prefix = list(ids), 0
    mode = ForwardMode.EXTEND
    while len(out) < new_tokens:
        n = len(tokens) - prefix
        loc = pool.alloc(n)
        assert loc is not None
        reqs.req_to_token[row, prefix:prefix + n] = loc.to(torch.int32)
        total = len(tokens)
        fb = ForwardBatch(forward_mode=mode, batch_size=1, input_ids=torch.tensor(tokens[prefix:]),
                          positions=torch.arange(prefix, total), req_pool_indices=torch.tensor([row]),
                          seq_lens=torch.tensor([total]), seq_lens_cpu=[total], extend_prefix_lens_cpu=[prefix],
                          extend_seq_lens_cpu=[n], out_cache_loc=loc, req_to_token=reqs.req_to_token,
                          token_to_kv_pool=pool, attn_backend=backend)
        backend.init_forward_metadata(fb)
        hidden = model(fb.input_ids, fb.positions, fb)  # [n, hidden]
        nxt = int(model.compute_logits(hidden[-1:]).argmax(-1))
        out.append(nxt)
        prefix = total
        tokens.append(nxt)
        mode = ForwardMode.DECODE
    return out


@pytest.mark.timeout(300)
def test_smollm_greedy_matches_transformers_generate(smollm_path):
    torch.manual_seed(0)
    loaded = load_model(smollm_path)
    hf = smollm_hf_model()
    for prompt in PROMPTS:
        ids = loaded.tokenizer.encode(prompt)
        ours = _greedy(loaded.model, ids, NEW_TOKENS)
        with torch.no_grad():
            ref = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                              max_new_tokens=NEW_TOKENS, do_sample=False,
                              pad_token_id=loaded.tokenizer.eos_token_id)
        ref_new = ref[0, len(ids):].tolist()  # generate stops early at EOS; ours runs on past it
        assert len(ref_new) >= 16, (prompt, ref_new)
        assert ours[:len(ref_new)] == ref_new, prompt
