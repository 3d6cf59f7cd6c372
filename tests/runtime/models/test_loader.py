"""Loader: safetensors folders, dummy weights, the GGUF conversion cache, RoPE scaling, clear errors."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from radixlang.runtime.models.loader.gguf_convert import converted_dir_for
from radixlang.runtime.models.loader.gguf_weights import _unpermute
from radixlang.runtime.models.loader.model_loader import default_model_path, load_model, resolve_model_dir
from test_models import _run_ours
from tiny_model import make_tiny_model_dir, make_tiny_safetensors_dir, smollm_hf_model

IDS = [1, 400, 2000, 7, 31000, 12, 99, 5, 48000, 3] * 5  # 50 positions: long enough for RoPE scaling to matter


def _hf(folder: str, ids: list[int]) -> torch.Tensor:
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()


def _assert_close(ours: torch.Tensor, ref: torch.Tensor) -> None:
    rel = ((ours - ref).abs().max() / ref.abs().max()).item()
    assert rel < 1e-4, rel


@pytest.mark.parametrize("rope_scaling", [
    None,
    {"rope_type": "linear", "factor": 4.0},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 16},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "beta_fast": 8.0,
     "attention_factor": 1.3},
])
def test_safetensors_folder_matches_transformers(tmp_path, rope_scaling):
    folder = make_tiny_safetensors_dir(str(tmp_path), rope_scaling=rope_scaling)
    loaded = load_model(folder)
    assert loaded.model_path == folder and loaded.tokenizer is not None
    _assert_close(_run_ours(loaded.model, IDS), _hf(folder, IDS))


def test_rope_scaling_changes_logits(tmp_path):
    plain = load_model(make_tiny_safetensors_dir(str(tmp_path / "a")))
    scaled = load_model(make_tiny_safetensors_dir(str(tmp_path / "b"), rope_scaling={"rope_type": "linear",
                                                                                       "factor": 4.0}))
    assert not torch.allclose(_run_ours(plain.model, IDS), _run_ours(scaled.model, IDS), atol=1e-4)


def test_dummy_weights_are_seeded(tmp_path):
    folder = make_tiny_model_dir(str(tmp_path))
    a, b = load_model(folder, load_format="dummy", seed=1), load_model(folder, load_format="dummy", seed=1)
    c = load_model(folder, load_format="dummy", seed=2)
    wa, wb, wc = (m.model.embed_tokens.weight for m in (a, b, c))
    assert torch.equal(wa, wb) and not torch.equal(wa, wc)
    assert 0.01 < wa.std().item() < 0.04
    assert torch.equal(a.model.norm.weight, torch.ones_like(a.model.norm.weight))


def test_errors_say_what_was_expected(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_model(str(tmp_path / "nope"))
    folder = make_tiny_model_dir(str(tmp_path / "cfg"))
    with pytest.raises(FileNotFoundError, match="safetensors"):
        load_model(folder)  # config only, no weights, no dummy
    with open(os.path.join(folder, "config.json")) as f:
        cfg = json.load(f)
    cfg["rope_scaling"] = {"rope_type": "su", "factor": 2.0}  # an early Phi-3 name, before "longrope"
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(cfg, f)
    with pytest.raises(ValueError, match="'su' is not supported"):
        load_model(folder, load_format="dummy")


def test_unpermute_inverts_llama_cpp_permute():
    def permute(w: np.ndarray, n_head: int) -> np.ndarray:  # what llama.cpp's converter does to Q/K
        return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    w = np.random.default_rng(0).standard_normal((3 * 8, 5)).astype(np.float32)
    assert np.array_equal(_unpermute(permute(w, 3), 3), w)
    assert not np.array_equal(permute(w, 3), w)


def test_gguf_conversion_is_cached_with_smollm_config(smollm_path):
    gguf = default_model_path()
    assert gguf.endswith(".gguf")
    assert resolve_model_dir(None) == smollm_path == str(converted_dir_for(gguf))
    assert resolve_model_dir(gguf) == smollm_path
    assert os.path.exists(os.path.join(smollm_path, "complete"))
    with open(os.path.join(smollm_path, "config.json")) as f:
        cfg = json.load(f)
    assert (cfg["num_hidden_layers"], cfg["hidden_size"], cfg["num_attention_heads"],
            cfg["num_key_value_heads"], cfg["vocab_size"]) == (30, 576, 9, 3, 49152)
    assert cfg["tie_word_embeddings"] is True
    loaded = load_model(None)
    assert "<|im_start|>" in loaded.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}],
                                                                   tokenize=False)


def test_gguf_weights_equal_transformers_gguf_loading(smollm_path):
    """The converted folder holds no weights (config and tokenizer only); loading it, or the GGUF file,
    reads the file's tensors: the weights transformers' own GGUF loader gives."""
    from test_models import _ours_to_hf_state
    assert not [f for f in os.listdir(smollm_path) if f.endswith((".safetensors", ".bin"))]
    ref = smollm_hf_model().state_dict()
    for path in (smollm_path, default_model_path()):
        ours = _ours_to_hf_state(load_model(path).model)
        assert len(ours) == len(ref) - ("lm_head.weight" in ref and "lm_head.weight" not in ours)
        for name, tensor in ours.items():
            assert torch.allclose(tensor, ref[name], atol=1e-6), name


def _rewrite_safetensors(folder: str, edit) -> None:
    from safetensors.torch import load_file, save_file
    path = os.path.join(folder, "model.safetensors")
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def test_missing_or_unexpected_tensor_is_named(tmp_path):
    folder = make_tiny_safetensors_dir(str(tmp_path / "a"))
    _rewrite_safetensors(folder, lambda t: t.pop("model.layers.1.mlp.down_proj.weight"))
    with pytest.raises(ValueError, match=r"missing.*layers\.1\.mlp\.down_proj\.weight"):
        load_model(folder)
    folder = make_tiny_safetensors_dir(str(tmp_path / "b"))
    _rewrite_safetensors(folder, lambda t: t.update({"model.layers.0.extra_gate.weight": torch.zeros(3)}))
    with pytest.raises(ValueError, match=r"unexpected weight 'layers\.0\.extra_gate\.weight'"):
        load_model(folder)


def test_unknown_architecture_lists_supported(tmp_path):
    folder = make_tiny_model_dir(str(tmp_path))
    with open(os.path.join(folder, "config.json")) as f:
        cfg = json.load(f)
    cfg["architectures"] = ["FancyNewForCausalLM"]
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(cfg, f)
    with pytest.raises(ValueError, match=r"FancyNewForCausalLM.*supported: .*LlamaForCausalLM.*Qwen3ForCausalLM"):
        load_model(folder, load_format="dummy")


def test_sharded_checkpoint_loads(tmp_path):
    """model.safetensors.index.json with several shards, as transformers writes a big model."""
    from transformers import AutoModelForCausalLM as Auto
    folder = make_tiny_safetensors_dir(str(tmp_path / "one"))
    sharded = str(tmp_path / "sharded")
    Auto.from_pretrained(folder, dtype=torch.float32).save_pretrained(sharded, max_shard_size="2MB")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        os.link(os.path.join(folder, name), os.path.join(sharded, name))
    assert os.path.exists(os.path.join(sharded, "model.safetensors.index.json"))
    assert len([f for f in os.listdir(sharded) if f.endswith(".safetensors")]) > 1
    _assert_close(_run_ours(load_model(sharded).model, IDS), _hf(folder, IDS))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_checkpoint_loads_into_model_dtype(tmp_path, dtype):
    from transformers import AutoModelForCausalLM as Auto
    folder = make_tiny_safetensors_dir(str(tmp_path / "fp32"))
    half = str(tmp_path / "half")
    Auto.from_pretrained(folder, dtype=dtype).save_pretrained(half)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        os.link(os.path.join(folder, name), os.path.join(half, name))
    model = load_model(half, dtype=torch.float32).model
    assert model.embed_tokens.weight.dtype == torch.float32
    ref = Auto.from_pretrained(half, dtype=torch.float32).state_dict()
    assert torch.equal(model.embed_tokens.weight, ref["model.embed_tokens.weight"])  # widened exactly


def test_hub_id_resolves_from_local_cache(tmp_path):
    """HF_HOME holds a snapshot laid out as huggingface_hub does; no network (HF_HUB_OFFLINE=1)."""
    import subprocess
    import sys
    src = make_tiny_safetensors_dir(str(tmp_path / "src"))
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hf" / "hub" / "models--tiny-org--tiny-llama"
    snap = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True)
    snap.mkdir(parents=True)
    for name in os.listdir(src):  # the hub cache keeps blobs by hash and links them into the snapshot
        blob = repo / "blobs" / f"blob-{name}"
        os.link(os.path.join(src, name), blob)
        os.symlink(os.path.relpath(blob, snap), snap / name)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    code = ("from radixlang.runtime.models.loader.model_loader import load_model; "
            "m = load_model('tiny-org/tiny-llama'); print(m.model_path); print(type(m.model).__name__)")
    env = dict(os.environ, HF_HOME=str(tmp_path / "hf"), HF_HUB_OFFLINE="1")
    env.pop("HF_HUB_CACHE", None)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["tiny-org/tiny-llama", "LlamaForCausalLM"]
    code_missing = "from radixlang.runtime.models.loader.model_loader import load_model; load_model('tiny-org/absent')"
    out = subprocess.run([sys.executable, "-c", code_missing], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    assert "'tiny-org/absent' is neither a local path nor in the Hugging Face cache" in out.stderr


def test_loader_import_leaves_hub_offline_unset():
    import subprocess
    import sys
    env = {k: v for k, v in os.environ.items() if k != "HF_HUB_OFFLINE"}
    code = "import os, radixlang.runtime.models.loader.model_loader; print(os.environ.get('HF_HUB_OFFLINE'))"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "None", out.stderr[-2000:]


def _float32_tensors_made(fn):
    """Run fn(); return (fn's result, the shapes of every non-meta float32 tensor any torch op created)."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    shapes: list[tuple[int, ...]] = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor) and t.dtype == torch.float32 and t.device.type != "meta":
                    shapes.append(tuple(t.shape))
            return out

    with Record():
        result = fn()
    return result, shapes


def test_bf16_checkpoint_loads_without_a_float32_copy(tmp_path):
    """Built on the meta device and filled tensor by tensor: no float32 weight ever exists on the way
    to a bfloat16 model (building it in float32 and casting afterwards makes one of every matrix)."""
    from transformers import AutoModelForCausalLM as Auto
    folder = make_tiny_safetensors_dir(str(tmp_path / "fp32"))
    half = str(tmp_path / "bf16")
    Auto.from_pretrained(folder, dtype=torch.bfloat16).save_pretrained(half, max_shard_size="1MB")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        os.link(os.path.join(folder, name), os.path.join(half, name))
    loaded, shapes = _float32_tensors_made(lambda: load_model(half, dtype=torch.bfloat16))
    params = dict(loaded.model.named_parameters())
    assert all(p.dtype == torch.bfloat16 for p in params.values())
    matrices = {tuple(p.shape) for p in params.values() if p.dim() >= 2}
    assert not [s for s in shapes if s in matrices]
    fp32_bytes = sum(4 * int(np.prod(s)) for s in shapes)
    assert fp32_bytes < 0.1 * sum(4 * p.numel() for p in params.values())  # the rotary tables only
    ref = Auto.from_pretrained(half, dtype=torch.bfloat16).state_dict()
    assert torch.equal(loaded.model.embed_tokens.weight, ref["model.embed_tokens.weight"])
    assert torch.equal(loaded.model.layers[1].mlp.down_proj.weight, ref["model.layers.1.mlp.down_proj.weight"])
    q, k, v = (ref[f"model.layers.0.self_attn.{n}_proj.weight"] for n in "qkv")
    assert torch.equal(loaded.model.layers[0].self_attn.qkv_proj.weight, torch.cat([q, k, v]))


def test_index_names_the_shards(tmp_path):
    """A stray consolidated.safetensors beside the indexed shards is not read; a shard the index names
    but the folder lacks is named."""
    from transformers import AutoModelForCausalLM as Auto
    folder = make_tiny_safetensors_dir(str(tmp_path / "one"))
    sharded = str(tmp_path / "sharded")
    Auto.from_pretrained(folder, dtype=torch.float32).save_pretrained(sharded, max_shard_size="2MB")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        os.link(os.path.join(folder, name), os.path.join(sharded, name))
    from safetensors.torch import save_file
    save_file({"junk.weight": torch.zeros(2)}, os.path.join(sharded, "consolidated.safetensors"))
    _assert_close(_run_ours(load_model(sharded).model, IDS), _hf(folder, IDS))
    with open(os.path.join(sharded, "model.safetensors.index.json")) as f:
        shard = sorted(set(json.load(f)["weight_map"].values()))[-1]
    os.remove(os.path.join(sharded, shard))
    with pytest.raises(FileNotFoundError, match=shard):
        load_model(sharded)
