"""The Engine on radixlang's compiled CPU kernels (the CPU default) against the pure-PyTorch path."""
from __future__ import annotations

import pytest
import torch

from radixlang.kernels import cpu as cpu_ops
from radixlang.kernels.attention.cpu_backend import CpuAttnBackend
from radixlang.kernels.attention.torch_native import TorchNativeAttnBackend

pytestmark = [pytest.mark.e2e,
              pytest.mark.skipif(not cpu_ops.available(), reason=f"no CPU kernels: {cpu_ops.unavailable_reason()}")]


def _logprobs(out: dict, key: str) -> torch.Tensor:
    return torch.tensor([lp for lp, _, _ in out["meta_info"][key] if lp is not None])


def test_engine_kernels_match_torch_ops(tiny_model_dir, tiny_engine):
    from radixlang import Engine
    runner = tiny_engine.scheduler.runner
    assert type(runner.attn_backend) is CpuAttnBackend and runner.model.cpu_kernels  # the default here
    shared = list(range(5, 60))
    # a batch that decodes together (4 rows: the streaming linear's widest case): different lengths, two
    # sharing a cached prefix. Greedy: the tiny random model's next-token distribution is nearly flat,
    # so a sampled token can flip on a float rounding difference (seen); the argmax does not here
    prompts = [shared + [3, 4], shared + [9], list(range(100, 107)), list(range(200, 330))]
    params = [{"max_new_tokens": n, "temperature": 0, "ignore_eos": True} for n in (12, 12, 12, 6)]
    fast = tiny_engine.generate(input_ids=prompts, sampling_params=params, return_logprob=True, logprob_start_len=0)
    with Engine(model_path=tiny_model_dir, load_format="dummy", max_total_tokens=2048,
                disable_cpu_kernels=True) as ref_engine:
        ref_runner = ref_engine.scheduler.runner
        assert type(ref_runner.attn_backend) is TorchNativeAttnBackend and not ref_runner.model.cpu_kernels
        ref = ref_engine.generate(input_ids=prompts, sampling_params=params, return_logprob=True, logprob_start_len=0)
    for a, b in zip(fast, ref):
        assert a["output_ids"] == b["output_ids"]
        for key in ("input_token_logprobs", "output_token_logprobs"):
            torch.testing.assert_close(_logprobs(a, key), _logprobs(b, key), rtol=1e-4, atol=1e-4)
    tiny_engine.flush_cache()
    tiny_engine.check_memory_leak()


def test_torch_backend_can_be_chosen_with_kernels_on(tiny_model_dir):
    from radixlang import Engine
    with Engine(model_path=tiny_model_dir, load_format="dummy", max_total_tokens=1024,
                attention_backend="torch") as eng:
        runner = eng.scheduler.runner
        assert type(runner.attn_backend) is TorchNativeAttnBackend and runner.model.cpu_kernels
        out = eng.generate(input_ids=list(range(5, 30)), sampling_params={"max_new_tokens": 5, "temperature": 0,
                                                                         "ignore_eos": True})
        assert out["meta_info"]["completion_tokens"] == 5


def test_engine_extend_kernel_matches_torch_ops(tmp_path):
    """Head size 64: prefills, chunked prefills and questions after a cached prefix run the extend kernel."""
    from radixlang import Engine
    from tests.tiny_model import make_tiny_model_dir
    model = make_tiny_model_dir(str(tmp_path / "d64"), hidden=128, heads=2, kv_heads=1)
    shared = list(range(5, 90))
    prompts = [shared + [3, 4, 7], shared + [9], list(range(100, 107)), list(range(200, 430))]
    params = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}
    outs = []
    for off in (False, True):
        with Engine(model_path=model, load_format="dummy", max_total_tokens=4096, chunked_prefill_size=64,
                    disable_cpu_kernels=off) as engine:
            backend = engine.scheduler.runner.attn_backend
            assert (type(backend) is CpuAttnBackend and backend._extend_kernel) != off
            engine.generate(input_ids=shared, sampling_params={"max_new_tokens": 0})  # the prefix is cached first
            outs.append(engine.generate(input_ids=prompts, sampling_params=params, return_logprob=True,
                                        logprob_start_len=0))
    for a, b in zip(*outs):
        assert a["output_ids"] == b["output_ids"]
        for key in ("input_token_logprobs", "output_token_logprobs"):
            torch.testing.assert_close(_logprobs(a, key), _logprobs(b, key), rtol=1e-4, atol=1e-4)
