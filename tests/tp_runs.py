"""The requests tp=N and tp=1 runs are compared on (tests/e2e/test_tensor_parallel_families.py,
tests/runtime/models/test_gguf_tensor_parallel.py): two prompts, then a third whose prefix comes from the radix
cache."""
from __future__ import annotations

SHARED = [1, 400, 2000, 7, 31000, 12, 99, 5, 48000, 3, 17, 250, 4096, 88]
GREEDY = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}


def run_shared_prefix(engine) -> list[dict]:
    kw = dict(sampling_params=GREEDY, return_logprob=True, logprob_start_len=0, top_logprobs_num=2)
    first = engine.generate(input_ids=[SHARED + [5, 6], list(range(300, 321))], **kw)
    # its prefix comes from the radix cache (no prompt logprobs asked, so the cached prefix is not recomputed)
    second = engine.generate(input_ids=SHARED + [9, 8, 7], sampling_params=GREEDY, return_logprob=True,
                             top_logprobs_num=2)
    engine.check_memory_leak()
    return first + [second]


def all_logprobs(out: dict) -> list[float]:
    """Prompt, output and top logprobs of one output, in order."""
    meta = out["meta_info"]
    vals = [lp for lp, _, _ in meta["input_token_logprobs"] + meta["output_token_logprobs"] if lp is not None]
    return vals + [lp for row in meta["output_top_logprobs"] for lp, _, _ in row]
