"""Every supported family against transformers: a tiny checkpoint saved by transformers' own class
(tests/tiny_model.py: norms perturbed, heads != kv heads, sliding windows shorter than the prompts)
gives transformers' prompt log-probabilities within 1e-4 and its greedy tokens, through the model alone
(torch and CPU attention backends) and through the Engine: alone, batched, and after a cached prefix."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from radixlang.runtime.models.loader.model_loader import load_model
from test_models import _run_ours
from tiny_model import FAMILIES, WINDOW, save_tiny_hf_model

PROMPTS = ([1, 400, 2000, 7, 31000, 12, 99, 5, 48000, 3, 17, 250, 4096, 88],
           list(range(300, 321)),
           [9, 8, 7, 6, 5, 4, 3, 2, 1000, 2000, 3000])
NEW_TOKENS = 6


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory):
    arch, overrides = FAMILIES[request.param]
    folder = save_tiny_hf_model(str(tmp_path_factory.mktemp(request.param)), arch, seed=11, **overrides)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return request.param, folder, hf


def _hf_logprobs(hf, ids: list[int]) -> torch.Tensor:
    """log p(ids[i] | ids[:i]) for i >= 1, [len(ids) - 1]."""
    with torch.no_grad():
        logp = hf(torch.tensor([ids])).logits[0].float().log_softmax(-1)
    return logp[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]


def _hf_greedy(hf, ids: list[int]) -> list[int]:
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                          max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
    return out[0, len(ids):].tolist()


@pytest.mark.parametrize("cpu_kernels", [False, True], ids=["torch_backend", "cpu_backend"])
def test_prompt_logprobs_match_transformers(family, cpu_kernels):
    name, folder, hf = family
    model = load_model(folder).model
    assert type(model).__name__ == FAMILIES[name][0]
    for ids in PROMPTS:
        # with the CPU backend the last token is a DECODE step: both attention paths are checked
        logits = _run_ours(model, ids, decode_last=cpu_kernels, cpu_kernels=cpu_kernels)
        ours = logits.log_softmax(-1)[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
        ref = _hf_logprobs(hf, ids)
        assert (ours - ref).abs().max().item() < 1e-4, (name, (ours - ref).abs())


def _input_logprobs(out: dict) -> torch.Tensor:
    return torch.tensor([lp for lp, _, _ in out["meta_info"]["input_token_logprobs"] if lp is not None])


def test_engine_alone_batched_and_cached_prefix_match_transformers(family):
    from radixlang import Engine
    name, folder, hf = family
    greedy = {"max_new_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}
    refs = [_hf_greedy(hf, ids) for ids in PROMPTS]
    with Engine(model_path=folder, max_total_tokens=2048) as engine:
        alone = engine.generate(input_ids=PROMPTS[0], sampling_params=greedy, return_logprob=True,
                                logprob_start_len=0)
        ours = _input_logprobs(alone)
        ref = _hf_logprobs(hf, PROMPTS[0])
        assert len(ours) == len(ref) and (ours - ref).abs().max().item() < 1e-4, name
        assert _tokens(alone) == refs[0], name
        batch = engine.generate(input_ids=list(PROMPTS), sampling_params=greedy)
        assert [_tokens(o) for o in batch] == refs, name
        # the first prompt is cached now: a longer prompt starting with it reuses its KV
        longer = PROMPTS[0] + [5, 6, 7, 8, 9, 10, 11]
        cached = engine.generate(input_ids=longer, sampling_params=greedy, return_logprob=True,
                                 logprob_start_len=len(PROMPTS[0]))
        assert cached["meta_info"]["cached_tokens"] >= len(PROMPTS[0]) - 1, name
        tail = _input_logprobs(cached)
        ref_tail = _hf_logprobs(hf, longer)[-len(tail):]
        assert len(tail) >= 6 and (tail - ref_tail).abs().max().item() < 1e-4, name
        assert _tokens(cached) == _hf_greedy(hf, longer), name


def _tokens(out: dict) -> list[int]:
    return list(out["output_ids"])


# Qwen2 over the config space transformers 5 accepts (issue 43): its own defaults (no head_dim, no window,
# untied head), a tied head, windows on the layers past max_window_layers, windows asked for but on no
# layer (max_window_layers 28 > 3 layers), head_dim apart from hidden / heads, one kv head; biases random
QWEN2_BASE = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2)
QWEN2_SWEEP = {
    "defaults": {},
    "tied": dict(tie_word_embeddings=True),
    "window_layers": dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1),
    "window_on_no_layer": dict(use_sliding_window=True, sliding_window=WINDOW),
    "head_dim_24": dict(head_dim=24),
    "one_kv_head": dict(num_attention_heads=8, num_key_value_heads=1, tie_word_embeddings=True),
}
TEXT_PROMPTS = ["The capital of France is", "def fib(n):\n    return", "1, 2, 3, 5, 8, 13, 21, 34,"]


@pytest.mark.parametrize("case", sorted(QWEN2_SWEEP))
def test_qwen2_config_sweep_matches_transformers_on_text_prompts(tmp_path, case):
    """The checkpoint as transformers saves it (generation_config.json included), prompts as text: the
    Engine tokenizes them and answers transformers' greedy tokens; the model gives its log-probabilities
    on both attention backends."""
    from transformers import AutoTokenizer

    from radixlang import Engine
    folder = save_tiny_hf_model(str(tmp_path / case), "Qwen2ForCausalLM", seed=3, base=QWEN2_BASE,
                                **QWEN2_SWEEP[case])
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    layer_types = hf.config.layer_types
    assert ("sliding_attention" in layer_types) == (case == "window_layers"), layer_types
    want_head_dim = 24 if case == "head_dim_24" else 64 // hf.config.num_attention_heads
    assert hf.model.layers[0].self_attn.head_dim == want_head_dim
    model = load_model(folder).model
    for cpu_kernels in (False, True):
        logits = _run_ours(model, PROMPTS[0], decode_last=cpu_kernels, cpu_kernels=cpu_kernels)
        ours = logits.log_softmax(-1)[torch.arange(len(PROMPTS[0]) - 1), torch.tensor(PROMPTS[0][1:])]
        assert (ours - _hf_logprobs(hf, PROMPTS[0])).abs().max().item() < 1e-4, (case, cpu_kernels)
    tok = AutoTokenizer.from_pretrained(folder)
    refs = [_hf_greedy(hf, tok(t).input_ids) for t in TEXT_PROMPTS]
    greedy = {"max_new_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}
    with Engine(model_path=folder, max_total_tokens=2048) as engine:
        outs = engine.generate(prompt=TEXT_PROMPTS, sampling_params=greedy)
    assert [_tokens(o) for o in outs] == refs, case


def test_backend_without_a_feature_is_refused_naming_both(tmp_path):
    from radixlang.kernels.attention.base import AttentionBackend
    from radixlang.kernels.attention.cpu_backend import CpuAttnBackend
    from radixlang.kernels.attention.torch_native import TorchNativeAttnBackend
    from radixlang.runtime.models.layers.attention_config import attention_features, check_backend_features
    arch, overrides = FAMILIES["mistral_sliding"]
    sliding = load_model(save_tiny_hf_model(str(tmp_path / "s"), arch, **overrides)).model
    plain = load_model(save_tiny_hf_model(str(tmp_path / "p"), "LlamaForCausalLM")).model
    assert attention_features(sliding) == {"sliding_window"} and attention_features(plain) == set()
    with pytest.raises(ValueError, match="sliding_window.*'flashinfer' attention backend"):
        check_backend_features(sliding, AttentionBackend(), "flashinfer")
    check_backend_features(plain, AttentionBackend(), "flashinfer")
    for cls in (TorchNativeAttnBackend, CpuAttnBackend):  # the CPU one through the torch fallback
        assert {"sliding_window", "logit_softcap", "sinks"} <= cls.supported_features


def test_moe_dispatch_spreads_tokens_unevenly_one_matmul_per_expert(family, monkeypatch):
    """Each expert with tokens runs once over all of its tokens (never once per token); the test
    checkpoints route unevenly."""
    from radixlang.runtime.models import gpt_oss
    from radixlang.runtime.models.layers import moe
    name, folder, _ = family
    if "moe" not in name and name not in ("mixtral", "gpt_oss"):
        pytest.skip("dense family")
    model = load_model(folder).model
    calls: list[tuple[int, int, list[int], list[int]]] = []  # (tokens, top_k, tokens per expert, rows per call)
    real = moe.dispatch

    def recording(x, weights, ids, num_experts, expert):
        rows: list[int] = []
        counts = torch.bincount(ids.reshape(-1), minlength=num_experts).tolist()
        calls.append((x.shape[0], ids.shape[1], counts, rows))
        return real(x, weights, ids, num_experts, lambda e, xs: rows.append(xs.shape[0]) or expert(e, xs))

    monkeypatch.setattr(moe, "dispatch", recording)
    monkeypatch.setattr(gpt_oss, "dispatch", recording)
    _run_ours(model, PROMPTS[1])
    assert calls
    for n, k, counts, rows in calls:
        assert len(counts) > k and sum(counts) == n * k
        assert max(counts) > min(counts), counts  # uneven
        assert rows == [c for c in counts if c]


def test_kv_pool_sized_from_real_per_token_bytes_and_reported(tmp_path):
    from radixlang import Engine
    from radixlang.runtime.mem_cache.memory_pool import TokenToKVPool
    pool = TokenToKVPool(10, num_layers=2, num_kv_heads=0, head_dim=0, dtype=torch.float32, device="cpu",
                         layer_shapes=[(2, 16), (1, 64)])
    assert [tuple(pool.get_key_buffer(i).shape) for i in range(2)] == [(11, 2, 16), (11, 1, 64)]
    assert pool.per_token_bytes == 2 * (2 * 16 + 64) * 4 and pool.total_bytes == 11 * pool.per_token_bytes
    folder = save_tiny_hf_model(str(tmp_path / "q3"), "Qwen3ForCausalLM")
    with Engine(model_path=folder, max_total_tokens=1000) as engine:
        mem = engine.get_server_info()["memory"]
    # 3 layers x 2 kv heads x 16 dims, k and v, float32 on the CPU
    assert mem["kv_bytes_per_token"] == 3 * 2 * 2 * 16 * 4
    assert mem["kv_total_bytes"] == 1001 * mem["kv_bytes_per_token"] and mem["kv_total_tokens"] == 1000
