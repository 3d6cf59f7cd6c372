"""The fused decode step (model_executor/decode_stack.py) gives the layer-by-layer path's tokens and logprobs.

Each family runs the same requests twice in one Engine, with the fused step and with it switched off:
batch 1 and 2 (int8 activations), batch 5 (float32 activations), and again over a cached prefix; the same
on float32 weights (the C small-row kernel's row counts).
"""
from __future__ import annotations

import pytest
from tiny_model import FAMILIES, save_tiny_hf_model

from radixlang.kernels.cpu import decode_stack as ds
from radixlang.runtime.model_executor.decode_stack import why_not

pytestmark = pytest.mark.skipif(not ds.available(), reason="the fused decode step's library did not build here")

PROMPTS = [[5 + 7 * i + j for j in range(20 + 9 * i)] for i in range(5)]
GREEDY = {"max_new_tokens": 10, "temperature": 0, "ignore_eos": True}


def _run(engine, prompts):
    outs = engine.generate(input_ids=prompts, sampling_params=GREEDY, return_logprob=True)
    return [([t for _, t, _ in o["meta_info"]["output_token_logprobs"]],
             [lp for lp, _, _ in o["meta_info"]["output_token_logprobs"]]) for o in outs]


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3", "qwen2_sliding"])
def family_dir(request, tmp_path_factory):
    arch, overrides = FAMILIES[request.param]
    return save_tiny_hf_model(str(tmp_path_factory.mktemp(request.param)), arch, seed=5, **overrides)


def _as_q8(w):
    """The same weights as q8 codes in groups of 32 (code - 8, offset + 8 scale), in this CPU's layout."""
    import torch

    from radixlang.kernels.cpu import quant as qk
    p = w.plain()
    n, k = p.out_features, p.in_features
    c = p.codes.view(n, k // 32, 16)
    q = torch.cat([c & 15, c >> 4], dim=-1).view(n, k).to(torch.int8) - 8
    return qk.QuantWeight("q8", q.contiguous(), p.scales, p.offsets + 8 * p.scales, 32, n, k).interleave()


@pytest.mark.e2e
@pytest.mark.parametrize("codes", ["q4", "q8"])
def test_fused_decode_matches_layer_by_layer(family_dir, codes):
    from radixlang import Engine
    from radixlang.runtime.models.gguf_quant import QuantLinear
    with Engine(model_path=family_dir, quantization="int4", max_total_tokens=4096) as engine:
        runner = engine.scheduler.runner
        model = runner.model
        batches = [PROMPTS[:1], PROMPTS[1:3], PROMPTS]
        if codes == "q8":  # Q8_0 / Q5_K / Q6_K files' layout, on the same numbers as the q4 run first
            as_q4 = [_run(engine, b) for b in batches]
            for m in model.modules():
                if isinstance(m, QuantLinear):
                    m.weight_q = _as_q8(m.weight_q)
            runner.decode_stack._pool = None  # its layer structs point at the weights they were made from
            engine.flush_cache()
        stack = runner.decode_stack
        assert stack is not None, why_not(model)
        calls = []
        forward = stack.forward
        stack.forward = lambda *a: calls.append(1) or forward(*a)
        fused = [_run(engine, b) for b in batches] + [_run(engine, PROMPTS[:2])]  # the last over cached prefixes
        assert len(calls) >= 4 * (GREEDY["max_new_tokens"] - 1)  # every decode step took the fused call
        runner.decode_stack = None
        engine.flush_cache()
        plain = [_run(engine, b) for b in batches] + [_run(engine, PROMPTS[:2])]
        engine.check_memory_leak()
    for fb, pb in zip(fused, plain):
        for (ft, fl), (pt, pl) in zip(fb, pb):
            assert ft == pt
            assert max(abs(a - b) for a, b in zip(fl, pl)) < 1e-4
    for qb, fb in zip(as_q4 if codes == "q8" else [], fused):
        for (qt, ql), (ft, fl) in zip(qb, fb):
            assert qt == ft and max(abs(a - b) for a, b in zip(ql, fl)) < 1e-4


@pytest.mark.e2e
@pytest.mark.parametrize("family, reason", [("gemma2", "not the plain Llama layer")])
def test_fused_decode_refuses_what_it_cannot_run(family, reason, tmp_path):
    from radixlang import Engine
    arch, overrides = FAMILIES[family]
    folder = save_tiny_hf_model(str(tmp_path), arch, seed=5, **overrides)
    with Engine(model_path=folder, quantization="int4", max_total_tokens=1024) as engine:
        runner = engine.scheduler.runner
        model = runner.model
        assert runner.decode_stack is None
        assert reason in why_not(model)
        out = engine.generate(input_ids=PROMPTS[0], sampling_params=GREEDY)
        assert out["meta_info"]["completion_tokens"] == GREEDY["max_new_tokens"]


@pytest.mark.e2e
def test_fused_decode_on_float32_weights(family_dir):
    """A float32 model (packed linears with their row-major copy) takes the fused step for the row counts
    whose small-row matmul is the C kernel, with the layer-by-layer path's tokens and logprobs; other row
    counts (here 5, and 3 once calibration picked another kernel for it) run layer by layer."""
    from radixlang import Engine
    from radixlang.runtime.model_executor.decode_stack import DecodeStack
    from radixlang.runtime.models.packed import PackedLinear
    with Engine(model_path=family_dir, dtype="float32", max_total_tokens=4096) as engine:
        runner = engine.scheduler.runner
        model = runner.model
        packed = [m for m in model.modules() if isinstance(m, PackedLinear) and m is not model.lm_head]
        assert packed and all(m.plain is not None for m in packed)
        for m in packed:  # as calibration would leave them where the C kernel wins (it is skipped on tiny models)
            m.small_kernels = ["c"] * len(m.small_kernels)
        packed[0].small_kernels[3] = "aten"  # one linear calibrated faster elsewhere at 3 rows
        runner.decode_stack = stack = DecodeStack.build(model)
        assert stack is not None and stack.float32 and stack.rows == {1, 2, 4}, why_not(model)
        taken = []
        forward = stack.forward

        def counted(ids, pos, fb):
            hidden = forward(ids, pos, fb)
            taken.append((ids.numel(), hidden is not None))
            return hidden
        stack.forward = counted
        batches = [PROMPTS[:1], PROMPTS[1:3], PROMPTS[:3], PROMPTS]
        fused = [_run(engine, b) for b in batches] + [_run(engine, PROMPTS[:2])]  # the last over cached prefixes
        assert {(1, True), (2, True), (3, False), (5, False)} <= set(taken)
        assert sum(ok for _, ok in taken) >= 3 * (GREEDY["max_new_tokens"] - 1)
        runner.decode_stack = None
        engine.flush_cache()
        plain = [_run(engine, b) for b in batches] + [_run(engine, PROMPTS[:2])]
        engine.check_memory_leak()
        for m in packed:
            m.small_kernels = ["aten"] * len(m.small_kernels)
        assert "small-row kernel" in why_not(model)
    for fb, pb in zip(fused, plain):
        for (ft, fl), (pt, pl) in zip(fb, pb):
            assert ft == pt
            assert max(abs(a - b) for a, b in zip(fl, pl)) < 1e-4


@pytest.mark.e2e
def test_fused_decode_needs_quantized_or_packed_linears(tiny_model_dir):
    from radixlang import Engine
    with Engine(model_path=tiny_model_dir, load_format="dummy", max_total_tokens=1024,
                disable_weight_packing=True) as engine:
        runner = engine.scheduler.runner
        model = runner.model
        assert runner.decode_stack is None
        assert "not quantized or packed float32" in why_not(model)


@pytest.mark.e2e
def test_fused_step_takes_speculative_verifies(tmp_path):
    """n-gram drafts are verified in an extend of a few tokens per request: with 64-dim heads (the extend
    kernel's) that extend runs fused too, and gives the layer-by-layer tokens."""
    from radixlang import Engine
    from radixlang.kernels.attention.base import ForwardMode
    arch, overrides = FAMILIES["qwen3"]
    folder = save_tiny_hf_model(str(tmp_path), arch, seed=5, **overrides, head_dim=64)
    # a prompt that repeats itself, so that drafts are found and some accepted
    prompts = [[11, 12, 13, 14, 15, 16, 17, 18] * 4, list(range(40, 60)) * 2]
    with Engine(model_path=folder, quantization="int4", max_total_tokens=4096, speculative_algorithm="ngram",
                speculative_num_draft_tokens=3) as engine:
        runner = engine.scheduler.runner
        model = runner.model
        stack = runner.decode_stack
        assert stack is not None, why_not(model)
        taken = []
        forward = stack.forward

        def counted(ids, pos, fb):
            hidden = forward(ids, pos, fb)
            taken.append((fb.forward_mode, hidden is not None))
            return hidden
        stack.forward = counted
        fused = _run(engine, prompts) + _run(engine, prompts[:1])
        assert (ForwardMode.EXTEND, True) in taken  # the verifies ran fused
        runner.decode_stack = None
        engine.flush_cache()
        plain = _run(engine, prompts) + _run(engine, prompts[:1])
    for (ft, fl), (pt, pl) in zip(fused, plain):
        assert ft == pt
        assert max(abs(a - b) for a, b in zip(fl, pl)) < 1e-4


@pytest.mark.e2e
def test_fused_decode_reads_window_layers_through_the_swa_map(tmp_path):
    """A Mistral-style model with its window KV in a small swa slot space (the slots wrap around within the
    first requests, so a token's swa slot differs from its full slot): the fused step's tokens and logprobs
    are the layer-by-layer path's over generations many windows long."""
    from radixlang import Engine
    from radixlang.runtime.mem_cache.swa_memory_pool import SWATokenToKVPool
    arch, overrides = FAMILIES["mistral_sliding"]
    folder = save_tiny_hf_model(str(tmp_path / "m"), arch, seed=5, **{**overrides, "sliding_window": 8})
    long = {**GREEDY, "max_new_tokens": 48}
    with Engine(model_path=folder, quantization="int4", max_total_tokens=1024, chunked_prefill_size=16,
                swa_full_tokens_ratio=0.05) as engine:
        assert isinstance(engine.scheduler.kv_pool, SWATokenToKVPool)
        runner = engine.scheduler.runner
        model = runner.model
        stack = runner.decode_stack
        assert stack is not None, why_not(model)
        calls = []
        forward = stack.forward
        stack.forward = lambda *a: calls.append(1) or forward(*a)
        runs = [engine.generate(input_ids=PROMPTS[:k], sampling_params=long, return_logprob=True) for k in (1, 2)]
        fused = [[o["meta_info"]["output_token_logprobs"] for o in r] for r in runs]
        assert len(calls) >= 2 * 47
        runner.decode_stack = None
        engine.flush_cache()
        runs = [engine.generate(input_ids=PROMPTS[:k], sampling_params=long, return_logprob=True) for k in (1, 2)]
        plain = [[o["meta_info"]["output_token_logprobs"] for o in r] for r in runs]
        engine.check_memory_leak()
    for fb, pb in zip(fused, plain):
        for f, p in zip(fb, pb):
            assert [t for _, t, _ in f] == [t for _, t, _ in p]
            assert max(abs(a - b) for (a, _, _), (b, _, _) in zip(f, p)) < 1e-4
