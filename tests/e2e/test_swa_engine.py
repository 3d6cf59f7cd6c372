"""Sliding-window models with the window layers' KV in its own slot space (SWATokenToKVPool): the same
greedy tokens and prompt logprobs as transformers with prompts and generations several windows long (alone,
batched, after a cached prefix whose older tokens lost their window KV), the window KV a request holds
bounded by its window, every slot back after the cache is flushed, and more long requests than the window
slots hold finishing with the right tokens."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from radixlang.runtime.sampling.sampling_params import SamplingParams
from radixlang import Engine
from radixlang.radix_cache import SWARadixCache
from radixlang.runtime.io_struct import TokenizedGenerateReq
from radixlang.runtime.scheduler.build import build_scheduler
from radixlang.runtime.scheduler.scheduler import Scheduler
from radixlang.runtime.mem_cache.memory_pool import TokenToKVPool
from radixlang.runtime.mem_cache.swa_memory_pool import SWATokenToKVPool
from radixlang.runtime.mem_cache.swa_req_cache import SWATreeReqCache
from radixlang.runtime.server_args import ServerArgs
from tiny_model import FAMILIES, save_tiny_hf_model

pytestmark = pytest.mark.e2e

W = 8
PROMPT = [(37 * i + 11) % 40000 + 500 for i in range(5 * W)]  # five windows
NEW = 5 * W
GREEDY = {"max_new_tokens": NEW, "temperature": 0, "ignore_eos": True}
# an all-window model and one whose layers alternate sliding / full (soft-capped)
SWA_FAMILIES = ("mistral_sliding", "gemma2")


@pytest.fixture(scope="module", params=SWA_FAMILIES)
def family(request, tmp_path_factory):
    arch, overrides = FAMILIES[request.param]
    folder = save_tiny_hf_model(str(tmp_path_factory.mktemp(request.param)), arch, seed=5,
                                **{**overrides, "sliding_window": W})
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return request.param, folder, hf


def _hf_greedy(hf, ids: list[int], new: int = NEW) -> list[int]:
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                          max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)
    return out[0, len(ids):].tolist()


def _hf_logprobs(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logp = hf(torch.tensor([ids])).logits[0].float().log_softmax(-1)
    return logp[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]


def _input_logprobs(out: dict) -> torch.Tensor:
    return torch.tensor([lp for lp, _, _ in out["meta_info"]["input_token_logprobs"] if lp is not None])


def _engine(folder: str, *, swa_full_tokens_ratio: float = 0.1, **kw) -> Engine:
    # small prefill chunks and few window slots: trimming, tombstones and swa eviction all run
    return Engine(model_path=folder, max_total_tokens=1024, chunked_prefill_size=16,
                  swa_full_tokens_ratio=swa_full_tokens_ratio, **kw)


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_alone_after_a_tombstoned_prefix_and_batched_match_transformers(family, backend):
    name, folder, hf = family
    ref = _hf_greedy(hf, PROMPT)
    with _engine(folder, attention_backend=backend) as engine:
        assert isinstance(engine.scheduler.kv_pool, SWATokenToKVPool), name
        alone = engine.generate(input_ids=PROMPT, sampling_params=GREEDY, return_logprob=True, logprob_start_len=0)
        ours = _input_logprobs(alone)
        assert (ours - _hf_logprobs(hf, PROMPT)).abs().max().item() < 1e-4, name
        assert alone["output_ids"] == ref, name
        # the prompt's tokens keep window KV in the tree; the generated ones before the last window lost
        # theirs: a prompt running into them reuses only the prompt, recomputes the rest (reviving it)
        longer = PROMPT + ref[:3 * W] + [5, 6, 7, 8]
        # logprobs from the first token after the prompt: the logits of the prompt's last token are needed
        again = engine.generate(input_ids=longer, sampling_params=GREEDY, return_logprob=True,
                                logprob_start_len=len(PROMPT) + 1)
        assert again["meta_info"]["cached_tokens"] == len(PROMPT), name
        tail = _input_logprobs(again)
        assert (tail - _hf_logprobs(hf, longer)[-len(tail):]).abs().max().item() < 1e-4, name
        ref_longer = _hf_greedy(hf, longer)
        assert again["output_ids"] == ref_longer, name
        revived = engine.generate(input_ids=longer, sampling_params=GREEDY)
        assert revived["meta_info"]["cached_tokens"] == len(longer) - 1, name
        assert revived["output_ids"] == ref_longer, name
        prompts = [PROMPT[::-1], list(range(900, 900 + 6 * W)), PROMPT[:3 * W + 1]]
        batch = engine.generate(input_ids=prompts, sampling_params=GREEDY)
        assert [o["output_ids"] for o in batch] == [_hf_greedy(hf, p) for p in prompts], name
        assert engine.flush_cache()
        mem = engine.get_server_info()["memory"]
        assert mem["kv_free_tokens"] == mem["kv_total_tokens"] and mem["swa_free_tokens"] == mem["swa_total_tokens"]


def _run_one(sched: Scheduler, prompt: list[int],
             new: int) -> tuple[list[int], list[tuple[int, int, int, int, int | None]]]:
    """Step the request to its end: its output ids and, after each step, (kv_len, its own tokens, own
    tokens with window KV, its tree prefix, the tree's window-locked tokens (None without a tree))."""
    sched.add_request(TokenizedGenerateReq(rid="r", input_ids=prompt,
                                           sampling_params=SamplingParams(temperature=0.0, max_new_tokens=new,
                                                                          ignore_eos=True)))
    pool = sched.kv_pool
    seen, output = [], []
    while not sched.is_idle():
        sched.step()
        for req in sched.running:
            row = sched.req_to_token_pool.req_to_token[req.req_pool_idx]
            own = int(req.prefix_indices.numel())
            tree = getattr(sched.cache, "swa_tree", None)
            seen.append((req.kv_len, req.kv_len - own, int(pool.has_swa(row[own:req.kv_len]).sum()), own,
                         None if tree is None else tree.swa_protected_size()))
            output = req.output_ids
    return output, seen


@pytest.mark.parametrize("radix", [True, False], ids=["radix", "no_radix"])
def test_window_kv_held_is_bounded_by_the_window_and_every_slot_comes_back(family, radix):
    name, folder, hf = family
    sched = build_scheduler(ServerArgs(model_path=folder, max_total_tokens=1024, chunked_prefill_size=16,
                                       disable_radix_cache=not radix))
    pool = sched.kv_pool
    assert isinstance(pool, SWATokenToKVPool)
    full0, swa0 = pool.available_size(), pool.swa_available_size()
    output, seen = _run_one(sched, PROMPT[:12], 20 * W)
    assert len(seen) > 15 * W
    assert output == _hf_greedy(hf, PROMPT[:12], 20 * W), name
    for kv_len, own, held, prefix, locked in seen:
        # the next query (position kv_len) sees kv_len - W + 1 .. kv_len: exactly W - 1 of the pool's tokens
        assert held == min(own, W - 1), (kv_len, own, held)
        if radix:  # the prefix's last W - 1 tokens stay window-locked while the next query can see them
            assert locked == (min(prefix, W - 1) if kv_len - W + 1 < prefix else 0), (kv_len, prefix, locked)
    if radix:  # the prompt is the tree's; the request's lock let go of its window once decoding passed it
        assert isinstance(sched.cache, SWATreeReqCache)
        assert any(locked for *_, locked in seen) and seen[-1][-1] == 0
        assert sched.cache.swa_tree.swa_protected_size() == 0  # unlocked at the end
    assert sched.flush_cache().success
    assert (pool.available_size(), pool.swa_available_size()) == (full0, swa0)


def test_more_long_requests_than_the_window_slots_hold_finish_right(family, monkeypatch):
    name, folder, hf = family
    tombstoned = []
    evict_swa = SWARadixCache.evict_swa
    monkeypatch.setattr(SWARadixCache, "evict_swa",
                        lambda tree, *a: tombstoned.append(evict_swa(tree, *a)) or tombstoned[-1])
    prompts = [[(53 * i + 7 * j) % 30000 + 1000 for j in range(3 * W + 3 * i)] for i in range(6)]
    # the fewest window slots a pool gets: one prefill chunk and two windows (16 + 2 x 8)
    with _engine(folder, swa_full_tokens_ratio=0.01) as engine:
        mem = engine.get_server_info()["memory"]
        assert mem["swa_total_tokens"] == 16 + 2 * W
        # both spaces reported as allocated: 3 layers x 2 kv heads x 16 dims x k, v x float32 = 256 bytes a layer
        window_layers = {"mistral_sliding": 3, "gemma2": 2}[name]
        swa_bytes, full_bytes = mem["swa_bytes_per_token"], mem["full_bytes_per_token"]
        assert (swa_bytes, full_bytes) == (256 * window_layers, 256 * (3 - window_layers))
        assert mem["kv_total_bytes"] == 1025 * full_bytes + (16 + 2 * W + 1) * swa_bytes  # dummy slots included
        outs = engine.generate(input_ids=prompts, sampling_params=GREEDY)
        assert [o["output_ids"] for o in outs] == [_hf_greedy(hf, p) for p in prompts], name
        # cached tokens lost their window KV to make room, and the newest request went back to the queue
        assert sum(tombstoned) > sum(map(len, prompts)) // 2, tombstoned
        assert engine.get_server_info()["num_retractions"] >= 1
        assert engine.flush_cache()
        engine.check_memory_leak()


def test_models_without_a_window_shorter_than_the_context_keep_one_slot_space(tmp_path):
    arch, overrides = FAMILIES["mistral_sliding"]
    folder = save_tiny_hf_model(str(tmp_path / "m"), arch, **{**overrides, "sliding_window": W})
    plain = save_tiny_hf_model(str(tmp_path / "l"), "LlamaForCausalLM")
    for kw in ({"model_path": folder, "context_length": W}, {"model_path": folder, "disable_hybrid_swa_memory": True},
               {"model_path": plain}):
        pool = build_scheduler(ServerArgs(max_total_tokens=64, **kw)).kv_pool
        assert type(pool) is TokenToKVPool, kw
    assert isinstance(build_scheduler(ServerArgs(model_path=folder, max_total_tokens=64)).kv_pool, SWATokenToKVPool)
