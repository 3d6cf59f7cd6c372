"""DeepSeek-V2 / V3 GGUF files (llama.cpp's "deepseek2"), written here with the `gguf` package the way
llama.cpp's converter writes them from a transformers-saved tiny checkpoint: its tensor names, stacked
experts, the rope rows left interleaved, and both generations of its MLA layout (older files: one
attn_kv_b and the per-head sizes in key_length / value_length; newer ones: attn_k_b [heads, rank, nope]
and attn_v_b split out, head_count_kv 1 and the per-head sizes in key_length_mla / value_length_mla).
Loaded from the GGUF they give transformers' prompt log-probabilities within 1e-4 and its greedy tokens."""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from radixlang.runtime.models.loader.gguf_weights import hf_tensor_name
from radixlang.runtime.models.loader.model_loader import load_model
from test_deepseek import FAMILIES
from test_gguf_families import _greedy, add_smollm_tokenizer
from test_model_families import NEW_TOKENS, PROMPTS, _hf_greedy, _hf_logprobs
from test_models import _run_ours
from tiny_model import private_cache, save_tiny_hf_model

_ATTN = {"q_proj": "attn_q", "q_a_proj": "attn_q_a", "q_a_layernorm": "attn_q_a_norm", "q_b_proj": "attn_q_b",
         "kv_a_proj_with_mqa": "attn_kv_a_mqa", "kv_a_layernorm": "attn_kv_a_norm", "kv_b_proj": "attn_kv_b",
         "o_proj": "attn_output"}
_MLP = {"gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down"}
_TOP = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight"}


def _gguf_name(name: str) -> str:
    """A DeepSeek checkpoint name (not an expert's) -> llama.cpp's."""
    if name in _TOP:
        return _TOP[name]
    _, _, layer, *rest = name.split(".")
    module, leaf = ".".join(rest[:-1]), rest[-1]
    if leaf == "e_score_correction_bias":
        return f"blk.{layer}.exp_probs_b.bias"
    room, _, part = module.rpartition(".")
    kind = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}.get(module) or {
        "self_attn": _ATTN.get(part), "mlp": {"gate": "ffn_gate_inp", **_MLP}.get(part),
        "mlp.shared_experts": {k: v + "_shexp" for k, v in _MLP.items()}.get(part)}.get(room)
    if kind is None:
        raise KeyError(name)
    return f"blk.{layer}.{kind}.{leaf}"


def _gguf_tensors(checkpoint: dict[str, torch.Tensor], cfg, *, split_kv_b: bool):
    experts: dict[tuple[str, str], dict[int, np.ndarray]] = {}
    for name, t in checkpoint.items():
        arr = t.numpy().astype(np.float32)
        if ".mlp.experts." in name:  # model.layers.1.mlp.experts.3.gate_proj.weight
            parts = name.split(".")
            experts.setdefault((parts[2], _MLP[parts[6]] + "_exps"), {})[int(parts[5])] = arr
        elif name.endswith("kv_b_proj.weight") and split_kv_b:  # as llama.cpp's converter splits it
            layer = name.split(".")[2]
            kv = arr.reshape(cfg.num_attention_heads, cfg.qk_nope_head_dim + cfg.v_head_dim, cfg.kv_lora_rank)
            yield f"blk.{layer}.attn_k_b.weight", np.ascontiguousarray(kv[:, :cfg.qk_nope_head_dim].transpose(0, 2, 1))
            yield f"blk.{layer}.attn_v_b.weight", np.ascontiguousarray(kv[:, cfg.qk_nope_head_dim:])
        else:
            yield _gguf_name(name), arr
    for (layer, kind), per in experts.items():
        yield f"blk.{layer}.{kind}.weight", np.stack([per[e] for e in range(len(per))])


def _add_metadata(w, cfg, *, newer: bool, v3: bool) -> None:
    import gguf
    rope, nope, v = cfg.qk_rope_head_dim, cfg.qk_nope_head_dim, cfg.v_head_dim
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(1 if newer else cfg.num_attention_heads)
    w.add_key_length(cfg.kv_lora_rank + rope if newer else nope + rope)
    w.add_value_length(cfg.kv_lora_rank if newer else v)
    if newer:
        w.add_key_length_mla(nope + rope)
        w.add_value_length_mla(v)
    if cfg.q_lora_rank:
        w.add_q_lora_rank(cfg.q_lora_rank)
    w.add_kv_lora_rank(cfg.kv_lora_rank)
    w.add_rope_dimension_count(rope)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(float(cfg.rope_parameters["rope_theta"]))
    w.add_leading_dense_block_count(cfg.first_k_dense_replace)
    w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    w.add_expert_count(cfg.n_routed_experts)
    w.add_expert_used_count(cfg.num_experts_per_tok)
    w.add_expert_shared_count(cfg.n_shared_experts)
    w.add_expert_weights_scale(cfg.routed_scaling_factor)
    if cfg.norm_topk_prob:
        w.add_expert_weights_norm(True)
    if v3:  # V2 files leave the gating function out: llama.cpp's default is softmax
        w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    if v3 or cfg.topk_method == "group_limited_greedy":
        w.add_expert_group_count(cfg.n_group)
        w.add_expert_group_used_count(cfg.topk_group)
    if cfg.rope_parameters.get("rope_type") == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(cfg.rope_parameters["factor"])
        w.add_rope_scaling_orig_ctx_len(cfg.rope_parameters["original_max_position_embeddings"])
        w.add_rope_scaling_yarn_log_mul(0.1 * cfg.rope_parameters["mscale_all_dim"])


def write_deepseek_gguf(hf_folder: str, path: str, *, newer: bool, f16: bool = False,
                        quant: dict | None = None) -> None:
    """``quant``: {GGUF tensor kind (attn_output, ffn_down, ...): GGMLQuantizationType} for 2-D matrices."""
    import gguf
    from safetensors.torch import load_file
    cfg = AutoConfig.from_pretrained(hf_folder)
    v3 = cfg.model_type == "deepseek_v3"
    w = gguf.GGUFWriter(path, "deepseek2")
    _add_metadata(w, cfg, newer=newer, v3=v3)
    add_smollm_tokenizer(w)
    checkpoint = load_file(os.path.join(hf_folder, "model.safetensors"))
    for gname, arr in _gguf_tensors(checkpoint, cfg, split_kv_b=newer):
        want = hf_tensor_name(gname, "deepseek2", cfg.n_routed_experts)
        assert want.format(e=0) in checkpoint or gname.split(".")[2] in ("attn_k_b", "attn_v_b"), (gname, want)
        qtype = (quant or {}).get(gname.split(".")[2]) if gname.startswith("blk.") and arr.ndim == 2 else None
        if qtype is not None:
            w.add_tensor(gname, gguf.quants.quantize(np.ascontiguousarray(arr), qtype), raw_dtype=qtype)
        else:
            w.add_tensor(gname, np.ascontiguousarray(arr.astype(np.float16) if f16 and arr.ndim >= 2 else arr))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


# V2 in an older file (F32, one attn_kv_b, no gating key, yarn, grouped softmax routing); V3 in a newer
# one (F16 matrices, attn_k_b / attn_v_b, sigmoid routing with the selection bias, q_lora_rank). A GGUF
# keeps only mscale_all_dim (as yarn_log_multiplier): the V2 checkpoint has mscale equal to it, as
# every DeepSeek release does
CASES = {
    "deepseek_v2": (False, False, dict(rope_parameters={**FAMILIES["deepseek_v2"][1]["rope_parameters"],
                                                        "mscale": 0.707, "mscale_all_dim": 0.707})),
    "deepseek_v3": (True, True, {}),
}


@pytest.mark.parametrize("family", sorted(CASES))
def test_deepseek_gguf_matches_transformers(tmp_path, monkeypatch, family):
    arch, overrides = FAMILIES[family]
    newer, f16, more = CASES[family]
    folder = save_tiny_hf_model(str(tmp_path / "hf"), arch, seed=11, **{**overrides, **more})
    private_cache(tmp_path / "cache", monkeypatch)  # after: the tokenizer's source stays cached
    path = str(tmp_path / f"tiny-{family}.gguf")
    write_deepseek_gguf(folder, path, newer=newer, f16=f16)
    loaded = load_model(path)
    model, cfg = loaded.model, loaded.hf_config
    assert type(model).__name__ == arch
    ref_cfg = AutoConfig.from_pretrained(folder)
    for key in ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
                "n_routed_experts", "n_shared_experts", "num_experts_per_tok", "first_k_dense_replace",
                "routed_scaling_factor", "n_group", "topk_group", "num_key_value_heads", "moe_intermediate_size"):
        assert getattr(cfg, key) == getattr(ref_cfg, key), key
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    if f16:  # the reference holds the weights the file does
        hf.load_state_dict({k: v.half().float() if v.dim() >= 2 else v for k, v in hf.state_dict().items()})
    for ids in PROMPTS:
        logits = _run_ours(model, ids)
        ours = logits.log_softmax(-1)[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
        assert (ours - _hf_logprobs(hf, ids)).abs().max().item() < 1e-4, family
    assert len(_hf_greedy(hf, PROMPTS[0])) == NEW_TOKENS
    assert _greedy(model, PROMPTS[0], NEW_TOKENS) == _hf_greedy(hf, PROMPTS[0]), family


def test_deepseek_gguf_refusals_name_what_is_missing(tmp_path, monkeypatch):
    """A k_b without its v_b, and yarn on an architecture other than deepseek2, are named."""
    import gguf

    from radixlang.runtime.models.loader.gguf_convert import ensure_converted
    from radixlang.runtime.models.loader.gguf_file import read_gguf
    from radixlang.runtime.models.loader.gguf_weights import gguf_weights
    private_cache(tmp_path / "cache", monkeypatch)
    path = str(tmp_path / "half.gguf")
    w = gguf.GGUFWriter(path, "deepseek2")
    w.add_head_count(2)
    w.add_tensor("blk.0.attn_k_b.weight", np.zeros((2, 4, 3), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match=r"blk\.0\.attn_k_b\.weight has no blk\.0\.attn_v_b\.weight"):
        list(gguf_weights(read_gguf(path)))
    path = str(tmp_path / "yarn.gguf")
    w = gguf.GGUFWriter(path, "qwen2")
    w.add_block_count(1)
    w.add_embedding_length(8)
    w.add_head_count(2)
    w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match=r"rope scaling 'yarn' \(qwen2\) is not supported"):
        ensure_converted(path)


# the projections a quantized DeepSeek file serves from its blocks: MLA's q (or q_a / q_b), kv_a, the shared
# experts and the routed ones (o_proj's 144 inputs are not whole blocks of 32: the writer keeps it F32)
QUANTIZED = {"deepseek_v2": dict(q_lora_rank=None), "deepseek_v3": dict(q_lora_rank=32)}


def _quantized_deepseek(tmp_path, monkeypatch, family: str) -> str:
    import gguf
    arch, overrides = FAMILIES[family]
    newer, _, more = CASES[family]
    folder = save_tiny_hf_model(str(tmp_path / "hf"), arch, seed=11, **{**overrides, **more, **QUANTIZED[family]})
    private_cache(tmp_path / "cache", monkeypatch)
    path = str(tmp_path / f"q-{family}.gguf")
    t = gguf.GGMLQuantizationType
    write_deepseek_gguf(folder, path, newer=newer, quant={
        "attn_q": t.Q8_0, "attn_q_a": t.Q8_0, "attn_q_b": t.Q4_0, "attn_kv_a_mqa": t.Q8_0,
        "ffn_gate_shexp": t.Q4_1, "ffn_up_shexp": t.Q8_0, "ffn_down_shexp": t.Q8_0,  # mixed: one q8 gate/up
        "ffn_gate_exps": t.Q4_0, "ffn_up_exps": t.Q4_0, "ffn_down_exps": t.Q8_0})
    return path


def _from_blocks(linear) -> bool:
    """Whether a linear is served from a GGUF file's blocks: the GGUF blocks method, a QuantLinear kernel."""
    from radixlang.runtime.models.gguf_quant import GGUFBlocksMethod, QuantLinear
    return isinstance(linear.method, GGUFBlocksMethod) and isinstance(linear.kernel, QuantLinear)


@pytest.mark.parametrize("family", sorted(QUANTIZED))
def test_quantized_deepseek_gguf_serves_mla_and_shared_experts_from_blocks(tmp_path, monkeypatch, family):
    """MLA's q / q_a / q_b and kv_a projections (their rope rows de-interleaved as the float path does) and
    the shared experts are served from their blocks (the GGUF blocks method, which gives them no float32
    weight to load); the same file dequantized gives the same tokens and prompt logprobs within 2e-3."""
    from radixlang import Engine
    path = _quantized_deepseek(tmp_path, monkeypatch, family)
    ids = PROMPTS[0]
    greedy = {"max_new_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}
    kw = dict(model_path=path, max_total_tokens=512)
    runs = []
    for dtype in ("auto", "float32"):
        with Engine(**kw, dtype=dtype) as engine:
            model = engine.scheduler.runner.model
            attn, moe = model.layers[1].self_attn, model.layers[1].mlp
            projections = [attn.q_b_proj, attn.kv_a_proj_with_mqa] + ([attn.q_a_proj] if attn.q_a_proj is not None
                                                                     else [])
            assert all(_from_blocks(p) for p in projections) == (dtype == "auto"), family
            if dtype == "float32":  # float32 shared experts run inside the experts' kernel (layers/moe.py)
                assert moe.shared_folded and moe.shared_experts is None
            else:
                assert _from_blocks(moe.shared_experts.gate_up_proj)
                assert moe.shared_experts.gate_up_proj.kernel.source_type == "Q4_1/Q8_0"
                assert _from_blocks(moe.shared_experts.down_proj)
                assert not any(p.is_meta for p in model.parameters())
            runs.append((engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 0}, return_logprob=True,
                                         logprob_start_len=0),
                         engine.generate(input_ids=ids, sampling_params=greedy)["output_ids"]))
    (got, tokens), (want, want_tokens) = runs
    a = torch.tensor([lp for lp, _, _ in got["meta_info"]["input_token_logprobs"][1:]])
    b = torch.tensor([lp for lp, _, _ in want["meta_info"]["input_token_logprobs"][1:]])
    assert len(a) == len(ids) - 1 and (a - b).abs().max() < 2e-3, (family, (a - b).abs().max())
    assert tokens == want_tokens, family


@pytest.mark.e2e
def test_quantized_deepseek_gguf_tp2_matches_tp1(tmp_path, monkeypatch):
    """Under tp=2 each rank holds its heads' rows of q_b's blocks and the whole kv_a / q_a blocks; the shared
    experts' gate/up rows are split, their down_proj's 16 inputs a rank would cut a group (kept float32)."""
    from radixlang import Engine
    from tp_runs import all_logprobs, run_shared_prefix
    path = _quantized_deepseek(tmp_path, monkeypatch, "deepseek_v3")
    kw = dict(model_path=path, max_total_tokens=1024, chunked_prefill_size=16)
    with Engine(**kw) as single:
        want = run_shared_prefix(single)
    with Engine(**kw, tp_size=2) as engine:
        attn = engine.scheduler.runner.model.layers[1].self_attn
        assert _from_blocks(attn.q_b_proj) and attn.q_b_proj.out_features == 3 * (16 + 8)
        assert _from_blocks(attn.kv_a_proj_with_mqa) and attn.kv_a_proj_with_mqa.out_features == 32 + 8
        got = run_shared_prefix(engine)
    for g, w in zip(got, want, strict=True):
        assert g["output_ids"] == w["output_ids"]
        assert all_logprobs(g) == pytest.approx(all_logprobs(w), rel=1e-4, abs=1e-4)
