"""GGUF files of the supported families (written here with the `gguf` package in llama.cpp's tensor
names and metadata, tokenizer fields copied from the embedded SmolLM2 GGUF) load as the family and
give the original checkpoint's prompt log-probabilities; transformers' own GGUF reader agrees on weights."""
from __future__ import annotations

import functools
import math
import os

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from radixlang.runtime.models.loader.gguf_weights import hf_tensor_name
from radixlang.runtime.models.loader.model_loader import default_model_path, load_model
from test_model_families import PROMPTS, _hf_logprobs
from test_models import _run_ours
from tiny_model import FAMILIES, private_cache, save_tiny_hf_model
from tokenizer_sources import add_gguf_tokenizer

_GGUF_NAMES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
               "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
               "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
               "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
               # MoE (llama.cpp stacks the experts: blk.N.ffn_gate_exps [experts, inter, hidden])
               "mlp.gate": "ffn_gate_inp", "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
               "mlp.shared_expert.gate_proj": "ffn_gate_shexp", "mlp.shared_expert.up_proj": "ffn_up_shexp",
               "mlp.shared_expert.down_proj": "ffn_down_shexp", "block_sparse_moe.gate": "ffn_gate_inp"}
_EXPERT_NAMES = {"gate_proj": "ffn_gate_exps", "up_proj": "ffn_up_exps", "down_proj": "ffn_down_exps",
                 "w1": "ffn_gate_exps", "w3": "ffn_up_exps", "w2": "ffn_down_exps"}
_GEMMA_NAMES = {**_GGUF_NAMES, "post_attention_layernorm": "post_attention_norm",
                "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm"}
_PHI3_NAMES = {**_GGUF_NAMES, "self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up"}


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:  # what llama.cpp's converter does to llama's Q/K
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


_GPT_OSS_NAMES = {"input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight":
                  "post_attention_norm.weight", "self_attn.sinks": "attn_sinks.weight",
                  "mlp.router.weight": "ffn_gate_inp.weight", "mlp.router.bias": "ffn_gate_inp.bias",
                  "mlp.experts.down_proj_bias": "ffn_down_exps.bias",
                  **{f"self_attn.{p}_proj.{leaf}": f"attn_{g}.{leaf}" for p, g in
                     (("q", "q"), ("k", "k"), ("v", "v"), ("o", "output")) for leaf in ("weight", "bias")}}


def _gpt_oss_tensors(checkpoint: dict[str, torch.Tensor]):
    """As llama.cpp's converter writes GPT-OSS: the interleaved gate/up columns (and bias) split into
    ffn_gate_exps / ffn_up_exps [experts, inter, hidden], down_proj transposed to [experts, hidden, inter]."""
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
    for name, t in checkpoint.items():
        arr = t.numpy().astype(np.float32)
        if name in top:
            yield top[name], arr
            continue
        _, _, layer, *rest = name.split(".")
        local = ".".join(rest)
        if local == "mlp.experts.gate_up_proj":
            yield f"blk.{layer}.ffn_gate_exps.weight", arr[:, :, 0::2].transpose(0, 2, 1)
            yield f"blk.{layer}.ffn_up_exps.weight", arr[:, :, 1::2].transpose(0, 2, 1)
        elif local == "mlp.experts.gate_up_proj_bias":
            yield f"blk.{layer}.ffn_gate_exps.bias", arr[:, 0::2]
            yield f"blk.{layer}.ffn_up_exps.bias", arr[:, 1::2]
        elif local == "mlp.experts.down_proj":
            yield f"blk.{layer}.ffn_down_exps.weight", arr.transpose(0, 2, 1)
        else:
            yield f"blk.{layer}.{_GPT_OSS_NAMES[local]}", arr


def _gguf_tensors(checkpoint: dict[str, torch.Tensor], cfg, arch: str, f16: bool):
    """(llama.cpp name, array) pairs as its converter writes them from a checkpoint's tensors: llama's
    Q/K permuted, Gemma's norms as 1 + w, experts stacked; with ``f16`` the matrices in float16 (norms
    and biases stay float32)."""
    if arch == "gpt-oss":
        return [(n, a.astype(np.float16) if f16 and a.ndim >= 2 else a) for n, a in _gpt_oss_tensors(checkpoint)]
    names = {"gemma2": _GEMMA_NAMES, "gemma3": _GEMMA_NAMES, "phi3": _PHI3_NAMES}.get(arch, _GGUF_NAMES)
    experts: dict[tuple[str, str], dict[int, np.ndarray]] = {}
    out = []
    for name, t in checkpoint.items():
        arr = t.numpy().astype(np.float32)
        if name.startswith("model.layers."):
            _, _, layer, *rest = name.split(".")
            module, leaf = ".".join(rest[:-1]), rest[-1]
            if ".experts." in module:  # mlp.experts.3.gate_proj / block_sparse_moe.experts.3.w1
                e, part = module.split(".")[-2:]
                experts.setdefault((layer, _EXPERT_NAMES[part]), {})[int(e)] = arr
                continue
            kind = names[module]
            if arch == "llama" and kind in ("attn_q", "attn_k"):
                arr = _permute(arr, cfg.num_attention_heads if kind == "attn_q" else cfg.num_key_value_heads)
            gname = f"blk.{layer}.{kind}.{leaf}"
        else:
            gname = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                     "lm_head.weight": "output.weight"}[name]
        if arch in ("gemma2", "gemma3") and name.endswith("norm.weight"):
            arr = arr + 1.0
        out.append((gname, arr))
    for (layer, kind), per in experts.items():
        out.append((f"blk.{layer}.{kind}.weight", np.stack([per[e] for e in range(len(per))])))
    return [(n, a.astype(np.float16) if f16 and a.ndim >= 2 else a) for n, a in out]


@functools.cache
def _smollm_tokenizer_fields() -> list[tuple]:
    """(key, value, type, array item type) of the embedded SmolLM2 GGUF's tokenizer fields, read once a
    process: gguf's reader takes ~7 s over its 49k-token vocabulary."""
    import gguf
    src = gguf.GGUFReader(default_model_path())
    return [(key, field.contents(), field.types[0], field.types[-1]) for key, field in src.fields.items()
            if key.startswith("tokenizer.")]


def add_smollm_tokenizer(w) -> None:
    """The embedded SmolLM2 GGUF's tokenizer fields, copied into a GGUFWriter."""
    import gguf
    for key, value, kind, item in _smollm_tokenizer_fields():
        if kind == gguf.GGUFValueType.ARRAY:
            w.add_key_value(key, value, kind, sub_type=item)
        else:
            w.add_key_value(key, value, kind)


def _write_gguf(hf_folder: str, path: str, arch: str, *, f16: bool = False, quant: dict | None = None,
                tokenizer=add_smollm_tokenizer) -> None:
    """``quant``: {GGUF tensor kind (attn_q, ffn_down, ..., output, token_embd): GGMLQuantizationType} for
    matrices stored as blocks; ``tokenizer(writer)`` writes the tokenizer fields (SmolLM2's by default)."""
    import gguf
    from transformers import AutoConfig
    cfg = AutoConfig.from_pretrained(hf_folder)
    w = gguf.GGUFWriter(path, arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    rope = cfg.rope_parameters
    if arch == "gemma3":
        w.add_rope_freq_base_swa(float(rope["sliding_attention"]["rope_theta"]))
        rope = rope["full_attention"]
    w.add_rope_freq_base(float(rope["rope_theta"]))
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    if getattr(cfg, "sliding_window", None) and arch != "llama":
        w.add_sliding_window(cfg.sliding_window)
    if arch == "gemma2":
        w.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
        w.add_final_logit_softcapping(cfg.final_logit_softcapping)
    if arch == "gemma3":
        w.add_sliding_window_pattern([t == "sliding_attention" for t in cfg.layer_types])
    if arch == "phi3":
        w.add_rope_dimension_count(int(cfg.head_dim * rope.get("partial_rotary_factor", 1.0)))
        if rope.get("rope_type") == "longrope":
            orig = rope["original_max_position_embeddings"]
            w.add_rope_scaling_orig_ctx_len(orig)
            w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(cfg.max_position_embeddings / orig)
                                                      / math.log(orig)))
            w.add_tensor("rope_factors_long.weight", np.array(rope["long_factor"], dtype=np.float32))
            w.add_tensor("rope_factors_short.weight", np.array(rope["short_factor"], dtype=np.float32))
    n_experts = getattr(cfg, "num_local_experts", None) or getattr(cfg, "num_experts", None)
    if n_experts:
        w.add_expert_count(n_experts)
        w.add_expert_used_count(cfg.num_experts_per_tok)
    if getattr(cfg, "moe_intermediate_size", None):
        w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    if arch == "gpt-oss":  # its experts' size; yarn as llama.cpp's converter writes it
        w.add_expert_feed_forward_length(cfg.intermediate_size)
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rope["factor"])
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    if getattr(cfg, "shared_expert_intermediate_size", None):
        w.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
    tokenizer(w)
    from safetensors.torch import load_file
    checkpoint = load_file(os.path.join(hf_folder, "model.safetensors"))  # transformers' saved names
    for gname, arr in _gguf_tensors(checkpoint, cfg, arch, f16):
        want = hf_tensor_name(gname, arch, n_experts or 0)
        assert want.format(e=0) in checkpoint, (gname, want)
        key = gname.split(".")[2] if gname.startswith("blk.") else gname.split(".")[0]
        # matrices only (3-D: stacked experts); GPT-OSS's 2-D expert biases stay float, as llama.cpp keeps them
        qtype = (quant or {}).get(key) if arr.ndim in (2, 3) and gname.endswith(".weight") else None
        if qtype is None:
            w.add_tensor(gname, np.ascontiguousarray(arr))
        else:
            w.add_tensor(gname, gguf.quants.quantize(np.ascontiguousarray(arr, np.float32), qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("arch,hf_arch", [("qwen2", "Qwen2ForCausalLM"), ("qwen3", "Qwen3ForCausalLM")])
def test_gguf_family_matches_its_checkpoint(tmp_path, monkeypatch, arch, hf_arch):
    folder = save_tiny_hf_model(str(tmp_path / "hf"), hf_arch, seed=5)
    private_cache(tmp_path / "cache", monkeypatch)  # after: the tokenizer's source stays cached
    path = str(tmp_path / f"tiny-{arch}.gguf")
    _write_gguf(folder, path, arch)
    loaded = load_model(path)
    assert type(loaded.model).__name__ == hf_arch
    assert loaded.tokenizer.encode("hello world") == load_model(folder).tokenizer.encode("hello world")
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    _assert_prompt_logprobs(loaded.model, hf, arch)
    if arch == "qwen3":  # transformers' GGUF reader ignores qwen3.attention.key_length (assumes 128)
        return
    # transformers' own GGUF reader maps the same file to the same weights
    ref = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                               dtype=torch.float32).state_dict()
    for name, tensor in hf.state_dict().items():
        assert torch.allclose(tensor, ref[name], atol=1e-6), name


WINDOW = 5  # shorter than the prompts
MORE_FAMILIES = {
    # GGUF arch, HF arch, config overrides, float16 export. Gemma's query_pre_attn_scalar is head_dim:
    # a GGUF has no field for it (llama.cpp assumes head_dim but for the 27B models)
    "gemma2": ("gemma2", "Gemma2ForCausalLM", False,
               dict(sliding_window=WINDOW, attn_logit_softcapping=0.5, final_logit_softcapping=3.0,
                    query_pre_attn_scalar=16, tie_word_embeddings=True,
                    layer_types=["sliding_attention", "full_attention", "sliding_attention"])),
    "gemma3": ("gemma3", "Gemma3ForCausalLM", True,
               dict(sliding_window=WINDOW, query_pre_attn_scalar=16, tie_word_embeddings=True,
                    layer_types=["full_attention", "sliding_attention", "sliding_attention"])),
    "phi3": ("phi3", "Phi3ForCausalLM", False,
             dict(sliding_window=WINDOW, max_position_embeddings=64, original_max_position_embeddings=32,
                  rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
                                   "original_max_position_embeddings": 32,
                                   "short_factor": [1.0 + 0.3 * i for i in range(6)],
                                   "long_factor": [2.0 + i for i in range(6)]})),
    "mixtral": ("llama", "MixtralForCausalLM", True, dict(num_local_experts=5, num_experts_per_tok=2)),
    "gpt_oss": ("gpt-oss", "GptOssForCausalLM", True, FAMILIES["gpt_oss"][1]),
    "qwen2_moe": ("qwen2moe", "Qwen2MoeForCausalLM", False,
                  dict(num_experts=6, num_experts_per_tok=2, moe_intermediate_size=32,
                       shared_expert_intermediate_size=48, decoder_sparse_step=1, mlp_only_layers=[1],
                       norm_topk_prob=False)),
    "qwen3_moe": ("qwen3moe", "Qwen3MoeForCausalLM", True,
                  dict(num_experts=6, num_experts_per_tok=3, moe_intermediate_size=32, norm_topk_prob=True,
                       decoder_sparse_step=1)),
}


def _assert_prompt_logprobs(model, hf, what: str) -> None:
    """Our model gives transformers' prompt log-probabilities within 1e-4 on the first two prompts."""
    for ids in PROMPTS[:2]:
        logits = _run_ours(model, ids)
        ours = logits.log_softmax(-1)[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
        assert (ours - _hf_logprobs(hf, ids)).abs().max().item() < 1e-4, what


def _greedy(model, ids: list[int], n: int) -> list[int]:
    out: list[int] = []
    for _ in range(n):
        out.append(int(_run_ours(model, ids + out)[-1].argmax()))
    return out


@pytest.mark.parametrize("family", sorted(MORE_FAMILIES))
def test_gguf_export_of_more_families_matches_transformers(tmp_path, monkeypatch, family):
    """llama.cpp's layout of each family (its tensor names, Gemma's 1 + w norms, stacked experts, Phi-3's
    fused q/k/v and gate/up and longrope factor tensors) loads as the family and gives transformers'
    prompt log-probabilities and greedy tokens on the exported weights (rounded to float16 for F16)."""
    from test_model_families import NEW_TOKENS, _hf_greedy
    arch, hf_arch, f16, overrides = MORE_FAMILIES[family]
    folder = save_tiny_hf_model(str(tmp_path / "hf"), hf_arch, seed=7, **overrides)
    private_cache(tmp_path / "cache", monkeypatch)  # after: the tokenizer's source stays cached
    path = str(tmp_path / f"tiny-{family}.gguf")
    _write_gguf(folder, path, arch, f16=f16)
    model = load_model(path).model
    assert type(model).__name__ == hf_arch
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    if f16:  # the reference holds the weights the file does
        hf.load_state_dict({k: v.half().float() if v.dim() >= 2 else v for k, v in hf.state_dict().items()})
    _assert_prompt_logprobs(model, hf, family)
    ids = PROMPTS[0]
    assert _greedy(model, ids, NEW_TOKENS) == _hf_greedy(hf, ids), family


def test_gguf_architecture_we_cannot_map_is_named(tmp_path, monkeypatch):
    import gguf
    private_cache(tmp_path / "cache", monkeypatch)
    path = str(tmp_path / "odd.gguf")
    w = gguf.GGUFWriter(path, "mamba")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((8, 4), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match=r"GGUF architecture 'mamba' is not supported \(supported: llama, .*phi3"):
        load_model(path)


def test_gguf_weights_are_read_one_tensor_at_a_time_from_the_file(tmp_path, monkeypatch):
    """No converted copy of the weights is written (the cached folder holds the config and tokenizer),
    and the weights are dequantized from the GGUF file as they are copied: when a tensor is dequantized,
    at most the one before it (still being copied) is alive; collecting them first would hold the whole
    float32 model. Stacked experts are read one expert at a time."""
    import weakref

    from radixlang.runtime.models.loader import gguf_weights
    folder = save_tiny_hf_model(str(tmp_path / "hf"), "Qwen2MoeForCausalLM", seed=3,
                                **MORE_FAMILIES["qwen2_moe"][3])
    private_cache(tmp_path / "cache", monkeypatch)
    path = str(tmp_path / "tiny.gguf")
    _write_gguf(folder, path, "qwen2moe")
    real, made, held, shapes = gguf_weights.dequantize_tensor, [], [], []

    def tracking(t, data=None):  # arrays are freed by reference counting: no gc.collect needed
        held.append(sum(r() is not None for r in made))
        arr = real(t, data)
        made.append(weakref.ref(arr))
        shapes.append(arr.shape)
        return arr

    monkeypatch.setattr(gguf_weights, "dequantize_tensor", tracking)
    model = load_model(path).model
    assert len(made) > 40 and max(held) <= 1, held
    assert (32, 96) in shapes and not any(len(s) == 3 for s in shapes)  # experts [6, 32, 96] one by one
    cached = [os.path.join(d, f) for d, _, fs in os.walk(tmp_path / "cache") for f in fs]
    assert cached and not any(f.endswith((".safetensors", ".bin")) for f in cached), cached
    assert sum(os.path.getsize(f) for f in cached) < os.path.getsize(path)
    from safetensors.torch import load_file
    ref = load_file(os.path.join(folder, "model.safetensors"))  # the checkpoint's own names
    assert torch.equal(model.layers[1].mlp.down_proj.weight, ref["model.layers.1.mlp.down_proj.weight"])
    assert torch.equal(model.layers[0].mlp.experts.w2[4], ref["model.layers.0.mlp.experts.4.down_proj.weight"])


def test_a_cached_folder_of_the_earlier_design_is_not_used(tmp_path, monkeypatch):
    """Folders of the float32-safetensors design have another key: a start writes its own folder and
    never reads theirs; a converted folder passed as the model path reads its GGUF file."""
    from radixlang.runtime.models.loader.gguf_convert import converted_dir_for
    folder = save_tiny_hf_model(str(tmp_path / "hf"), "Qwen2ForCausalLM", seed=3)
    private_cache(tmp_path / "cache", monkeypatch)
    path = str(tmp_path / "tiny.gguf")
    _write_gguf(folder, path, "qwen2")
    st = os.stat(path)
    import hashlib
    old_key = hashlib.sha256(f"{os.path.abspath(path)}|{st.st_size}|{int(st.st_mtime)}|v2".encode()).hexdigest()[:16]
    old = tmp_path / "cache" / f"tiny-{old_key}"
    old.mkdir(parents=True)
    (old / "complete").write_text("ok")  # an old folder whose weights are garbage
    (old / "config.json").write_text("{}")
    loaded = load_model(path)
    assert loaded.model_path == path and str(converted_dir_for(path)) != str(old)
    ref = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).state_dict()
    assert torch.equal(loaded.model.layers[2].mlp.down_proj.weight, ref["model.layers.2.mlp.down_proj.weight"])
    again = load_model(str(converted_dir_for(path))).model
    assert torch.equal(again.layers[2].mlp.down_proj.weight, ref["model.layers.2.mlp.down_proj.weight"])


@pytest.mark.e2e
def test_quantized_gguf_with_mixed_types_loads_each_linear_once(tmp_path, monkeypatch):
    """Q4_0 q/k with a Q8_0 v (as Q4_K_M puts Q4_K q/k beside a Q6_K v): the fused projection is one weight of
    q8 codes (gguf_blocks.common_layout), so every linear is served from its blocks and none is loaded as
    float32, and the fused CPU decode step keeps the model. Prompt log-probabilities and greedy tokens match
    the same file run dequantized (--dtype float32)."""
    import gguf

    from radixlang import Engine
    from radixlang.runtime.models.gguf_quant import GGUFBlocksMethod, QuantLinear
    from radixlang.runtime.models.layers.linear import Linear

    folder = save_tiny_hf_model(str(tmp_path / "hf"), "LlamaForCausalLM", seed=7)
    private_cache(tmp_path / "cache", monkeypatch)
    path = str(tmp_path / "mixed.gguf")
    t = gguf.GGMLQuantizationType
    _write_gguf(folder, path, "llama", quant={"attn_q": t.Q4_0, "attn_k": t.Q4_0, "attn_v": t.Q8_0,
                                              "attn_output": t.Q4_0, "ffn_gate": t.Q4_1, "ffn_up": t.Q4_1,
                                              "ffn_down": t.Q8_0})
    ids = PROMPTS[0]
    kw = dict(model_path=path, max_total_tokens=512)
    greedy = {"max_new_tokens": 8, "min_new_tokens": 8, "temperature": 0}
    with Engine(**kw) as quantized:
        runner = quantized.scheduler.runner
        model = runner.model
        layer = model.layers[0]
        qkv = layer.self_attn.qkv_proj
        assert isinstance(qkv.method, GGUFBlocksMethod) and isinstance(qkv.kernel, QuantLinear)
        assert qkv.kernel.source_type == "Q4_0/Q8_0"
        assert qkv.kernel.weight_q.layout.startswith("q8")  # the Q4_0 parts' 4-bit codes kept as 8-bit ones
        assert {type(m.kernel).__name__ for m in (layer.self_attn.o_proj, layer.mlp.gate_up_proj,
                                                  layer.mlp.down_proj)} == {"QuantLinear"}
        assert layer.mlp.down_proj.kernel.source_type == "Q8_0"
        assert layer.mlp.gate_up_proj.kernel.source_type == "Q4_1"
        # q/k/v, o, gate/up, down of each of the 3 layers: never given a float32 weight
        blocks = [m for m in model.layers.modules()
                  if isinstance(m, Linear) and isinstance(m.method, GGUFBlocksMethod)]
        assert len(blocks) == 4 * 3 and all(m.weight is None for m in blocks)
        assert not any(p.is_meta for p in model.parameters())
        assert runner.decode_stack is not None  # no float32 linear left to turn the fused step off
        got = quantized.generate(input_ids=ids, sampling_params={"max_new_tokens": 0}, return_logprob=True,
                                 logprob_start_len=0)
        tokens = quantized.generate(input_ids=ids, sampling_params=greedy)["output_ids"]
    with Engine(**kw, dtype="float32") as plain:
        want = plain.generate(input_ids=ids, sampling_params={"max_new_tokens": 0}, return_logprob=True,
                              logprob_start_len=0)
        want_tokens = plain.generate(input_ids=ids, sampling_params=greedy)["output_ids"]
    a = torch.tensor([lp for lp, _, _ in got["meta_info"]["input_token_logprobs"][1:]])
    b = torch.tensor([lp for lp, _, _ in want["meta_info"]["input_token_logprobs"][1:]])
    assert len(a) == len(ids) - 1 and (a - b).abs().max() < 2e-3
    assert tokens == want_tokens


def _count_opens(monkeypatch, path: str) -> list:
    """The opens of the file at ``path`` from now until ``monkeypatch.undo()``, as they happen."""
    import builtins

    opened, real_open = [], builtins.open

    def counting(file, *a, **kw):
        if isinstance(file, (str, os.PathLike)) and os.path.realpath(file) == os.path.realpath(path):
            opened.append(file)
        return real_open(file, *a, **kw)

    monkeypatch.setattr(builtins, "open", counting)
    return opened


def test_a_start_opens_the_gguf_file_once(tmp_path, monkeypatch):
    """A runner's start on a quantized GGUF (its config folder cached by an earlier start) opens the file
    once: the same parsed header serves the blocks' plan, the float tensors' stream and the blocks."""
    from radixlang.runtime.model_executor.model_runner import ModelRunner
    from radixlang.runtime.models.gguf_quant import GGUFBlocksMethod
    from radixlang.runtime.models.loader.gguf_convert import ensure_converted
    from radixlang.runtime.server_args import ServerArgs

    folder = save_tiny_hf_model(str(tmp_path / "hf"), "LlamaForCausalLM", seed=7)
    private_cache(tmp_path / "cache", monkeypatch)
    path = str(tmp_path / "q.gguf")
    t = __import__("gguf").GGMLQuantizationType
    _write_gguf(folder, path, "llama", quant={"attn_q": t.Q8_0, "attn_k": t.Q8_0, "attn_v": t.Q8_0,
                                              "attn_output": t.Q8_0, "ffn_down": t.Q4_0})
    ensure_converted(path)  # the first start's conversion (transformers reads the tokenizer from the file)
    args = ServerArgs(model_path=path, device="cpu", quantization="gguf", max_total_tokens=256).resolve()
    opened = _count_opens(monkeypatch, path)
    runner = ModelRunner(args)
    monkeypatch.undo()
    assert isinstance(runner.model.layers[0].self_attn.qkv_proj.method, GGUFBlocksMethod)
    assert len(opened) == 1, opened


def test_an_engine_start_opens_the_gguf_file_once(tmp_path, monkeypatch):
    """A whole Engine start on a quantized GGUF with every option left to resolve (--quantization and
    --dtype auto, its config folder cached by an earlier start) opens the file once: the options are
    resolved without reading it, and the loader's one header read chooses each linear's method and streams
    every tensor (raw blocks into the block weights, dequantized into the float ones)."""
    from radixlang import Engine
    from radixlang.runtime.models.gguf_quant import GGUFBlocksMethod
    from radixlang.runtime.models.loader.gguf_convert import ensure_converted

    folder = save_tiny_hf_model(str(tmp_path / "hf"), "LlamaForCausalLM", seed=7)
    private_cache(tmp_path / "cache", monkeypatch)
    path = str(tmp_path / "q.gguf")
    t = __import__("gguf").GGMLQuantizationType
    _write_gguf(folder, path, "llama", quant={"attn_q": t.Q8_0, "attn_k": t.Q8_0, "attn_v": t.Q8_0,
                                              "attn_output": t.Q4_0, "ffn_gate": t.Q4_1, "ffn_up": t.Q4_1,
                                              "ffn_down": t.Q4_0})
    ensure_converted(path)  # the first start's conversion (transformers reads the tokenizer from the file)
    opened = _count_opens(monkeypatch, path)
    try:
        engine = Engine(model_path=path, device="cpu", max_total_tokens=256)
    finally:
        monkeypatch.undo()
    with engine:
        assert engine.scheduler.args.quantization == "gguf"
        assert isinstance(engine.scheduler.runner.model.layers[0].mlp.gate_up_proj.method, GGUFBlocksMethod)
        assert engine.generate(input_ids=PROMPTS[0], sampling_params={"max_new_tokens": 2})["output_ids"]
    assert len(opened) == 1, opened


@pytest.mark.e2e
@pytest.mark.parametrize("family", ["qwen2_moe", "mixtral"])
def test_quantized_gguf_experts_are_served_from_their_blocks(tmp_path, monkeypatch, family):
    """A MoE file's stacked expert tensors (Q4_0 gate, Q5_0 up, Q8_0 down, as Q4_K_M files mix a 4-bit and an
    8-bit layout) take the GGUF experts method and are never loaded as float32; prompt log-probabilities match the
    same file run dequantized (--dtype float32) and the greedy tokens agree."""
    import gguf

    from radixlang import Engine
    from radixlang.kernels.cpu import quant as qk
    from radixlang.runtime.models.gguf_experts import GGUFExpertsMethod
    from radixlang.runtime.models.layers.moe import Experts, ExpertsMethod

    arch, hf_arch, _, overrides = MORE_FAMILIES[family]
    folder = save_tiny_hf_model(str(tmp_path / "hf"), hf_arch, seed=7, **overrides)
    private_cache(tmp_path / "cache", monkeypatch)
    path = str(tmp_path / "moe.gguf")
    t = gguf.GGMLQuantizationType
    # gate and up in two layouts: stacked as one q8 weight per expert (gguf_blocks.common_layout)
    _write_gguf(folder, path, arch, quant={"ffn_gate_exps": t.Q4_0, "ffn_up_exps": t.Q5_0, "ffn_down_exps": t.Q8_0,
                                           "attn_q": t.Q8_0, "attn_k": t.Q8_0, "attn_v": t.Q8_0})
    ids = PROMPTS[0]
    greedy = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}
    kw = dict(model_path=path, max_total_tokens=512)
    with Engine(**kw) as quantized:
        model = quantized.scheduler.runner.model
        moe_layers = [layer.mlp for layer in model.layers if hasattr(layer.mlp, "experts")]
        assert moe_layers and all(isinstance(m.experts.method, GGUFExpertsMethod) for m in moe_layers)
        assert {m.experts.method.source_type for m in moe_layers} == {"Q4_0/Q5_0/Q8_0"}
        # on a VNNI CPU the steps below (the 14-token prompt's experts hold a few rows each) run each layer's
        # experts in one compiled call (quant.QuantMoE)
        assert all((m.experts.method.kernel is not None) == (qk.vnni() is not None) for m in moe_layers)
        # never given float32 weights: no w13 / w2 parameter, and no packed float experts
        assert all(m.experts.w13 is None and m.experts.w2 is None and m.experts.packed is None for m in moe_layers)
        assert not any(p.is_meta for p in model.parameters())
        got = quantized.generate(input_ids=ids, sampling_params={"max_new_tokens": 0}, return_logprob=True,
                                 logprob_start_len=0)
        tokens = quantized.generate(input_ids=ids, sampling_params=greedy)["output_ids"]
    with Engine(**kw, dtype="float32") as plain:
        assert all(isinstance(layer.mlp.experts, Experts) and type(layer.mlp.experts.method) is ExpertsMethod
                   for layer in plain.scheduler.runner.model.layers if hasattr(layer.mlp, "experts"))
        want = plain.generate(input_ids=ids, sampling_params={"max_new_tokens": 0}, return_logprob=True,
                              logprob_start_len=0)
        want_tokens = plain.generate(input_ids=ids, sampling_params=greedy)["output_ids"]
    a = torch.tensor([lp for lp, _, _ in got["meta_info"]["input_token_logprobs"][1:]])
    b = torch.tensor([lp for lp, _, _ in want["meta_info"]["input_token_logprobs"][1:]])
    assert len(a) == len(ids) - 1 and (a - b).abs().max() < 2e-3
    assert tokens == want_tokens


def test_gpt_oss_gguf_with_mxfp4_experts_matches_transformers_on_the_rounded_weights(tmp_path, monkeypatch):
    """GPT-OSS GGUFs ship their experts as MXFP4 (32 4-bit values and a shared power-of-two scale a block):
    read dequantized, they give transformers' logprobs and tokens on the weights the blocks hold."""
    import gguf
    from test_model_families import NEW_TOKENS, _hf_greedy
    mxfp4 = gguf.GGMLQuantizationType.MXFP4
    arch, hf_arch, _, overrides = MORE_FAMILIES["gpt_oss"]
    folder = save_tiny_hf_model(str(tmp_path / "hf"), hf_arch, seed=7, **overrides)
    private_cache(tmp_path / "cache", monkeypatch)
    path = str(tmp_path / "mxfp4.gguf")
    _write_gguf(folder, path, arch, quant={"ffn_gate_exps": mxfp4, "ffn_up_exps": mxfp4, "ffn_down_exps": mxfp4})

    def rounded(a: np.ndarray) -> np.ndarray:  # [experts, out, in] through the file's blocks
        return gguf.quants.dequantize(gguf.quants.quantize(np.ascontiguousarray(a), mxfp4), mxfp4)

    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        for layer in hf.model.layers:
            ex = layer.mlp.experts
            gate_up = ex.gate_up_proj.detach().numpy().copy()  # [experts, hidden, 2 * inter]
            for half in (0, 1):
                gate_up[:, :, half::2] = rounded(gate_up[:, :, half::2].transpose(0, 2, 1)).transpose(0, 2, 1)
            ex.gate_up_proj.copy_(torch.from_numpy(gate_up))
            down = rounded(ex.down_proj.detach().numpy().transpose(0, 2, 1)).transpose(0, 2, 1)
            assert not np.allclose(down, ex.down_proj.detach().numpy(), atol=1e-3)  # the blocks round
            ex.down_proj.copy_(torch.from_numpy(np.ascontiguousarray(down)))
    model = load_model(path).model
    _assert_prompt_logprobs(model, hf, "gpt_oss mxfp4")
    assert _greedy(model, PROMPTS[0], NEW_TOKENS) == _hf_greedy(hf, PROMPTS[0])


def test_gguf_sampling_metadata_becomes_the_models_defaults(tmp_path, monkeypatch):
    """general.sampling.* (llama.cpp's converter copies the model's generation_config.json there) gives a
    GGUF's requests the defaults a folder's generation_config.json gives (--generation-config auto)."""
    from radixlang.runtime.generation_config import sampling_defaults
    from radixlang.runtime.models.loader.gguf_convert import ensure_converted
    monkeypatch.setenv("RADIXLANG_CACHE", str(tmp_path / "cache"))
    folder = save_tiny_hf_model(str(tmp_path / "hf"), "LlamaForCausalLM", seed=1)

    def small_tokenizer(w) -> None:  # any tokenizer does: a small one converts in a fraction of SmolLM2's time
        add_gguf_tokenizer(w, "bpe", add_bos=False)

    def tokenizer_and_sampling(w) -> None:
        small_tokenizer(w)
        w.add_float32("general.sampling.temp", 0.6)
        w.add_float32("general.sampling.top_p", 0.9)
        w.add_int32("general.sampling.top_k", 40)
        w.add_float32("general.sampling.penalty_repeat", 1.1)

    path = str(tmp_path / "tiny.gguf")
    _write_gguf(folder, path, "llama", tokenizer=tokenizer_and_sampling)
    got = sampling_defaults("auto", ensure_converted(path))
    assert got == pytest.approx({"temperature": 0.6, "top_p": 0.9, "top_k": 40, "repetition_penalty": 1.1})
    assert isinstance(got["top_k"], int)
    plain = str(tmp_path / "plain.gguf")
    _write_gguf(folder, plain, "llama", tokenizer=small_tokenizer)
    assert sampling_defaults("auto", ensure_converted(plain)) == {}
