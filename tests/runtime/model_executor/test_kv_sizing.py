"""KV pool sizing as a pure function of the memory figures (runtime/model_executor/kv_sizing.py)."""
from __future__ import annotations

import logging

import pytest

from radixlang.runtime.model_executor.kv_sizing import (CUDA_MEM_FRACTION, activation_reserve, cpu_default_fraction,
                                                         size_kv_pool)

GiB = 1 << 30


def test_cuda_default_is_a_share_of_total_memory_less_the_weights():
    # an H100 with an 8B model in bf16 (16 GiB of weights), 128 KiB of KV per token: SGLang's static share
    # of the total, less the weights, not a share of what is free
    per_token = 32 * 2 * 8 * 128 * 2
    size = size_kv_pool(total_bytes=80 * GiB, available_bytes=63 * GiB, model_bytes=16 * GiB,
                        per_token_bytes=per_token, fraction=CUDA_MEM_FRACTION)
    assert size.warning is None
    assert size.tokens == int((int(0.88 * 80 * GiB) - 16 * GiB) // per_token)
    assert size.tokens * per_token > 54 * GiB  # the ~45 GB that 15% of free memory left idle are in the pool
    assert "0.880" in size.how and "80.00 GiB total" in size.how


def test_the_same_machine_gets_the_same_pool_whatever_is_free_at_start():
    # #42 item 9: the figure depends on the machine and the model, not on the moment
    fraction = cpu_default_fraction(24 * GiB, GiB // 2)
    sizes = {size_kv_pool(total_bytes=24 * GiB, available_bytes=free * GiB, model_bytes=GiB // 2,
                          per_token_bytes=46080, fraction=fraction, max_tokens=1 << 20).tokens
             for free in (20, 14, 8)}
    assert len(sizes) == 1
    (tokens,) = sizes
    # a tenth of what the weights leave
    assert tokens == int(0.1 * (24 * GiB - GiB // 2) // 46080)


def test_a_pool_cut_to_what_is_available_warns_with_the_numbers():
    size = size_kv_pool(total_bytes=24 * GiB, available_bytes=3 * GiB, model_bytes=GiB, per_token_bytes=1 << 20,
                        fraction=0.5)
    reserve = activation_reserve(24 * GiB)
    assert size.tokens == (3 * GiB - reserve) // (1 << 20)
    assert size.warning is not None
    assert "11264 tokens" in size.warning  # what the fraction asked for: 12 GiB - 1 GiB of 1 MiB tokens
    assert f"{size.tokens} tokens" in size.warning and "3.00 GiB free" in size.warning
    assert "1.20 GiB kept for activations" in size.warning


def test_asked_tokens_are_kept_and_warn_only_past_what_is_available():
    fine = size_kv_pool(total_bytes=24 * GiB, available_bytes=20 * GiB, model_bytes=GiB, per_token_bytes=1024,
                        fraction=0.5, asked_tokens=140)
    assert fine == (140, "max_total_tokens", None)
    big = size_kv_pool(total_bytes=24 * GiB, available_bytes=4 * GiB, model_bytes=GiB, per_token_bytes=1 << 20,
                       fraction=0.5, asked_tokens=8000)
    assert big.tokens == 8000
    assert big.warning is not None
    assert "max_total_tokens 8000 needs 7.81 GiB" in big.warning and "2.80 GiB available" in big.warning


def test_a_model_larger_than_its_share_gets_the_minimum_with_a_warning():
    size = size_kv_pool(total_bytes=16 * GiB, available_bytes=8 * GiB, model_bytes=14 * GiB, per_token_bytes=4096,
                        fraction=0.5)
    assert size.tokens == 256
    assert size.warning is not None and "0 tokens" in size.warning and "minimum of 256" in size.warning


def test_the_cpu_cap_is_stated_but_is_no_warning():
    size = size_kv_pool(total_bytes=24 * GiB, available_bytes=20 * GiB, model_bytes=GiB, per_token_bytes=512,
                        fraction=0.2, max_tokens=1 << 20)
    assert size.tokens == 1 << 20 and size.warning is None and "capped at 1048576" in size.how


def test_cpu_default_fraction_gives_the_pool_a_tenth_of_what_the_weights_leave():
    f = cpu_default_fraction(100 * GiB, 30 * GiB)
    assert f * 100 * GiB - 30 * GiB == pytest.approx(7 * GiB)


def test_bad_fraction_is_refused_and_none_means_auto():
    from radixlang.runtime.server_args import ServerArgs

    with pytest.raises(ValueError, match="mem_fraction_static"):
        ServerArgs(mem_fraction_static=1.5)
    assert ServerArgs().mem_fraction_static is None
    assert ServerArgs(device="cpu").resolve().mem_fraction_static is None  # the CPU's depends on the model


def test_the_start_log_shows_the_pool_and_how_it_was_sized(tiny_model_dir, caplog):
    from radixlang.runtime.model_executor.model_runner import ModelRunner
    from radixlang.runtime.server_args import ServerArgs

    args = ServerArgs(model_path=tiny_model_dir, load_format="dummy", device="cpu", attention_backend="torch",
                      disable_cpu_kernels=True, disable_weight_packing=True).resolve()
    with caplog.at_level(logging.INFO, logger="radixlang.runtime.model_executor.model_runner"):
        runner = ModelRunner(args)
    line = next(r.getMessage() for r in caplog.records if "kv pool" in r.getMessage())
    assert f"kv pool {runner.max_total_tokens} tokens" in line
    assert "mem_fraction_static" in line and "GiB total" in line
