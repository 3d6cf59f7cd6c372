"""--quantization gguf: a GGUF file's own quantized blocks, decoded exactly and served through the kernels."""
from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from radixlang.kernels.cpu import quant as qk
from radixlang.runtime.models import gguf_blocks
from radixlang.runtime.server_args import ServerArgs

gguf = pytest.importorskip("gguf")
pytestmark = pytest.mark.skipif(not qk.available(), reason="no C compiler for the quantized kernels")

BLOCK = {"Q4_0": 32, "Q4_1": 32, "Q5_0": 32, "Q5_1": 32, "Q8_0": 32, "Q4_K": 256, "Q5_K": 256, "Q6_K": 256}


def _random_blocks(kind: str, n_blocks: int, seed: int) -> np.ndarray:
    """Random block bytes whose f16 scale fields are small finite numbers (the rest is any bits)."""
    rng = np.random.default_rng(seed)
    size = gguf_blocks.block_bytes(kind)
    raw = rng.integers(0, 256, size=(n_blocks, size), dtype=np.uint8)
    halves = rng.uniform(0.001, 0.05, size=(n_blocks, 2)).astype(np.float16).view(np.uint8)
    if kind == "Q6_K":
        raw[:, 208:210] = halves[:, 0:2]
    elif kind in ("Q8_0", "Q4_0", "Q5_0"):
        raw[:, 0:2] = halves[:, 0:2]
    else:  # d and m (Q4_1, Q5_1) or d and dmin (K types)
        raw[:, 0:4] = halves
    return raw


@pytest.mark.parametrize("kind", list(BLOCK))
def test_decoded_blocks_match_the_gguf_dequantizer(kind):
    rows, cols = 6, 2 * BLOCK[kind] if BLOCK[kind] == 256 else 128
    raw = _random_blocks(kind, rows * cols // BLOCK[kind], seed=len(kind))
    ref = gguf.quants.dequantize(raw.reshape(-1), getattr(gguf.GGMLQuantizationType, kind)).reshape(rows, cols)
    q, scale, offset, group = gguf_blocks.decode_tensor(kind, raw, rows, cols)
    w = gguf_blocks.to_quant_weight(kind, q, scale, offset, group)
    assert w.layout == ("q4" if kind in ("Q4_0", "Q4_1", "Q4_K") else "q8")
    deq = qk.dequantize(w).numpy()
    # the kernel's q * scale + offset rounds once where the reference may round twice
    np.testing.assert_allclose(deq, ref, rtol=1e-6, atol=1e-6 * np.abs(ref).max())
    x = torch.randn(3, cols, generator=torch.Generator().manual_seed(len(kind))).double()
    exact = x @ torch.from_numpy(ref).double().t()
    # a float32 sum of n products is off by at most n * 2**-24 * sum |x_i w_i| (the K types' random
    # scales make that sum ~1e4 while a mis-decoded group moves the result by ~1/32 of it)
    bound = cols * 2.0 ** -24 * (x.abs() @ torch.from_numpy(ref).double().abs().t())
    err = (qk.linear(x.float(), w).double() - exact).abs()
    assert bool((err <= bound).all()), f"{kind}: off by {err.max():.3g}, bound {bound.min():.3g}"


def test_unsupported_tensor_type_names_type_and_tensor(tmp_path):
    from radixlang.runtime.models.loader.gguf_convert import ensure_converted

    path = tmp_path / "bad.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_uint32("llama.attention.head_count", 2)
    w.add_uint32("llama.attention.head_count_kv", 2)
    raw = np.zeros((4, 292), dtype=np.uint8)  # 4 Q8_K blocks of 256: a type gguf cannot dequantize
    w.add_tensor("blk.0.attn_q.weight", raw, raw_dtype=gguf.GGMLQuantizationType.Q8_K)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match=r"'blk\.0\.attn_q\.weight' has type Q8_K"):
        ensure_converted(str(path))


def test_quantized_gguf_is_the_default_and_float32_keeps_the_dequantized_path():
    assert ServerArgs(device="cpu").resolve().quantization == "gguf"  # the embedded file is Q4_1
    assert ServerArgs(device="cpu", dtype="float32").resolve().quantization is None
    assert ServerArgs(device="cpu", quantization="int8").resolve().quantization == "int8"


def _logprobs(engine, prompt):
    out = engine.generate(prompt, {"max_new_tokens": 0}, return_logprob=True, logprob_start_len=0)
    return torch.tensor([lp for lp, _, _ in out["meta_info"]["input_token_logprobs"][1:]])


PROMPTS = ["The capital of France is", "def fibonacci(n):\n    ",
           "List three colors of the rainbow, separated by commas:", "Once upon a time, in a small village,"]


@pytest.mark.e2e
def test_engine_quantized_matches_the_dequantized_file(caplog):
    from radixlang import Engine
    from radixlang.runtime.models.gguf_quant import GGUFBlocksMethod, QuantLinear
    from radixlang.runtime.models.layers.linear import Linear
    from radixlang.runtime.models.loader.model_loader import default_model_path

    path = default_model_path()
    greedy = {"max_new_tokens": 32, "temperature": 0, "ignore_eos": True}
    with caplog.at_level(logging.INFO, logger="radixlang.runtime.models.gguf_quant"):
        with Engine(model_path=path, max_total_tokens=4096) as eq:
            model = eq.scheduler.runner.model
            assert isinstance(model.layers[0].self_attn.qkv_proj.kernel, QuantLinear)
            assert isinstance(model.layers[0].mlp.down_proj.kernel, QuantLinear)
            assert model.lm_head.kernel.source_type == "Q8_0"
            # the 30 layers' q/k/v, o, gate/up and down were never loaded as float32: each was bound to the
            # GGUF blocks method (no float weight) before loading
            blocks = [m for m in model.layers.modules()
                      if isinstance(m, Linear) and isinstance(m.method, GGUFBlocksMethod)]
            assert len(blocks) == 120 and all(m.weight is None for m in blocks)
            assert not any(p.is_meta for p in model.parameters())
            lq = [_logprobs(eq, p) for p in PROMPTS]
            one = eq.generate(PROMPTS[0], greedy)["output_ids"]  # a batch-1 decode: the kernel's one-row tile
            gq = [o["output_ids"] for o in eq.generate(PROMPTS, greedy)]  # 4 rows at once: its multi-row tile
            eq.check_memory_leak()
    assert "210 Q4_1" in caplog.text
    with Engine(model_path=path, max_total_tokens=4096, dtype="float32") as ef:
        assert not isinstance(ef.scheduler.runner.model.layers[0].self_attn.qkv_proj.kernel, QuantLinear)
        lf = [_logprobs(ef, p) for p in PROMPTS]
        gf = [o["output_ids"] for o in ef.generate(PROMPTS, greedy)]
    for a, b in zip(lq, lf):
        assert len(a) == len(b) > 3
        assert (a - b).abs().max() < 2e-3, (a - b).abs().max()
    for a, b in zip(gq, gf):
        assert len(a) == len(b) == 32
        assert sum(x == y for x, y in zip(a, b)) >= 30, (a, b)
    assert sum(x == y for x, y in zip(one, gf[0])) >= 30


def test_prefill_copies_only_within_their_memory_budget(caplog):
    """A big model's float32 prefill copies (4 bytes a weight) would outweigh its quantized blocks many
    times: past the budget none are made, and a prefill dequantizes per call to the same numbers."""
    from torch import nn

    from radixlang.kernels.cpu import quant as qk
    from radixlang.runtime.models.gguf_quant import QuantLinear, add_prefill_copies_
    from radixlang.runtime.models.packed import packing_available

    g = torch.Generator().manual_seed(0)

    def layer(n: int, k: int) -> QuantLinear:
        codes = torch.randint(0, 256, (n, k // 2), generator=g, dtype=torch.uint8)
        w = qk.QuantWeight("q4", codes, torch.rand(n, k // 32, generator=g) * 0.02,
                           -torch.rand(n, k // 32, generator=g) * 0.1, 32, n, k)
        return QuantLinear(w, None, "Q4_1")

    model = nn.Sequential(layer(64, 96), layer(96, 64))
    need = 4 * (64 * 96 + 96 * 64)
    x = torch.randn(40, 96, generator=g)  # more than KERNEL_MAX_ROWS rows: the prefill path
    with torch.inference_mode():
        plain = model(x)
    with caplog.at_level(logging.WARNING, logger="radixlang.runtime.models.gguf_quant"):
        assert add_prefill_copies_(model, max_bytes=need - 1) == 0
    assert all(m.dense is None for m in model) and "would take" in caplog.text
    if packing_available():
        assert add_prefill_copies_(model, max_bytes=need) == 2
        assert all(m.dense is not None for m in model)
        with torch.inference_mode():
            torch.testing.assert_close(model(x), plain, rtol=1e-4, atol=1e-4)


def test_mixed_types_stack_into_one_weight_exactly():
    """Q4_K q/k beside a Q6_K v (llama.cpp's Q4_K_M) or Q4_0 beside Q8_0: stacked as q8 codes in the finest
    group, every weight the gguf package's dequantized value."""
    for kinds in (("Q4_K", "Q4_K", "Q6_K"), ("Q4_0", "Q8_0"), ("Q5_K", "Q4_1")):
        cols = 256
        parts, refs = [], []
        for i, kind in enumerate(kinds):
            raw = _random_blocks(kind, 4 * cols // BLOCK[kind], seed=i)
            refs.append(gguf.quants.dequantize(raw.reshape(-1), getattr(gguf.GGMLQuantizationType, kind))
                        .reshape(4, cols))
            parts.append(gguf_blocks.DecodedBlocks(kind, *gguf_blocks.decode_tensor(kind, raw, 4, cols)))
        stacked = qk.QuantWeight.concat([p.weight() for p in gguf_blocks.common_layout(parts)])
        ref = np.concatenate(refs)
        assert stacked.layout == "q8" and stacked.group == min(gguf_blocks.LAYOUTS[k][1] for k in kinds)
        np.testing.assert_allclose(qk.dequantize(stacked).numpy(), ref, rtol=1e-6, atol=1e-6 * np.abs(ref).max())
