"""The radix cache inside the scheduler: sharing, exact cached_tokens, eviction, flush."""
from __future__ import annotations

import random

import pytest

from radixlang import Engine

pytestmark = pytest.mark.e2e
GREEDY = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}


def _few_shot(n: int) -> tuple[list[int], list[list[int]]]:
    rng = random.Random(1)
    prefix = [rng.randrange(3, 49000) for _ in range(150)]
    return prefix, [prefix + [rng.randrange(3, 49000) for _ in range(rng.randrange(3, 20))] for _ in range(n)]


def test_cache_on_equals_off_and_counts(tiny_model_dir):
    prefix, prompts = _few_shot(10)
    kw = {"model_path": tiny_model_dir, "load_format": "dummy", "max_total_tokens": 8192}
    with Engine(**kw, disable_radix_cache=True) as off:
        ref = off.generate(input_ids=prompts, sampling_params=GREEDY)
        off.check_memory_leak()
    with Engine(**kw) as on:
        first = on.generate(input_ids=prompts[0], sampling_params=GREEDY)
        rest = on.generate(input_ids=prompts[1:], sampling_params=GREEDY)
        info = on.get_server_info()
        on.check_memory_leak()
        # multi-turn: the second turn reuses the whole first turn
        turn1 = on.generate(input_ids=prompts[0] + [5, 6, 7], sampling_params=GREEDY)
        turn2_ids = prompts[0] + [5, 6, 7] + turn1["output_ids"] + [8, 9]
        turn2 = on.generate(input_ids=turn2_ids, sampling_params=GREEDY)
        on.check_memory_leak()
    assert [o["output_ids"] for o in [first] + rest] == [r["output_ids"] for r in ref]
    assert first["meta_info"]["cached_tokens"] == 0
    assert all(o["meta_info"]["cached_tokens"] >= len(prefix) for o in rest)
    assert info["cache_hit_rate"] > 0.5
    assert turn2["meta_info"]["cached_tokens"] >= len(prompts[0]) + 3 + len(turn1["output_ids"]) - 1


def test_prefill_only_request_is_free_without_cache(tiny_model_dir):
    """Warming a prefix (max_new_tokens=0, no logprobs) keeps nothing when there is no cache: no forward runs."""
    from radixlang.lang.backends.engine import EngineBackend
    from radixlang.lang.choices import TokenLengthNormalized

    prefix, prompts = _few_shot(1)
    kw = {"model_path": tiny_model_dir, "load_format": "dummy", "max_total_tokens": 8192}
    choices = [[7, 8], [9], [10, 11, 12]]
    with Engine(**kw, disable_radix_cache=True) as off, Engine(**kw) as on:
        steps = off.get_server_info()["forward_steps"]
        out = off.generate(input_ids=prompts[0], sampling_params={"max_new_tokens": 0})
        assert out["meta_info"]["prompt_tokens"] == len(prompts[0])
        assert out["meta_info"]["finish_reason"]["type"] == "length" and out["output_ids"] == []
        assert off.get_server_info()["forward_steps"] == steps
        # with logprobs asked for, the prompt is still scored
        scored = off.generate(input_ids=prompts[0], sampling_params={"max_new_tokens": 0}, return_logprob=True,
                              logprob_start_len=0)
        assert len(scored["meta_info"]["input_token_logprobs"]) == len(prompts[0])
        assert off.get_server_info()["forward_steps"] == steps + 1
        # select warms the prefix first: without a cache that costs nothing, and the choice is the same
        text = off.tokenizer.decode(prefix)
        words = [off.tokenizer.decode(c) for c in choices]
        picks = [EngineBackend(e).select(text, words, 0.0, TokenLengthNormalized()) for e in (off, on)]
        assert picks[0].decision == picks[1].decision
        assert picks[0].meta_info["normalized_prompt_logprobs"] == pytest.approx(
            picks[1].meta_info["normalized_prompt_logprobs"], abs=1e-4)
        off.check_memory_leak()


def test_exact_cached_tokens_sequence(tiny_engine):
    assert tiny_engine.flush_cache()
    ids = list(range(100, 140))
    seq = [tiny_engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 1})["meta_info"]["cached_tokens"]
           for _ in range(3)]
    assert seq == [0, len(ids) - 1, len(ids) - 1]  # a match is capped at input_len - 1
    lp = tiny_engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 1}, return_logprob=True,
                              logprob_start_len=10)
    assert lp["meta_info"]["cached_tokens"] == 9  # position 9's logits score token 10: recomputed


def test_small_pool_evicts_and_finishes(tiny_model_dir):
    rng = random.Random(4)
    prompts = [[rng.randrange(3, 49000) for _ in range(120)] for _ in range(10)]
    with Engine(model_path=tiny_model_dir, load_format="dummy", max_total_tokens=512) as eng:
        outs = [eng.generate(input_ids=p, sampling_params=GREEDY) for p in prompts]
        info = eng.get_server_info()
        eng.check_memory_leak()
    assert all(len(o["output_ids"]) == 8 for o in outs)
    assert info["memory"]["kv_cached_tokens"] <= 512


def test_flush_refused_while_busy(tiny_engine):
    it = tiny_engine.generate("busy", {"max_new_tokens": 64, "ignore_eos": True}, stream=True)
    next(it)
    assert tiny_engine.flush_cache() is False
    list(it)
    assert tiny_engine.flush_cache() is True


@pytest.mark.parametrize("policy", ["lpm", "dfs-weight", "fcfs"])
def test_policies_give_same_greedy_outputs(tiny_model_dir, policy):
    prefix, prompts = _few_shot(6)
    other = [[7] * 40 + p[-5:] for p in prompts[:3]]
    with Engine(model_path=tiny_model_dir, load_format="dummy", max_total_tokens=4096,
                schedule_policy=policy) as eng:
        eng.generate(input_ids=prompts[0], sampling_params=GREEDY)  # warm the tree
        outs = eng.generate(input_ids=prompts + other, sampling_params=GREEDY)
        alone = [eng.generate(input_ids=p, sampling_params=GREEDY) for p in prompts + other]
        eng.check_memory_leak()
    assert [o["output_ids"] for o in outs] == [a["output_ids"] for a in alone]


def test_dfs_weight_orders_heaviest_subtree_first():
    import torch

    from radixlang.runtime.scheduler.batch import Req
    from radixlang.runtime.mem_cache.memory_pool import ReqToTokenPool, TokenToKVPool
    from radixlang.runtime.sampling.sampling_params import SamplingParams
    from radixlang.runtime.mem_cache.tree_req_cache import TreeReqCache

    cache = TreeReqCache(ReqToTokenPool(4, 64, "cpu"),
                         TokenToKVPool(64, num_layers=1, num_kv_heads=1, head_dim=2, dtype=torch.float32,
                                       device="cpu"))
    cache.tree.insert([1, 1, 1, 1], torch.arange(1, 5))
    cache.tree.insert([2, 2, 2, 2], torch.arange(5, 9))
    def mk(rid: str, ids: list[int]) -> Req:
        return Req(rid=rid, origin_input_ids=ids, sampling_params=SamplingParams(), max_new_tokens=128)
    waiting = [mk("a", [1, 1, 1, 1, 5]), mk("b", [2, 2, 2, 2, 6]), mk("c", [2, 2, 2, 2, 7]), mk("d", [9, 9])]
    order = [r.rid for r in cache.dfs_weight_order(waiting)]
    assert order[0] == "d" or order[:2] == ["b", "c"]
    assert order.index("b") < order.index("a") and order.index("c") < order.index("a")


def test_shared_prefix_submitted_together_is_computed_once(tiny_engine):
    prefix, prompts = _few_shot(12)
    assert tiny_engine.flush_cache()
    outs = tiny_engine.generate(input_ids=prompts, sampling_params=GREEDY)
    cached = sorted(o["meta_info"]["cached_tokens"] for o in outs)
    assert cached[0] < len(prefix) and all(c >= len(prefix) for c in cached[1:])
