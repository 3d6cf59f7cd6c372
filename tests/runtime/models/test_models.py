"""Our model's logits against transformers' on the same weights."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from radixlang.kernels import cpu as cpu_ops
from radixlang.kernels.attention.base import ForwardMode
from radixlang.kernels.attention.cpu_backend import CpuAttnBackend
from radixlang.kernels.attention.torch_native import TorchNativeAttnBackend
from radixlang.runtime.model_executor.forward_batch import ForwardBatch
from radixlang.runtime.mem_cache.memory_pool import MLATokenToKVPool, ReqToTokenPool, TokenToKVPool
from radixlang.runtime.models.llama import LlamaForCausalLM
from radixlang.runtime.models.loader.model_loader import load_model
from tiny_model import make_tiny_model_dir, smollm_hf_model


def _run_ours(model: LlamaForCausalLM, ids: list[int], *, decode_last: bool = False,
              cpu_kernels: bool = False, keep_rows: list[int] | None = None) -> torch.Tensor:
    """Logits of every position through the paged pool: one EXTEND over the prompt, or with
    ``decode_last`` an EXTEND over ids[:-1] then a DECODE of ids[-1]; [n, vocab]. ``cpu_kernels``:
    the model's small ops and the decode attention on radixlang's compiled CPU kernels. ``keep_rows``:
    the EXTEND returns only those rows' logits."""
    n = len(ids)
    mla = getattr(model, "mla_latent", None)  # (latent_dim, value_dim): MLA caches one latent per token
    pool = (TokenToKVPool(n + 4, num_layers=len(model.layers), num_kv_heads=model.num_kv_heads,
                          head_dim=model.head_dim, dtype=torch.float32, device="cpu") if mla is None
            else MLATokenToKVPool(n + 4, num_layers=len(model.layers), latent_dim=mla[0], value_dim=mla[1],
                                  dtype=torch.float32, device="cpu"))
    reqs = ReqToTokenPool(2, n + 4, "cpu")
    loc = pool.alloc(n)
    reqs.req_to_token[0, :n] = loc.to(torch.int32)
    if cpu_kernels:
        if not model.use_cpu_kernels():
            pytest.skip(f"CPU kernels unavailable: {cpu_ops.unavailable_reason()}")
        backend = CpuAttnBackend(model.num_heads, model.num_kv_heads, model.head_dim)
    else:
        backend = TorchNativeAttnBackend(model.num_heads, model.num_kv_heads, model.head_dim)
    cut = n - 1 if decode_last else n
    steps = [(ForwardMode.EXTEND, 0, cut)] + ([(ForwardMode.DECODE, cut, n)] if decode_last else [])
    out = []
    for mode, start, end in steps:
        fb = ForwardBatch(forward_mode=mode, batch_size=1, input_ids=torch.tensor(ids[start:end]),
                          positions=torch.arange(start, end), req_pool_indices=torch.tensor([0]),
                          seq_lens=torch.tensor([end]), seq_lens_cpu=[end], extend_prefix_lens_cpu=[start],
                          extend_seq_lens_cpu=[end - start], out_cache_loc=loc[start:end],
                          req_to_token=reqs.req_to_token, token_to_kv_pool=pool, attn_backend=backend)
        backend.init_forward_metadata(fb)
        keep = torch.tensor(keep_rows) if keep_rows is not None and mode is ForwardMode.EXTEND else None
        out.append(model.compute_logits(model(fb.input_ids, fb.positions, fb, keep)))
    return torch.cat(out)


def _hf_logits(folder: str, ids: list[int], state_dict=None) -> torch.Tensor:
    if state_dict is None:
        hf = AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32)
    else:
        hf = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder), torch_dtype=torch.float32)
        hf.load_state_dict(state_dict, strict=False)
        hf.tie_weights()
    hf.eval()
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()


def _ours_to_hf_state(model: LlamaForCausalLM) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in model.named_parameters():
        key = "model." + name if not name.startswith("lm_head") else name
        if ".qkv_proj." in name:
            q, kv = model.num_heads * model.head_dim, model.num_kv_heads * model.head_dim
            for part, sl in (("q_proj", slice(0, q)), ("k_proj", slice(q, q + kv)), ("v_proj", slice(q + kv, None))):
                out[key.replace("qkv_proj", part)] = p.data[sl]
        elif ".gate_up_proj." in name:
            inter = model.config.intermediate_size
            out[key.replace("gate_up_proj", "gate_proj")] = p.data[:inter]
            out[key.replace("gate_up_proj", "up_proj")] = p.data[inter:]
        else:
            out[key] = p.data
    return out


@pytest.mark.parametrize("cpu_kernels", [False, True], ids=["torch_ops", "cpu_kernels"])
@pytest.mark.parametrize("model_type,tie", [("llama", True), ("llama", False), ("qwen2", False)])
def test_tiny_random_matches_transformers(tmp_path, model_type, tie, cpu_kernels):
    folder = make_tiny_model_dir(str(tmp_path), model_type=model_type, tie=tie, kv_heads=2, heads=4)
    loaded = load_model(folder, load_format="dummy", seed=3)
    state = _ours_to_hf_state(loaded.model)
    if model_type == "qwen2":  # random biases, so the bias path is exercised
        for k in [k for k in state if k.endswith("_proj.bias")]:
            state[k] = torch.randn_like(state[k]) * 0.1
        loaded.model.load_weights(state.items())
    ids = [1, 400, 2000, 7, 31000, 12, 99, 5, 48000, 3]
    ours = _run_ours(loaded.model, ids, decode_last=cpu_kernels, cpu_kernels=cpu_kernels)
    ref = _hf_logits(folder, ids, state_dict=state)
    assert torch.allclose(ours, ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item()), (ours - ref).abs().max()


@pytest.mark.parametrize("cpu_kernels", [False, True], ids=["torch_ops", "cpu_kernels"])
def test_smollm_gguf_matches_transformers(cpu_kernels):
    loaded = load_model(None)
    ids = loaded.tokenizer.encode("The quick brown fox jumps over the lazy dog. In 1905, Einstein")
    ours = _run_ours(loaded.model, ids, decode_last=cpu_kernels, cpu_kernels=cpu_kernels)
    with torch.no_grad():
        ref = smollm_hf_model()(torch.tensor([ids])).logits[0].float()
    rel = ((ours - ref).abs().max() / ref.abs().max()).item()
    assert rel < 1e-4, rel
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


@pytest.mark.parametrize("cpu_kernels", [False, True], ids=["torch_ops", "cpu_kernels"])
def test_long_prefill_matches_transformers(tmp_path, cpu_kernels, monkeypatch):
    """A prefill longer than a packed matmul slice: with the CPU kernels the MLP runs slice by slice."""
    from radixlang.runtime.models import llama, packed
    folder = make_tiny_model_dir(str(tmp_path), kv_heads=2, heads=4)
    loaded = load_model(folder, load_format="dummy", seed=5)
    n = 2 * packed.CHUNK_ROWS + 37
    slices = []
    real = llama.MLP._hidden  # what the MLP runs, recorded where the compiled kernels run it
    monkeypatch.setattr(llama.MLP, "_hidden",
                        lambda self, x: (self.fused and slices.append(x.shape[0])) or real(self, x))
    ids = torch.randint(0, 49152, (n,), generator=torch.Generator().manual_seed(0)).tolist()
    ours = _run_ours(loaded.model, ids, cpu_kernels=cpu_kernels)
    ref = _hf_logits(folder, ids, state_dict=_ours_to_hf_state(loaded.model))
    assert torch.allclose(ours, ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item()), (ours - ref).abs().max()
    layers = len(loaded.model.layers)
    assert slices == ([packed.CHUNK_ROWS, packed.CHUNK_ROWS, 37] * layers if cpu_kernels else [])


@pytest.mark.parametrize("cpu_kernels", [False, True], ids=["torch_ops", "cpu_kernels"])
def test_keep_rows_computes_only_those_rows(tmp_path, cpu_kernels, monkeypatch):
    """The runner asks for the rows it takes logits of: the same numbers as the full forward, and the
    last layer's MLP runs on those rows alone."""
    from radixlang.runtime.models import llama
    folder = make_tiny_model_dir(str(tmp_path), kv_heads=2, heads=4)
    model = load_model(folder, load_format="dummy", seed=7).model
    ids = list(range(100, 400, 7))
    keep = [0, 5, 6, len(ids) - 1]
    full = _run_ours(model, ids, cpu_kernels=cpu_kernels)
    mlp_rows = []
    real = llama.MLP.forward
    monkeypatch.setattr(llama.MLP, "forward", lambda self, x: mlp_rows.append(x.shape[0]) or real(self, x))
    part = _run_ours(model, ids, cpu_kernels=cpu_kernels, keep_rows=keep)
    torch.testing.assert_close(part, full[keep], rtol=1e-5, atol=1e-5)
    assert mlp_rows == [len(ids)] * (len(model.layers) - 1) + [len(keep)]
