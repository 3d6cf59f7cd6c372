"""A max_new_tokens past the context left is refused (the default is capped), and a secret never leaves
ServerArgs through repr or the info dict; both without a model."""
from __future__ import annotations

from scripted_runner import VOCAB, ScriptedRunner

from radixlang.runtime.sampling.sampling_params import SamplingParams
from radixlang.runtime.io_struct import TokenizedGenerateReq
from radixlang.runtime.scheduler.scheduler import Scheduler
from radixlang.runtime.server_args import REDACTED, ServerArgs


def _run(sched: Scheduler, rid: str, prompt: list[int], params: dict) -> tuple[list[int], dict]:
    params = SamplingParams.from_dict({"temperature": 0.0, **params})
    sched.add_request(TokenizedGenerateReq(rid=rid, input_ids=prompt, sampling_params=params))
    ids: list[int] = []
    for _ in range(200):
        out = sched.step()
        for row in out.rows if out is not None else ():
            if row.rid == rid:
                ids += row.output_ids
                if row.finished_reason is not None:
                    return ids, dict(row.finished_reason)
    raise AssertionError(f"{rid} did not finish")


def test_max_new_tokens_past_the_context_left_is_a_400_and_the_default_is_capped():
    runner = ScriptedRunner(context_len=64, kv_size=256)
    sched = Scheduler(ServerArgs(device="cpu", dtype="float32", attention_backend="torch", num_threads=1),
                      runner=runner)
    prompt = [1 + i % (VOCAB - 1) for i in range(60)]  # 4 tokens of context left
    _, reason = _run(sched, "too-many", prompt, {"max_new_tokens": 5, "ignore_eos": True})
    assert reason["type"] == "abort" and reason["status_code"] == 400 and reason["param"] == "max_new_tokens"
    assert reason["message"] == ("max_new_tokens is too large: 5. This model's maximum context length is 64 tokens "
                                 "and your request has 60 input tokens (5 > 64 - 60)")
    ids, reason = _run(sched, "just-fits", prompt, {"max_new_tokens": 4, "ignore_eos": True})
    assert reason == {"type": "length", "length": 4} and len(ids) == 4
    ids, reason = _run(sched, "default", prompt, {"ignore_eos": True})  # not asked for: up to the context
    assert reason["type"] == "length" and len(ids) == 4
    sched.check_memory_leak()


def test_a_secret_is_kept_out_of_repr_and_the_public_dict():
    args = ServerArgs(api_key="sk-do-not-show")
    assert "sk-do-not-show" not in repr(args) and "sk-do-not-show" not in str(args)
    assert args.to_public_dict()["api_key"] == REDACTED and args.to_dict()["api_key"] == "sk-do-not-show"
    assert ServerArgs().to_public_dict()["api_key"] is None  # unset is not a secret
