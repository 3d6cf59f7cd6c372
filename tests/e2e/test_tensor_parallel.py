"""tp=2 in two processes (gloo) against tp=1: same greedy tokens, logprobs within fp32 tolerance."""
from __future__ import annotations

import multiprocessing as mp
import random
import os
import subprocess
import sys

import pytest

from radixlang import Engine
from radixlang.runtime.server_args import ServerArgs
from radixlang.runtime.model_executor.distributed import free_port
from tests.waiting import GENEROUS, wait_until

pytestmark = pytest.mark.e2e

GREEDY = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}


def _prompts() -> list[list[int]]:
    rng = random.Random(0)
    shared = [rng.randrange(3, 49000) for _ in range(40)]
    return [
        [rng.randrange(3, 49000) for _ in range(90)],  # longer than the chunk: prefilled in 3 chunks
        shared + [11, 12, 13],
        shared + [21, 22],  # a radix-cache hit on `shared` when it runs after the previous one
        [7],
    ]


def _run(engine: Engine) -> list[dict]:
    first = engine.generate(input_ids=_prompts()[:2], sampling_params=GREEDY, return_logprob=True,
                            logprob_start_len=0, top_logprobs_num=3)
    rest = engine.generate(input_ids=_prompts()[2:], sampling_params=GREEDY, return_logprob=True,
                           logprob_start_len=0, top_logprobs_num=3)
    engine.check_memory_leak()
    return first + rest


def _logprobs(out: dict) -> list[float]:
    meta = out["meta_info"]
    vals = [lp for lp, _, _ in meta["input_token_logprobs"] + meta["output_token_logprobs"] if lp is not None]
    vals += [lp for row in meta["output_top_logprobs"] for lp, _, _ in row]
    return vals


def _assert_same(got: list[dict], want: list[dict]) -> None:
    for g, w in zip(got, want, strict=True):
        assert g["output_ids"] == w["output_ids"]
        assert g["meta_info"]["cached_tokens"] == w["meta_info"]["cached_tokens"]
        assert _logprobs(g) == pytest.approx(_logprobs(w), rel=1e-4, abs=1e-4)


def _tp_children() -> list:
    return [p for p in mp.active_children() if p.name.startswith("radixlang-tp")]


def _tiny_kw(tiny_model_dir: str) -> dict:
    return dict(model_path=tiny_model_dir, load_format="dummy", max_total_tokens=1024, chunked_prefill_size=32)


@pytest.fixture(scope="module")
def tp1_outputs(tiny_model_dir) -> list[dict]:
    with Engine(**_tiny_kw(tiny_model_dir)) as single:
        return _run(single)


def test_tp2_matches_tp1_on_the_tiny_model(tiny_model_dir, tp1_outputs):
    with Engine(**_tiny_kw(tiny_model_dir), tp_size=2) as engine:
        followers = engine.scheduler.runner.tp_leader.procs
        assert len(followers) == 1 and followers[0].is_alive()
        assert engine.scheduler.runner.model.num_heads == 2  # this rank's half of the 4 heads
        got = _run(engine)
    _assert_same(got, tp1_outputs)
    assert followers[0].exitcode == 0  # stopped by the stop message, not killed
    assert not _tp_children()


def test_two_node_launch_on_one_machine(tiny_model_dir, tp1_outputs):
    """Node 1 is `launch_server --node-rank 1` (its rank only, no HTTP); node 0 is the Engine."""
    addr = f"127.0.0.1:{free_port()}"
    node1 = subprocess.Popen([sys.executable, "-m", "radixlang.launch_server", "--model-path", tiny_model_dir,
                              "--load-format", "dummy", "--tp-size", "2", "--nnodes", "2", "--node-rank", "1",
                              "--dist-init-addr", addr, "--log-level", "warning"])
    try:
        with Engine(**_tiny_kw(tiny_model_dir), tp_size=2, nnodes=2, dist_init_addr=addr) as engine:
            assert engine.scheduler.runner.tp_leader.procs == []  # its only other rank is on "node 1"
            got = _run(engine)
        assert node1.wait(timeout=GENEROUS) == 0  # node 1's rank ended at rank 0's stop message
    finally:
        if node1.poll() is None:
            node1.kill()
            node1.wait()
    _assert_same(got, tp1_outputs)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"  # a zombie has exited
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="reads process states from /proc")
def test_follower_exits_when_rank_0_is_killed(tiny_model_dir):
    code = ("import sys; from radixlang import Engine; "
            f"e = Engine(model_path={tiny_model_dir!r}, load_format='dummy', max_total_tokens=256, tp_size=2); "
            "print(e.scheduler.runner.tp_leader.procs[0].pid, flush=True); sys.stdin.read()")
    rank0 = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        follower = int(rank0.stdout.readline())
        assert _alive(follower)
    finally:
        rank0.kill()  # SIGKILL: no atexit, no stop message
        rank0.wait()
    wait_until(lambda: not _alive(follower), what="the follower rank to exit with its leader")


def test_bad_tp_size_is_refused_before_any_rank_starts(tiny_model_dir):
    with pytest.raises(ValueError, match="4 attention heads"):
        Engine(model_path=tiny_model_dir, load_format="dummy", max_total_tokens=256, tp_size=3)
    assert not _tp_children()


@pytest.mark.parametrize("kw,message", [
    (dict(tp_size=2, quantization="int8"), "quantization"),
    (dict(tp_size=3, nnodes=2, dist_init_addr="10.0.0.1:5000"), "multiple of nnodes"),
    (dict(tp_size=2, nnodes=2), "dist_init_addr"),
    (dict(tp_size=2, nnodes=2, node_rank=2, dist_init_addr="10.0.0.1:5000"), "node_rank"),
    (dict(tp_size=2, dist_init_addr="10.0.0.1"), "host:port"),
])
def test_bad_parallel_args_are_refused(kw, message):
    with pytest.raises(ValueError, match=message):
        ServerArgs(**kw)


@pytest.mark.slow  # three processes on two cores; bench/tp.py runs the same comparison
def test_tp3_matches_tp1_on_smollm2(smollm_path):
    """SmolLM2 has 9 heads and 3 kv heads: three ranks of 3 heads and 1 kv head each."""
    kw = dict(model_path=smollm_path, max_total_tokens=512)
    params = {**GREEDY, "max_new_tokens": 4}
    prompt = "The capital of France is"
    with Engine(**kw) as single:
        want = single.generate(prompt, params, return_logprob=True, top_logprobs_num=3)
    with Engine(**kw, tp_size=3) as engine:
        got = engine.generate(prompt, params, return_logprob=True, top_logprobs_num=3)
    _assert_same([got], [want])
    assert not _tp_children()
