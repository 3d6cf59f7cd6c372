"""A quantized GGUF under tensor parallelism (models/gguf_quant.py): each rank keeps its slice of every block
tensor, whole output rows of the column-parallel projections and whole groups of the row-parallel ones'
input features; a row-parallel slice that would cut a group keeps that linear dequantized, with a warning.
The slices against the whole tensor for every block type, then tp=2 against tp=1 through the Engine."""
from __future__ import annotations

import logging

import pytest
import torch

from radixlang.kernels.cpu import quant as qk
from radixlang.runtime.models.gguf_blocks import DecodedBlocks, decode_tensor
from radixlang.runtime.models.parallel import column_part_rows
from test_quant_gguf import BLOCK, _random_blocks
from tp_runs import SHARED, all_logprobs, run_shared_prefix

gguf = pytest.importorskip("gguf")
pytestmark = pytest.mark.skipif(not qk.available(), reason="no C compiler for the quantized kernels")


class _Rank:
    def __init__(self, rank: int, size: int) -> None:
        self.rank, self.size = rank, size


def _activations() -> list[str]:
    return ["float32", "int8x3"] if qk.vnni() else ["float32"]


@pytest.mark.parametrize("kind", list(BLOCK))
def test_rank_slices_are_the_whole_tensors_rows_and_groups(kind):
    """Rows and group-aligned columns of the decoded blocks are exactly those of the whole weight, and the
    ranks' partial sums add up to the whole product within float32 rounding, float32 or int8 activations."""
    rows, cols = 32, 512  # two K-type super-blocks a row; four ranks cut them, on 32-feature groups
    full = DecodedBlocks(kind, *decode_tensor(kind, _random_blocks(kind, rows * cols // BLOCK[kind], seed=3),
                                              rows, cols))
    whole = full.weight().interleave()  # the layout a QuantLinear keeps
    deq = qk.dequantize(whole)
    x = torch.randn(2, cols, generator=torch.Generator().manual_seed(1))
    # the int8 kernels quantize x per group of 32 (the same groups on every rank: slices start on them), so
    # each rank's terms are the whole product's; only the float32 order of the sums differs, each sum off
    # the exact one by at most cols * 2**-24 * sum |x_i w_i|: two sums differ by at most twice that
    bound = 2 * cols * 2.0 ** -24 * (x.abs() @ deq.abs().t())
    for size in (2, 4):
        per_col, per_row = cols // size, rows // size
        for acts in _activations():
            want = qk.linear(x, whole, activations=acts)
            got = torch.zeros_like(want)
            for r in range(size):
                cut = full.cols(r * per_col, (r + 1) * per_col).weight().interleave()
                assert torch.equal(qk.dequantize(cut), deq[:, r * per_col:(r + 1) * per_col])
                got += qk.linear(x[:, r * per_col:(r + 1) * per_col].contiguous(), cut, activations=acts)
                part = full.rows(r * per_row, (r + 1) * per_row).weight()
                assert torch.equal(qk.dequantize(part), deq[r * per_row:(r + 1) * per_row])
            err = (got - want).abs()
            assert bool((err <= bound).all()), (kind, size, acts, float(err.max()))
    with pytest.raises(ValueError, match="cut its groups"):
        full.cols(0, 40)
    padded = full.rows(24, 32).padded(16)
    assert padded.q.shape == (16, cols) and not qk.dequantize(padded.weight())[8:].any()


def test_column_part_rows_follow_the_head_split():
    # 4 q heads and 2 kv heads of 8 rows: two ranks take 2 q heads and 1 kv head each
    assert [column_part_rows("q", 32, _Rank(r, 2), num_kv_heads=2) for r in range(2)] == [(0, 16), (16, 32)]
    assert [column_part_rows("k", 16, _Rank(r, 2), num_kv_heads=2) for r in range(2)] == [(0, 8), (8, 16)]
    # four ranks over 2 kv heads: adjacent ranks share (replicate) one
    assert [column_part_rows("v", 16, _Rank(r, 4), num_kv_heads=2) for r in range(4)] == [(0, 8), (0, 8),
                                                                                           (8, 16), (8, 16)]
    assert column_part_rows("up", 96, _Rank(1, 2), num_kv_heads=2) == (48, 96)
    with pytest.raises(ValueError, match="gate rows"):
        column_part_rows("gate", 30, _Rank(0, 4), num_kv_heads=2)


def test_quantized_gguf_is_served_quantized_under_tensor_parallelism():
    from radixlang.runtime.server_args import ServerArgs
    assert ServerArgs(device="cpu", tp_size=2).resolve().quantization == "gguf"  # the embedded file is Q4_1
    assert ServerArgs(device="cpu", tp_size=2, quantization="gguf").quantization == "gguf"
    with pytest.raises(ValueError, match="'int8' is not supported with tp_size > 1"):
        ServerArgs(tp_size=2, quantization="int8")


T = gguf.GGMLQuantizationType
CASES = {
    # o_proj's 128 inputs are 64 a rank: every linear and the untied logits are served from blocks
    "llama": ("llama", "LlamaForCausalLM",
              dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=32, intermediate_size=256),
              {"attn_q": T.Q4_0, "attn_k": T.Q4_0, "attn_v": T.Q4_0, "attn_output": T.Q8_0, "ffn_gate": T.Q4_1,
               "ffn_up": T.Q4_1, "ffn_down": T.Q8_0, "output": T.Q8_0}),
    # Phi-3's fused q/k/v and gate/up tensors, cut per part before each rank's slice; o_proj's 96 inputs are
    # 48 a rank, not whole groups of 32: kept dequantized; tied logits from the quantized embedding table
    "phi3": ("phi3", "Phi3ForCausalLM",
             dict(tie_word_embeddings=True, sliding_window=5, max_position_embeddings=64,
                  original_max_position_embeddings=32,
                  rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
                                   "original_max_position_embeddings": 32,
                                   "short_factor": [1.0 + 0.3 * i for i in range(6)],
                                   "long_factor": [2.0 + i for i in range(6)]}),
             {"attn_qkv": T.Q8_0, "attn_output": T.Q4_0, "ffn_up": T.Q4_1, "ffn_down": T.Q8_0,
              "token_embd": T.Q8_0}),
}


def _from_blocks(linear) -> bool:
    """Whether a linear is served from a GGUF file's blocks: the GGUF blocks method, a QuantLinear kernel."""
    from radixlang.runtime.models.gguf_quant import GGUFBlocksMethod, QuantLinear
    return isinstance(linear.method, GGUFBlocksMethod) and isinstance(linear.kernel, QuantLinear)


@pytest.mark.e2e
@pytest.mark.parametrize("case", sorted(CASES))
def test_tp2_matches_tp1_on_a_quantized_gguf(case, tmp_path, monkeypatch, caplog):
    """The same quantized weights on one rank and split over two: same greedy tokens, logprobs within 1e-4
    (the partial sums hold the same terms: see test_rank_slices_are_the_whole_tensors_rows_and_groups), the
    cached prefix reused alike."""
    from radixlang import Engine
    from radixlang.runtime.models.parallel import RowParallelLinear, VocabParallelHead
    from test_gguf_families import _write_gguf
    from tiny_model import private_cache, save_tiny_hf_model

    arch, hf_arch, overrides, quant = CASES[case]
    folder = save_tiny_hf_model(str(tmp_path / "hf"), hf_arch, seed=5, **overrides)
    private_cache(tmp_path / "cache", monkeypatch)  # inherited by the spawned rank
    path = str(tmp_path / f"tiny-{case}.gguf")
    _write_gguf(folder, path, arch, quant=quant)
    kw = dict(model_path=path, max_total_tokens=1024, chunked_prefill_size=16)
    with Engine(**kw) as single:
        layer = single.scheduler.runner.model.layers[0]
        assert _from_blocks(layer.self_attn.o_proj) and _from_blocks(layer.self_attn.qkv_proj)
        want = run_shared_prefix(single)
    with caplog.at_level(logging.WARNING, logger="radixlang.runtime.models.gguf_quant"):
        with Engine(**kw, tp_size=2) as engine:
            model = engine.scheduler.runner.model
            attn, mlp = model.layers[0].self_attn, model.layers[0].mlp
            assert _from_blocks(attn.qkv_proj) and _from_blocks(mlp.gate_up_proj)
            assert attn.qkv_proj.out_features == (model.num_heads + 2 * model.num_kv_heads) * model.head_dim
            assert mlp.gate_up_proj.out_features == 2 * mlp.inter
            assert isinstance(mlp.down_proj, RowParallelLinear) and _from_blocks(mlp.down_proj)
            assert mlp.down_proj.in_features == mlp.inter
            assert isinstance(model.lm_head, VocabParallelHead) and _from_blocks(model.lm_head)
            assert model.lm_head.out_features == 49152 // 2
            assert not any(p.is_meta for p in model.parameters())
            if case == "phi3":
                # 48 inputs a rank: kept float32
                assert type(attn.o_proj) is RowParallelLinear and not _from_blocks(attn.o_proj)
                assert "blk.0.o (96 input features over tp_size 2 is 48 a rank" in caplog.text
            else:
                assert isinstance(attn.o_proj, RowParallelLinear) and _from_blocks(attn.o_proj)
                assert attn.o_proj.in_features == 64
                assert "kept dequantized" not in caplog.text
            got = run_shared_prefix(engine)
    assert got[2]["meta_info"]["cached_tokens"] >= len(SHARED)
    for g, w in zip(got, want, strict=True):
        assert g["output_ids"] == w["output_ids"], case
        assert g["meta_info"]["cached_tokens"] == w["meta_info"]["cached_tokens"]
        assert all_logprobs(g) == pytest.approx(all_logprobs(w), rel=1e-4, abs=1e-4), case


@pytest.mark.e2e
def test_tp2_matches_tp1_on_quantized_gguf_experts(tmp_path, monkeypatch):
    """A Qwen2-MoE file's stacked experts (Q4_0 gate/up, Q8_0 down) and shared expert (Q4_1 / Q8_0) split over
    two ranks: each keeps every expert over its 32 of the 64 intermediate features (gate and up rows, down's
    input groups), served from the blocks, and the layer sums the experts' and the shared expert's terms in
    one all-reduce; same tokens and logprobs within 1e-4 as one rank, the cached prefix reused alike."""
    from radixlang import Engine
    from radixlang.runtime.models.gguf_experts import GGUFExpertsMethod
    from radixlang.runtime.models.parallel import RowParallelLinear
    from test_gguf_families import _write_gguf
    from tiny_model import private_cache, save_tiny_hf_model

    folder = save_tiny_hf_model(str(tmp_path / "hf"), "Qwen2MoeForCausalLM", seed=5, num_experts=6,
                                num_experts_per_tok=2, moe_intermediate_size=64, shared_expert_intermediate_size=64,
                                norm_topk_prob=False, decoder_sparse_step=1)
    private_cache(tmp_path / "cache", monkeypatch)
    path = str(tmp_path / "tiny-moe.gguf")
    _write_gguf(folder, path, "qwen2moe", quant={"ffn_gate_exps": T.Q4_0, "ffn_up_exps": T.Q4_0,
                                                 "ffn_down_exps": T.Q8_0, "ffn_gate_shexp": T.Q4_1,
                                                 "ffn_up_shexp": T.Q4_1, "ffn_down_shexp": T.Q8_0})
    kw = dict(model_path=path, max_total_tokens=1024, chunked_prefill_size=16)
    with Engine(**kw) as single:
        assert isinstance(single.scheduler.runner.model.layers[0].mlp.experts.method, GGUFExpertsMethod)
        want = run_shared_prefix(single)
    with Engine(**kw, tp_size=2) as engine:
        mlp = engine.scheduler.runner.model.layers[0].mlp
        experts = mlp.experts
        method = experts.method
        assert isinstance(method, GGUFExpertsMethod) and experts.inter == 32 and experts.tp is not None
        assert method.w13[0].out_features == 64 and method.w2[0].in_features == 32
        assert isinstance(mlp.shared_expert.down_proj, RowParallelLinear) and _from_blocks(mlp.shared_expert.down_proj)
        got = run_shared_prefix(engine)
    assert got[2]["meta_info"]["cached_tokens"] >= len(SHARED)
    for g, w in zip(got, want, strict=True):
        assert g["output_ids"] == w["output_ids"]
        assert all_logprobs(g) == pytest.approx(all_logprobs(w), rel=1e-4, abs=1e-4)
