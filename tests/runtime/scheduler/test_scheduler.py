"""Scheduler unit tests over a scripted runner (no model): admission, chunked prefill,
retraction, aborts, the leak check, grammar waits and the finish reasons it reports."""
from __future__ import annotations

import re
from concurrent.futures import Future

import pytest
import torch
from scripted_runner import EOS, VOCAB, CharTokenizer, ScriptedRunner, greedy_continuation

from radixlang.constrained import GrammarCompiler, TokenizerInfo
from radixlang.kernels.attention.base import ForwardMode
from radixlang.runtime.scheduler.grammar_wait import GrammarWaits
from radixlang.runtime.errors import RequestError
from radixlang.runtime.io_struct import BatchTokenIDOut, FinishReason, TokenizedGenerateReq, decode, encode
from radixlang.runtime.sampling.sampling_params import SamplingParams
from radixlang.runtime.scheduler.scheduler import Scheduler
from radixlang.runtime.server_args import ServerArgs


def make(*, runner: ScriptedRunner | None = None, **args) -> tuple[Scheduler, ScriptedRunner]:
    runner = runner or ScriptedRunner()
    server_args = ServerArgs(device="cpu", dtype="float32", attention_backend="torch", num_threads=1, **args)
    return Scheduler(server_args, runner=runner), runner


def submit(sched: Scheduler, rid: str, prompt: list[int], **params) -> None:
    sched.add_request(TokenizedGenerateReq(rid=rid, input_ids=prompt,
                                           sampling_params=SamplingParams.from_dict({"temperature": 0.0, **params})))


class Collected:
    """Every step's outputs per rid: the tokens and the finish reason (wire dicts)."""

    def __init__(self) -> None:
        self.ids: dict[str, list[int]] = {}
        self.reasons: dict[str, dict] = {}

    def add(self, out: BatchTokenIDOut | None) -> None:
        if out is None:
            return
        out = decode(encode(out))  # what crosses the process boundary
        for row in out.rows:
            if row.rid in self.reasons:
                raise AssertionError(f"{row.rid} got output after it finished")
            self.ids.setdefault(row.rid, []).extend(row.output_ids)
            if row.finished_reason is not None:
                self.reasons[row.rid] = row.finished_reason


def run(sched: Scheduler, got: Collected | None = None, max_steps: int = 500) -> Collected:
    got = got or Collected()
    for _ in range(max_steps):
        got.add(sched.step())
        if sched.is_idle():
            got.add(sched.step())  # nothing left to run: flushes nothing, but must not fail
            return got
    raise AssertionError(f"not idle after {max_steps} steps")


def prompt(seed: int, n: int = 4) -> list[int]:
    return [1 + (seed * 7 + 3 * j) % (VOCAB - 1) for j in range(n)]


def test_one_request_decodes_the_scripted_tokens_and_leaves_the_pools_clean():
    sched, runner = make()
    submit(sched, "a", prompt(0), max_new_tokens=6)
    got = run(sched)
    assert got.ids["a"] == greedy_continuation(prompt(0), 6)
    assert got.reasons["a"] == {"type": "length", "length": 6}
    assert [c.mode for c in runner.calls] == [ForwardMode.EXTEND] + [ForwardMode.DECODE] * 5
    sched.check_memory_leak()


@pytest.mark.parametrize("disable_radix_cache", [False, True])
def test_prefill_admission_is_capped_by_max_prefill_tokens(disable_radix_cache):
    sched, runner = make(max_prefill_tokens=10, chunked_prefill_size=-1, disable_radix_cache=disable_radix_cache)
    prompts = {f"r{i}": prompt(i) for i in range(4)}
    for rid, p in prompts.items():
        submit(sched, rid, p, max_new_tokens=3)
    got = run(sched)
    # 4 + 4 fill 8 of the 10 tokens; the third request gets the last 2 and finishes its prompt next step
    assert runner.calls[0].extend_lens == [4, 4, 2]
    assert runner.calls[1].mode is ForwardMode.EXTEND and runner.calls[1].extend_lens == [2, 4]
    assert runner.calls[1].positions.tolist() == [2, 3, 0, 1, 2, 3]
    assert all(sum(c.extend_lens) <= 10 for c in runner.calls)
    for rid, p in prompts.items():
        assert got.ids[rid] == greedy_continuation(p, 3), rid
    sched.check_memory_leak()


def test_admission_is_capped_by_max_running():
    sched, runner = make(runner=ScriptedRunner(max_running=2))
    prompts = {f"r{i}": prompt(i) for i in range(5)}
    for rid, p in prompts.items():
        submit(sched, rid, p, max_new_tokens=3)
    got = Collected()
    for _ in range(100):
        got.add(sched.step())
        assert len(sched.running) <= 2
        if sched.is_idle():
            break
    assert max(len(c.seq_lens) for c in runner.calls) == 2
    assert runner.calls[0].extend_lens == [4, 4]  # three wait although the token budget has room
    for rid, p in prompts.items():
        assert got.ids[rid] == greedy_continuation(p, 3), rid
    sched.check_memory_leak()


def test_chunked_prefill_runs_a_long_prompt_in_order_before_the_next_request():
    sched, runner = make(chunked_prefill_size=4)
    long, short = prompt(1, 10), prompt(2, 3)
    submit(sched, "long", long, max_new_tokens=4)
    submit(sched, "short", short, max_new_tokens=4)
    assert sched.step() is None  # a non-final chunk samples nothing
    assert sched.step() is None
    got = run(sched)
    calls = [(c.mode, c.extend_lens, c.positions.tolist()) for c in runner.calls[:4]]
    assert calls == [
        (ForwardMode.EXTEND, [4], [0, 1, 2, 3]),
        (ForwardMode.EXTEND, [4], [4, 5, 6, 7]),
        # the long prompt's last chunk, then the short prompt fills the rest of the 4-token chunk
        (ForwardMode.EXTEND, [2, 2], [8, 9, 0, 1]),
        (ForwardMode.EXTEND, [1], [2]),
    ]
    assert got.ids["long"] == greedy_continuation(long, 4)
    assert got.ids["short"] == greedy_continuation(short, 4)
    sched.check_memory_leak()


@pytest.mark.parametrize("disable_radix_cache", [False, True])
def test_out_of_kv_retracts_the_newest_request_which_finishes_later_with_the_same_tokens(disable_radix_cache):
    # two requests of 4 + 12 tokens need 32 slots; the pool has 20
    sched, _ = make(runner=ScriptedRunner(kv_size=20), disable_radix_cache=disable_radix_cache)
    submit(sched, "old", prompt(3), max_new_tokens=12)
    submit(sched, "new", prompt(4), max_new_tokens=12)
    got = Collected()
    for _ in range(100):
        got.add(sched.step())
        if sched.stats["num_retractions"]:
            break
    assert [r.rid for r in sched.running] == ["old"]
    assert [r.rid for r in sched.waiting] == ["new"] and sched.waiting[0].output_ids
    run(sched, got)
    assert got.ids["old"] == greedy_continuation(prompt(3), 12)
    assert got.ids["new"] == greedy_continuation(prompt(4), 12)
    assert got.reasons["new"] == {"type": "length", "length": 12}
    sched.check_memory_leak()


def test_abort_a_waiting_request():
    sched, runner = make(runner=ScriptedRunner(max_running=1))
    submit(sched, "a", prompt(5), max_new_tokens=4)
    submit(sched, "b", prompt(6), max_new_tokens=4)
    got = Collected()
    got.add(sched.step())
    assert [r.rid for r in sched.waiting] == ["b"]
    sched.abort_request("b")
    run(sched, got)
    assert got.reasons["b"] == {"type": "abort", "message": "aborted by request"}
    assert got.ids["b"] == []
    assert got.ids["a"] == greedy_continuation(prompt(5), 4)
    assert all(len(c.seq_lens) == 1 for c in runner.calls)  # b never ran
    sched.check_memory_leak()


@pytest.mark.parametrize("disable_radix_cache", [False, True])
def test_abort_a_running_request_frees_its_slots(disable_radix_cache):
    sched, _ = make(disable_radix_cache=disable_radix_cache)
    submit(sched, "a", prompt(7), max_new_tokens=20)
    submit(sched, "b", prompt(8), max_new_tokens=5)
    got = Collected()
    for _ in range(3):
        got.add(sched.step())
    sched.abort_request("a")
    run(sched, got)
    assert got.reasons["a"] == {"type": "abort", "message": "aborted by request"}
    assert got.ids["a"] == greedy_continuation(prompt(7), 20)[:3]
    assert got.ids["b"] == greedy_continuation(prompt(8), 5)
    sched.check_memory_leak()


def test_abort_a_request_mid_chunked_prefill():
    sched, runner = make(chunked_prefill_size=4)
    submit(sched, "a", prompt(9, 12), max_new_tokens=4)
    got = Collected()
    got.add(sched.step())
    assert sched.chunked_req is not None and sched.chunked_req.rid == "a"
    sched.abort_request("a")
    run(sched, got)
    assert got.reasons["a"]["type"] == "abort" and got.ids["a"] == []
    assert len(runner.calls) == 1
    sched.check_memory_leak()


def test_leak_check_passes_when_idle_and_clean_and_raises_on_a_leaked_slot():
    sched, runner = make()
    sched.check_memory_leak()
    submit(sched, "a", prompt(10), max_new_tokens=3)
    run(sched)
    sched.check_memory_leak()  # the prompt stays in the prefix cache: cached, not leaked
    assert sched.get_internal_state()["memory"]["kv_cached_tokens"] > 0
    leaked = runner.kv_pool.alloc(1)
    with pytest.raises(RuntimeError, match="memory leak"):
        sched.check_memory_leak()
    runner.kv_pool.free(leaked)
    slot = runner.req_to_token_pool.alloc(1)
    with pytest.raises(RuntimeError, match="req slots free"):
        sched.check_memory_leak()
    runner.req_to_token_pool.free(slot[0])
    assert sched.flush_cache().success
    assert runner.kv_pool.available_size() == runner.kv_pool.size


def test_leak_check_skips_while_requests_are_in_flight():
    sched, _ = make()
    submit(sched, "a", prompt(11), max_new_tokens=5)
    sched.step()
    sched.check_memory_leak()  # running: the pools are legitimately in use
    assert not sched.flush_cache().success


class _ControlledCompiler:
    """compile_async hands out futures the test completes."""

    def __init__(self) -> None:
        self.futures: dict[str | None, Future] = {}

    def compile_async(self, kind: str, spec: str | None) -> Future:
        return self.futures.setdefault(spec, Future())


@pytest.fixture(scope="module")
def char_compiler():
    info = TokenizerInfo.from_tokenizer(CharTokenizer(), vocab_size=VOCAB, eos_token_ids=[EOS])
    compiler = GrammarCompiler(info)
    yield compiler
    compiler.shutdown()


def _with_controlled_grammars(sched: Scheduler) -> _ControlledCompiler:
    ctl = _ControlledCompiler()
    sched.grammars = GrammarWaits(tokenizer=sched.tokenizer, vocab_size=VOCAB, eos_ids=sched.eos_ids,
                                  timeout_s=1.0, whitespace_pattern=None, compiler=ctl)
    return ctl


def test_a_request_waits_for_its_grammar_and_a_failing_grammar_fails_only_its_request(char_compiler):
    sched, runner = make()
    ctl = _with_controlled_grammars(sched)
    submit(sched, "plain", prompt(12), max_new_tokens=3)
    submit(sched, "good", prompt(13), max_new_tokens=8, regex="[a-c]{3}d")
    submit(sched, "bad", prompt(14), max_new_tokens=8, regex="b+")
    got = Collected()
    for _ in range(5):
        got.add(sched.step())
    assert got.ids["plain"] == greedy_continuation(prompt(12), 3)
    assert {r.rid for r in sched.waiting} == {"good", "bad"}  # not admitted while compiling
    assert all(len(c.seq_lens) == 1 for c in runner.calls)
    ctl.futures["b+"].set_exception(ValueError("the grammar blew up"))
    got.add(sched.step())
    # a refused grammar names the sampling param that carried it (issue #42)
    assert got.reasons["bad"] == {"type": "abort", "message": "the grammar blew up", "status_code": 400,
                                  "param": "regex"}
    assert [r.rid for r in sched.waiting] == ["good"]
    ctl.futures["[a-c]{3}d"].set_result(char_compiler.compile("regex", "[a-c]{3}d"))
    run(sched, got)
    text = CharTokenizer().decode(got.ids["good"])
    assert re.fullmatch("[a-c]{3}d", text), text
    assert got.reasons["good"]["type"] == "stop"
    sched.check_memory_leak()


def test_eos_is_not_sampled_before_min_new_tokens():
    sched, _ = make(runner=ScriptedRunner(script=lambda call, seq: EOS))
    submit(sched, "a", prompt(15), max_new_tokens=8, min_new_tokens=3)
    submit(sched, "b", prompt(16), max_new_tokens=8)
    got = run(sched)
    assert len(got.ids["a"]) == 4 and EOS not in got.ids["a"][:3] and got.ids["a"][3] == EOS
    assert got.reasons["a"] == {"type": "stop", "matched": EOS}
    assert got.ids["b"] == [EOS]


def test_stop_token_ids_and_stop_strings_end_a_request():
    seq = greedy_continuation(prompt(17), 10)
    sched, _ = make()
    submit(sched, "tok", prompt(17), max_new_tokens=10, stop_token_ids=[seq[4]])
    text = CharTokenizer().decode(seq)
    submit(sched, "str", prompt(17), max_new_tokens=10, stop=[text[5:7]])
    got = run(sched)
    first = seq.index(seq[4])
    assert got.ids["tok"] == seq[:first + 1]
    assert got.reasons["tok"] == {"type": "stop", "matched": seq[4]}
    assert got.reasons["str"] == {"type": "stop", "matched": text[5:7]}


def test_refused_requests_report_a_400_naming_the_field():
    sched, runner = make(grammar_backend="outlines")  # outlines takes no ebnf (xgrammar / llguidance do)
    submit(sched, "empty", [], max_new_tokens=3)
    submit(sched, "oov", [VOCAB + 5], max_new_tokens=3)
    submit(sched, "bad_bias", prompt(18), logit_bias={str(VOCAB + 1): 1.0})  # needs the vocabulary: here
    submit(sched, "ebnf", prompt(18), ebnf="root ::= 'a'")
    got = Collected()
    got.add(sched.step())
    for rid, param in [("empty", "input_ids"), ("oov", "input_ids"), ("bad_bias", "logit_bias"), ("ebnf", "ebnf")]:
        reason = got.reasons[rid]
        assert set(reason) == {"type", "message", "status_code", "param"}, reason
        assert reason["type"] == "abort" and reason["status_code"] == 400 and reason["param"] == param
    assert sched.is_idle() and not runner.calls
    # a bad value is refused where the params are built, once, in the request front: it never reaches here
    with pytest.raises(RequestError) as refused:
        submit(sched, "bad_param", prompt(18), top_p=1.5)
    assert refused.value.param == "top_p" and sched.is_idle()


def test_prefill_only_request_without_a_cache_finishes_without_a_forward():
    sched, runner = make(disable_radix_cache=True)
    submit(sched, "warm", prompt(19), max_new_tokens=0)
    got = run(sched)
    assert got.reasons["warm"] == {"type": "length", "length": 0} and got.ids["warm"] == []
    assert not runner.calls


def test_a_lone_request_past_the_pool_is_capped_not_retracted_forever():
    sched, _ = make(runner=ScriptedRunner(kv_size=12))
    submit(sched, "a", prompt(20), max_new_tokens=30)
    got = run(sched)
    assert got.reasons["a"] == {"type": "length", "length": 8}  # 12 slots - 4 prompt tokens
    assert got.ids["a"] == greedy_continuation(prompt(20), 8)
    sched.check_memory_leak()


def test_scripted_runner_sees_slot_bookkeeping_errors():
    """The runner's rule reads the KV row, so a corrupted row changes the tokens (the tests above can fail)."""
    sched, runner = make()
    submit(sched, "a", prompt(21), max_new_tokens=4)
    got = Collected()
    got.add(sched.step())
    req = sched.running[0]
    row = runner.req_to_token_pool.req_to_token[req.req_pool_idx]
    row[0], row[1] = row[1].clone(), row[0].clone()  # swap two tokens' slots
    run(sched, got)
    assert got.ids["a"][0] == greedy_continuation(prompt(21), 1)[0]
    assert got.ids["a"] != greedy_continuation(prompt(21), 4)
    assert torch.is_tensor(row)


@pytest.mark.parametrize("reason,wire", [
    (FinishReason.stop(7), {"type": "stop", "matched": 7}),
    (FinishReason.stop("\n\n"), {"type": "stop", "matched": "\n\n"}),
    (FinishReason.stop(None), {"type": "stop", "matched": None}),
    (FinishReason.max_tokens(16), {"type": "length", "length": 16}),
    (FinishReason.abort("aborted by request"), {"type": "abort", "message": "aborted by request"}),
    (FinishReason.abort("top_p must be in (0, 1], got 2", status_code=400, param="top_p"),
     {"type": "abort", "message": "top_p must be in (0, 1], got 2", "status_code": 400, "param": "top_p"}),
])
def test_finish_reason_serializes_to_sglang_dicts_and_back(reason, wire):
    assert reason.to_dict() == wire
    assert list(reason.to_dict()) == list(wire)  # key order too: the JSON the API returns is unchanged
    assert FinishReason.from_dict(wire) == reason


def test_finish_reason_refuses_an_unknown_kind():
    with pytest.raises(ValueError, match="stop, length or abort"):
        FinishReason.from_dict({"type": "done"})


def _soft(call: int, seq: list[int]) -> torch.Tensor:
    """A spread-out distribution that depends on the sequence, so a seeded draw has many outcomes."""
    g = torch.Generator().manual_seed(sum((j + 1) * t for j, t in enumerate(seq)))
    row = torch.rand(VOCAB, generator=g)
    row[EOS] = -100.0
    return row


def test_a_seeded_request_draws_the_same_tokens_alone_or_batched():
    params = {"temperature": 1.0, "top_p": 0.9, "sampling_seed": 77, "max_new_tokens": 10}

    def tokens(others: int) -> list[int]:
        sched, _ = make(runner=ScriptedRunner(script=_soft))
        for i in range(others):
            submit(sched, f"o{i}", prompt(30 + i, 3 + i), temperature=1.0, max_new_tokens=4 + 3 * i)
        submit(sched, "seeded", prompt(29), **params)
        return run(sched).ids["seeded"]

    alone = tokens(0)
    assert len(set(alone)) > 3
    assert tokens(3) == alone
    assert tokens(1) == alone


def test_each_data_parallel_replica_draws_its_own_unseeded_samples(monkeypatch):
    """The Engine's replica threads and the server's replica processes both build through build_scheduler:
    replica i's runner draws unseeded samples from random_seed + i (the weights stay random_seed's)."""
    from radixlang.runtime.scheduler import build

    monkeypatch.setattr(build, "ModelRunner", lambda args: ScriptedRunner(seed=args.random_seed))
    threads = torch.get_num_threads()
    try:
        with torch.random.fork_rng():
            seeds = [build.build_scheduler(ServerArgs(device="cpu", dtype="float32", attention_backend="torch",
                                                      num_threads=threads, random_seed=5), replica=i)
                     .runner.generator.initial_seed() for i in range(3)]
    finally:
        torch.set_num_threads(threads)
    assert seeds == [5, 6, 7]
