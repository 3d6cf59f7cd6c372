"""DeepSeek-V2 / V3 against transformers: tiny checkpoints saved by transformers' own classes (a dense
first layer then MoE layers, more experts than top-k over 3 groups, q_lora_rank on V3 and none on V2,
yarn on V2, a non-zero V3 selection bias, norms perturbed) give its prompt log-probabilities within 1e-4
and its greedy tokens, through the model alone (torch and CPU backends; the last token as a decode) and
through the Engine: alone, batched, after a cached prefix. The KV pool caches MLA's latent."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from radixlang.runtime.models.loader.model_loader import load_model
from test_model_families import NEW_TOKENS, PROMPTS, _hf_greedy, _hf_logprobs, _input_logprobs, _tokens
from test_models import _run_ours
from tiny_model import MLA_FAMILIES as FAMILIES
from tiny_model import save_tiny_hf_model


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory):
    arch, overrides = FAMILIES[request.param]
    folder = save_tiny_hf_model(str(tmp_path_factory.mktemp(request.param)), arch, seed=11, **overrides)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return request.param, folder, hf


@pytest.mark.parametrize("cpu_kernels", [False, True], ids=["torch_backend", "cpu_backend"])
def test_prompt_logprobs_match_transformers(family, cpu_kernels):
    name, folder, hf = family
    model = load_model(folder).model
    assert type(model).__name__ == FAMILIES[name][0]
    for ids in PROMPTS:
        logits = _run_ours(model, ids, decode_last=cpu_kernels, cpu_kernels=cpu_kernels)
        ours = logits.log_softmax(-1)[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
        ref = _hf_logprobs(hf, ids)
        assert (ours - ref).abs().max().item() < 1e-4, (name, (ours - ref).abs())


def test_engine_alone_batched_and_cached_prefix_match_transformers(family):
    from radixlang import Engine
    name, folder, hf = family
    greedy = {"max_new_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}
    refs = [_hf_greedy(hf, ids) for ids in PROMPTS]
    with Engine(model_path=folder, max_total_tokens=2048) as engine:
        alone = engine.generate(input_ids=PROMPTS[0], sampling_params=greedy, return_logprob=True,
                                logprob_start_len=0)
        ours, ref = _input_logprobs(alone), _hf_logprobs(hf, PROMPTS[0])
        assert len(ours) == len(ref) and (ours - ref).abs().max().item() < 1e-4, name
        assert _tokens(alone) == refs[0], name
        batch = engine.generate(input_ids=list(PROMPTS), sampling_params=greedy)
        assert [_tokens(o) for o in batch] == refs, name
        longer = PROMPTS[0] + [5, 6, 7, 8, 9, 10, 11]
        cached = engine.generate(input_ids=longer, sampling_params=greedy, return_logprob=True,
                                 logprob_start_len=len(PROMPTS[0]))
        assert cached["meta_info"]["cached_tokens"] >= len(PROMPTS[0]) - 1, name
        tail = _input_logprobs(cached)
        ref_tail = _hf_logprobs(hf, longer)[-len(tail):]
        assert len(tail) >= 6 and (tail - ref_tail).abs().max().item() < 1e-4, name
        assert _tokens(cached) == _hf_greedy(hf, longer), name
        mem = engine.get_server_info()["memory"]
    # the latent alone: (kv_lora_rank + qk_rope_head_dim) float32 per token and layer, no per-head k / v
    assert mem["kv_bytes_per_token"] == 3 * (32 + 8) * 4
    assert mem["kv_total_bytes"] == 2049 * mem["kv_bytes_per_token"]


def test_layers_dense_then_moe_and_routing_spreads_over_groups(family, monkeypatch):
    """Layer 0 is dense, the others MoE; each routed expert runs once over its tokens, and the chosen
    experts come from at most topk_group of the n_group groups per token."""
    from radixlang.runtime.models.layers import moe
    name, folder, _ = family
    model = load_model(folder).model
    kinds = [type(layer.mlp).__name__ for layer in model.layers]
    assert kinds[0] == "MLP" and all("MoE" in k for k in kinds[1:]), kinds
    calls: list[tuple[list[int], list[int], torch.Tensor]] = []
    real = moe.dispatch

    def recording(x, weights, ids, num_experts, expert):
        rows: list[int] = []
        calls.append((torch.bincount(ids.reshape(-1), minlength=num_experts).tolist(), rows, ids.clone()))
        return real(x, weights, ids, num_experts, lambda e, xs: rows.append(xs.shape[0]) or expert(e, xs))

    monkeypatch.setattr(moe, "dispatch", recording)
    _run_ours(model, PROMPTS[1])
    assert len(calls) == 2
    for counts, rows, ids in calls:
        assert len(counts) == 6 and max(counts) > min(counts), counts
        assert rows == [c for c in counts if c]
        groups = ids // 2  # 6 experts in 3 groups of 2
        assert all(len(set(g)) <= 2 for g in groups.tolist())


def test_v3_routing_selection_bias_and_groups():
    """The bias picks the experts but does not weigh them; masked groups never win."""
    from radixlang.runtime.models.layers.moe import route_sigmoid_grouped, route_softmax_grouped
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, 0.5, 0.4]])
    bias = torch.tensor([0.0, 0.0, 0.0, 5.0, 0.0, 0.0])
    w, ids = route_sigmoid_grouped(logits, 2, bias=bias, n_group=3, topk_group=1, renormalize=False, scale=2.0)
    assert sorted(ids[0].tolist()) == [2, 3]  # group 1 wins on the bias
    assert torch.allclose(w[0].sort().values, (torch.sigmoid(logits[0, [3, 2]]) * 2.0).sort().values)
    w, ids = route_sigmoid_grouped(logits, 2, bias=torch.zeros(6), n_group=3, topk_group=3, renormalize=True,
                                   scale=1.0)
    assert sorted(ids[0].tolist()) == [0, 1] and abs(float(w.sum()) - 1.0) < 1e-6
    w, ids = route_softmax_grouped(logits, 2, n_group=3, topk_group=1, scale=1.0)
    assert sorted(ids[0].tolist()) == [0, 1]
    w, ids = route_softmax_grouped(torch.tensor([[2.0, -5.0, 1.9, 1.8, -5.0, -5.0]]), 2, n_group=3, topk_group=2)
    assert sorted(ids[0].tolist()) == [0, 2]  # the best expert of each of the two best groups


def test_mla_checkpoint_checks_and_refusals(tmp_path):
    """A missing or unexpected tensor is named; the multi-token-prediction layer past num_hidden_layers
    is skipped; a backend without MLA is refused naming both; a head count that does not split over the
    tensor-parallel ranks is refused before any rank starts."""
    from safetensors.torch import load_file, save_file

    from radixlang.kernels.attention.base import AttentionBackend
    from radixlang.runtime.models.layers.attention_config import attention_features, check_backend_features
    arch, overrides = FAMILIES["deepseek_v3"]
    folder = save_tiny_hf_model(str(tmp_path / "v3"), arch, **overrides)
    model = load_model(folder).model
    assert "mla" in attention_features(model)
    with pytest.raises(ValueError, match="mla.*'triton' attention backend"):
        check_backend_features(model, AttentionBackend(), "triton")
    from radixlang.runtime.models.llama import check_tensor_parallel
    check_tensor_parallel(model.config, 1)
    check_tensor_parallel(model.config, 2)  # what rank 0 runs before starting any other rank
    with pytest.raises(ValueError, match="6 attention heads"):
        check_tensor_parallel(model.config, 4)
    path = f"{folder}/model.safetensors"
    tensors = {k: v.clone() for k, v in load_file(path).items()}
    mtp = {k.replace("layers.2.", "layers.3."): v.clone() for k, v in tensors.items() if "layers.2." in k}
    save_file({**tensors, **mtp}, path, metadata={"format": "pt"})
    load_model(folder)  # the extra layer (V3's MTP module) is skipped
    tensors["model.layers.1.self_attn.bogus.weight"] = torch.zeros(2)
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(ValueError, match="bogus"):
        load_model(folder)
    del tensors["model.layers.1.self_attn.bogus.weight"], tensors["model.layers.1.self_attn.kv_b_proj.weight"]
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(ValueError, match="kv_b_proj"):
        load_model(folder)


def test_random_weights_load_for_both(tmp_path):
    for name, (arch, overrides) in FAMILIES.items():
        folder = save_tiny_hf_model(str(tmp_path / name), arch, **overrides)
        model = load_model(folder, load_format="dummy").model
        assert _run_ours(model, [1, 2, 3, 4]).isfinite().all()
