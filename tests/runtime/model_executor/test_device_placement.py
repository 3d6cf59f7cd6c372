"""Device placement without a GPU: the whole scheduler runs a ``device="cuda"`` engine on the CPU under
``FakeDeviceMode`` (tests/device_tags.py), which tags every tensor made for the device and raises when
an op mixes a device tensor with a host one, as CUDA would.

Driven through a prefill, a cached extend, decode, a retraction (a KV pool too small for the batch), a
sampled request with penalties and a regex-constrained request; the tokens must equal the same run on
a plain CPU engine, so the mode changes nothing but the tags.
"""
from __future__ import annotations

import pytest
import torch

from device_tags import DeviceMixError, FakeDeviceMode
from waiting import GENEROUS

from radixlang.runtime.sampling.sampling_params import SamplingParams


def test_the_mode_catches_a_mix_and_allows_what_cuda_allows():
    with FakeDeviceMode():
        dev = torch.zeros(4, 3, device="cuda")
        host = torch.ones(4, 3)
        assert dev.device.type == "cuda" and host.device.type == "cpu"
        assert (dev + 1).device.type == "cuda" and dev[1:].device.type == "cuda"
        assert torch.zeros(2, device=dev.device).device.type == "cuda"
        assert dev.cpu().device.type == "cpu" and host.to("cuda").device.type == "cuda"
        dev.copy_(host)  # a copy across devices is fine
        dev[0, 0] = torch.tensor(2.0)  # so is a host scalar
        with pytest.raises(DeviceMixError):
            dev + host
        with pytest.raises(DeviceMixError):  # the decode-batch write of a scheduler building rows on the host
            dev[torch.tensor([0, 1]), torch.tensor([1, 2])] = torch.tensor([5.0, 6.0])
        with pytest.raises(DeviceMixError):
            torch.cat([dev.flatten(), host.flatten()])


def _drive(scheduler) -> dict[str, list[int]]:
    from radixlang.runtime.io_struct import TokenizedGenerateReq as _Req

    logprobs: dict[str, list] = {}

    def TokenizedGenerateReq(**kw):  # every request also asks for input, output and top logprobs
        start = min(len(prefix), len(kw["input_ids"])) - 4
        return _Req(**kw, return_logprob=True, logprob_start_len=start, top_logprobs_num=3)

    prefix = list(range(200, 260))
    reqs = [
        ("greedy", prefix + [5, 6, 7], {"temperature": 0, "max_new_tokens": 24, "ignore_eos": True}),
        ("sampled", list(range(300, 340)), {"temperature": 0.8, "top_k": 20, "top_p": 0.9, "min_p": 0.05,
                                            "frequency_penalty": 0.5, "repetition_penalty": 1.2,
                                            "sampling_seed": 3, "max_new_tokens": 20, "ignore_eos": True}),
        ("regex", list(range(400, 430)), {"temperature": 0, "max_new_tokens": 12, "regex": "[0-9]{3}-[a-z]{2}"}),
    ]
    outputs: dict[str, list[int]] = {}

    def run_until_idle() -> None:
        for _ in range(3000):
            if scheduler.is_idle():
                return
            out = scheduler.step()
            for row in out.rows if out else []:
                outputs.setdefault(row.rid, []).extend(row.output_ids)
        raise AssertionError("the scheduler did not go idle")

    scheduler._finish = _recording(scheduler._finish, logprobs)

    greedy8 = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}
    for rid, ids in (("warm", prefix + [1]), ("cached", prefix + [9, 9])):  # the second reuses the first's KV
        scheduler.add_request(TokenizedGenerateReq(rid=rid, input_ids=ids,
                                                   sampling_params=SamplingParams.from_dict(greedy8)))
        run_until_idle()
    # the regex is compiled (in a worker process) before the burst, so the three requests decode together
    # however long a compile takes on this machine
    scheduler.grammars.compiler.compile_async("regex", reqs[2][2]["regex"]).result(timeout=GENEROUS)
    for rid, ids, params in reqs:  # together they outgrow the pool while decoding: one is retracted
        scheduler.add_request(TokenizedGenerateReq(rid=rid, input_ids=ids,
                                                   sampling_params=SamplingParams.from_dict(params)))
    run_until_idle()
    assert all(logprobs[r] for r in outputs)
    return {**outputs, "logprobs": logprobs}


def _recording(finish, logprobs: dict):
    def wrapped(req):
        logprobs[req.rid] = [round(v, 4) for v, _ in req.input_token_logprobs[1:] + req.output_token_logprobs]
        return finish(req)
    return wrapped


def _args(tiny_model_dir: str, device: str):
    from radixlang.runtime.server_args import ServerArgs
    # 140 KV slots: the three requests of the burst need ~190 at their longest
    return ServerArgs(model_path=tiny_model_dir, load_format="dummy", device=device, dtype="float32",
                      attention_backend="torch", max_total_tokens=140, disable_cuda_graph=True,
                      max_running_requests=8)


@pytest.fixture(scope="module")
def cpu_reference(tiny_model_dir) -> dict:
    """The drive's tokens and logprobs on a plain CPU engine."""
    from radixlang.runtime.scheduler.build import build_scheduler
    return _drive(build_scheduler(_args(tiny_model_dir, "cpu")))


def test_a_cuda_engine_mixes_no_host_tensor_into_device_ops(tiny_model_dir, monkeypatch, cpu_reference):
    from radixlang.kernels import bitmask
    from radixlang.runtime.scheduler.build import build_scheduler

    # the grammar mask takes the device (Triton) path; its kernel cannot launch on the CPU, so the torch
    # path stands in for it after the device checks the Triton path makes
    triton_calls = []

    def fake_triton(logits, mask, indices=None):
        bitmask._check(logits, mask)  # same device, shapes, dtypes
        triton_calls.append(len(indices))
        bitmask.apply_token_bitmask_inplace_torch(logits, mask, indices)

    monkeypatch.setattr(bitmask, "apply_token_bitmask_inplace_triton", fake_triton)

    ref = cpu_reference
    mode = FakeDeviceMode()
    with mode:
        sched = build_scheduler(_args(tiny_model_dir, "cuda"))
        assert sched.runner.req_to_token_pool.req_to_token.device.type == "cuda"
        assert sched.runner.kv_pool.k_buffer[0].device.type == "cuda"
        got = _drive(sched)
        sched.check_memory_leak()
    assert sched.stats["num_retractions"] > 0
    assert sched.stats["cached_tokens"] > 0
    assert mode.num_checked_ops > 1000
    assert got == ref
    assert len(got["regex"]) > 0 and len(got["logprobs"]["greedy"]) > 24
    assert triton_calls  # the constrained request's mask ran on the device path


def test_the_tp_step_message_is_built_on_the_host_from_device_tensors(monkeypatch):
    from radixlang.kernels.attention.base import ForwardMode
    from radixlang.runtime.model_executor import distributed
    from radixlang.runtime.model_executor.forward_batch import StepInputs

    sent: list[torch.Tensor] = []
    monkeypatch.setattr(distributed.dist, "broadcast", lambda t, src: sent.append(t.clone()))
    with FakeDeviceMode():
        r2t = torch.arange(40, dtype=torch.int32, device="cuda").view(4, 10)
        inputs = StepInputs(mode=ForwardMode.EXTEND, input_ids=torch.tensor([7, 8, 9]),
                            positions=torch.tensor([0, 1, 0]), req_pool_indices=torch.tensor([1, 2]),
                            seq_lens=[2, 1], prefix_lens=[0, 0], extend_lens=[2, 1],
                            out_cache_loc=r2t[1, :2].to(torch.int64), logit_rows=torch.tensor([1, 2]),
                            prompt_lens=[5, 1])
        comm = distributed.DistComm(0, 2, "cuda")
        followers = torch.zeros_like(r2t)  # rank 0's copy of the followers' table, where the table lives
        distributed.send_step(comm, inputs, r2t, followers)
        assert all(t.device.type == "cuda" for t in sent)  # nccl moves device tensors
    header, payload = sent
    assert header.tolist() == [distributed.MSG_STEP, int(ForwardMode.EXTEND), 2, 3, 2, 3]
    # ids, positions, req rows, seq lens, prefix lens, extend lens, prompt lens, out_cache_loc, logit rows,
    # changed r2t entries (rows, columns, slots)
    assert payload.tolist() == [7, 8, 9, 0, 1, 0, 1, 2, 2, 1, 0, 0, 2, 1, 5, 1, 10, 11, 1, 2,
                                1, 1, 2, 0, 1, 0, 10, 11, 20]
    assert followers[1, :2].tolist() == [10, 11] and followers[2, :1].tolist() == [20]


def test_tp_steps_send_only_the_req_to_token_entries_that_changed():
    # #39: each step broadcast every request's whole row; a decode step changes one entry per request, and
    # whatever rank 0 rewrote between steps (a radix insert, a reused row) must still reach the followers
    from radixlang.runtime.model_executor.distributed import req_to_token_changes

    table = torch.zeros(4, 64, dtype=torch.int32)
    table[0, :40] = torch.arange(1, 41)
    table[2, :30] = torch.arange(100, 130)
    followers = torch.zeros_like(table)
    rows = torch.tensor([0, 2])
    first = req_to_token_changes(table, followers, rows, [40, 30])
    assert first.shape == (3, 70)
    table[0, 40], table[2, 30] = 41, 130  # a decode step: one new slot each
    step = req_to_token_changes(table, followers, rows, [41, 31])
    assert step.tolist() == [[0, 2], [40, 30], [41, 130]]
    table[2, 5:10] = torch.arange(500, 505)  # rank 0 points request 2 at the tree's copy of its prefix
    table[2, 31] = 131
    step = req_to_token_changes(table, followers, rows, [41, 32])
    assert step.tolist() == [[2] * 6, [5, 6, 7, 8, 9, 31], [500, 501, 502, 503, 504, 131]]
    # what the followers hold, kept by applying the changes, equals rank 0's rows as far as the batch reads
    assert torch.equal(followers[0, :41], table[0, :41]) and torch.equal(followers[2, :32], table[2, :32])
    table[3, :8] = 7  # a row beyond the batch, or past a request's length, is not sent
    table[0, 50] = 9
    assert req_to_token_changes(table, followers, rows, [41, 32]).shape == (3, 0)


def test_the_padding_row_is_reserved_for_cuda_graph_padding():
    from radixlang.runtime.mem_cache.memory_pool import ReqToTokenPool

    pool = ReqToTokenPool(4, 16, "cpu")
    assert pool.req_to_token.shape == (5, 16) and pool.pad_index == 4
    assert sorted(pool.alloc(4)) == [0, 1, 2, 3] and pool.alloc(1) is None
    pool.clear()
    assert pool.available_size() == 4 and pool.pad_index not in pool.alloc(4)
    assert int(pool.req_to_token[pool.pad_index].abs().sum()) == 0  # it points at the dummy KV slot 0


def test_the_captured_decode_forward_reads_nothing_back_from_the_device(tiny_model_dir):
    # what a CUDA graph captures (the runner's decode forward into the shared logits buffer) must not read
    # device values on the host: a sync inside a capture fails it. The attention kernels are the backends'
    # (tested on the GPU); here a stand-in writes the KV and returns q, with no host reads of its own.
    from radixlang.kernels.attention.base import AttentionBackend
    from radixlang.kernels.cuda_graph import DecodeGraphInputs
    from radixlang.runtime.model_executor.model_runner import ModelRunner

    class NoSyncAttention(AttentionBackend):
        def forward_decode(self, q, k, v, layer, fb):
            fb.token_to_kv_pool.set_kv_buffer(layer.layer_id, fb.out_cache_loc, k, v)
            return q

    with FakeDeviceMode() as mode:
        runner = ModelRunner(_args(tiny_model_dir, "cuda").resolve())
        assert runner.graph_runner is None  # disable_cuda_graph: no capture
        runner.attn_backend = NoSyncAttention()
        runner._graph_logits = torch.empty((8, runner.vocab_size), device="cuda")
        bs = 3
        ids = torch.tensor([5, 6, 7], device="cuda")
        inputs = DecodeGraphInputs(input_ids=ids, positions=torch.tensor([4, 9, 2], device="cuda"),
                                   req_pool_indices=torch.tensor([0, 1, runner.req_to_token_pool.pad_index],
                                                                 device="cuda"),
                                   seq_lens=torch.tensor([5, 10, 3], device="cuda"),
                                   out_cache_loc=torch.tensor([11, 12, 0], device="cuda"), seq_lens_cpu=[5, 10, 3])
        fb = runner._graph_forward_batch(inputs)
        before = mode.num_syncs
        out = runner._graph_model_forward(inputs.input_ids, inputs.positions, fb)
        assert mode.num_syncs == before
        assert out.device.type == "cuda" and out.shape == (bs, runner.vocab_size)
        assert out.untyped_storage().data_ptr() == runner._graph_logits.untyped_storage().data_ptr()


def _toolchain(tmp_path, monkeypatch, *tools: str) -> None:
    """A PATH holding only executables named ``tools`` (stand-ins that do nothing), no CUDA toolkit elsewhere,
    and FlashInfer's cache in an empty folder."""
    from radixlang.kernels.attention import flashinfer_probe

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for tool in tools:
        (bin_dir / tool).write_text("#!/bin/sh\nexit 1\n")
        (bin_dir / tool).chmod(0o755)
    monkeypatch.setenv("PATH", str(bin_dir))
    for var in ("CUDA_HOME", "CUDA_PATH", "FLASHINFER_NVCC"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("FLASHINFER_WORKSPACE_BASE", str(tmp_path / "fi_cache"))
    monkeypatch.setattr(flashinfer_probe, "DEFAULT_CUDA_HOME", str(tmp_path / "no_cuda"))


def _stub_flashinfer(tmp_path, monkeypatch):
    """``import flashinfer`` works (as it does without nvcc); its package folder has no prebuilt kernels."""
    import sys
    import types

    pkg = tmp_path / "site" / "flashinfer"
    pkg.mkdir(parents=True, exist_ok=True)
    stub = types.ModuleType("flashinfer")
    stub.__file__ = str(pkg / "__init__.py")
    monkeypatch.setitem(sys.modules, "flashinfer", stub)
    monkeypatch.setitem(sys.modules, "triton", types.ModuleType("triton"))
    return pkg


@pytest.mark.parametrize("dtype,want", [("auto", "flashinfer"), ("bfloat16", "flashinfer"), ("float16", "flashinfer"),
                                        ("float32", "triton")])
def test_cuda_resolves_float32_to_triton_not_flashinfer(monkeypatch, tmp_path, dtype, want):
    # FlashInfer runs float16 / bfloat16 only: float32 on CUDA must not pick it (it would refuse at start);
    # nvcc and ninja are there, so FlashInfer could compile
    from radixlang.runtime.server_args import ServerArgs

    _stub_flashinfer(tmp_path, monkeypatch)
    _toolchain(tmp_path, monkeypatch, "nvcc", "ninja")
    args = ServerArgs(device="cuda", dtype=dtype).resolve()
    assert args.attention_backend == want
    assert args.dtype == ("bfloat16" if dtype == "auto" else dtype)


def test_auto_picks_triton_when_flashinfer_cannot_compile(monkeypatch, tmp_path, caplog):
    # #39: `import flashinfer` works without nvcc, then its JIT fails inside graph capture and the server dies;
    # auto must see that it cannot build its kernels and run triton, and say why
    import logging

    import torch

    from radixlang.runtime.server_args import ServerArgs

    _stub_flashinfer(tmp_path, monkeypatch)
    _toolchain(tmp_path, monkeypatch, "ninja")  # no nvcc anywhere
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with caplog.at_level(logging.INFO, logger="radixlang.runtime.server_args"):
        args = ServerArgs().resolve()
    assert args.device == "cuda" and args.attention_backend == "triton"
    why = " ".join(r.getMessage() for r in caplog.records)
    assert "auto -> triton" in why and "no nvcc" in why


def test_auto_picks_flashinfer_with_prebuilt_kernels_and_no_nvcc(monkeypatch, tmp_path):
    from radixlang.runtime.server_args import ServerArgs

    _toolchain(tmp_path, monkeypatch)  # neither nvcc nor ninja
    pkg = _stub_flashinfer(tmp_path, monkeypatch)
    assert ServerArgs(device="cuda").resolve().attention_backend == "triton"
    # modules FlashInfer's JIT left in its cache on an earlier run
    cached = tmp_path / "fi_cache" / ".cache" / "flashinfer" / "90a" / "cached_ops"
    for name in ("batch_prefill_with_kv_cache_bf16_128", "batch_decode_with_kv_cache_bf16_128"):
        (cached / name).mkdir(parents=True)
        (cached / name / f"{name}.so").write_bytes(b"")
    assert ServerArgs(device="cuda").resolve().attention_backend == "flashinfer"
    # or kernels compiled ahead of time inside the package
    import shutil
    shutil.rmtree(tmp_path / "fi_cache")
    (pkg / "data" / "aot").mkdir(parents=True)
    (pkg / "data" / "aot" / "kernels.so").write_bytes(b"")
    assert ServerArgs(device="cuda").resolve().attention_backend == "flashinfer"


@pytest.mark.parametrize("dp,tp,gpus,want", [(2, 1, 2, [[0], [1]]), (2, 2, 4, [[0, 1], [2, 3]]),
                                             (3, 1, 4, [[0], [1], [2]])])
def test_dp_replica_i_runs_on_its_own_gpus(dp, tp, gpus, want):
    # #39: every dp replica used to land on cuda:0
    from radixlang.runtime.model_executor.tp_leader import cuda_device_index
    from radixlang.runtime.server_args import ServerArgs

    args = ServerArgs(device="cuda", dp_size=dp, tp_size=tp)
    got = [[cuda_device_index(args.for_replica(i), r, gpus) for r in range(tp)] for i in range(dp)]
    assert got == want
    with pytest.raises(ValueError, match=f"found {dp * tp - 1} GPU"):
        cuda_device_index(args.for_replica(dp - 1), tp - 1, dp * tp - 1)
    shifted = ServerArgs(device="cuda", dp_size=dp, tp_size=tp, base_gpu_id=1)
    assert cuda_device_index(shifted.for_replica(dp - 1), tp - 1, 8) == dp * tp


def test_each_replica_sets_its_gpu_before_building(tiny_model_dir, monkeypatch):
    # the runner makes its replica's GPU the current device (per thread) before it allocates anything
    import dataclasses

    import torch

    from radixlang.runtime.model_executor import model_runner

    devices: list[int] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", devices.append)

    class Stop(Exception):
        pass

    def stop(self, *build_args):
        raise Stop

    monkeypatch.setattr(model_runner.ModelRunner, "_build", stop)
    args = dataclasses.replace(_args(tiny_model_dir, "cuda"), dp_size=2)
    for i in range(2):
        with pytest.raises(Stop):
            model_runner.ModelRunner(args.for_replica(i))
    assert devices == [0, 1]


def test_cuda_graph_flags_are_validated_and_read():
    from radixlang.runtime.server_args import ServerArgs

    with pytest.raises(ValueError, match="cuda_graph_max_bs"):
        ServerArgs(cuda_graph_max_bs=0)
    with pytest.raises(ValueError, match="flashinfer_backend"):
        ServerArgs(flashinfer_backend="fa4")


class _FakeGraph:
    """Stands in for torch.cuda.CUDAGraph on the CPU: capture records the call, replay runs it again on the same
    static tensors (what a real replay does with the captured kernels)."""

    recording: _FakeGraph | None = None

    def __init__(self) -> None:
        self.call = None

    def replay(self) -> None:
        fn, args = self.call
        fn(*args)


def _emulate_cuda_graphs(monkeypatch):
    import contextlib
    import types

    from radixlang.kernels.attention.torch_native import TorchNativeAttnBackend
    from radixlang.runtime.model_executor import model_runner

    class GraphTorchBackend(TorchNativeAttnBackend):  # the graph hooks of the triton / flashinfer backends
        def init_cuda_graph_state(self, max_bs, max_context_len):
            self.graph_state = (max_bs, max_context_len)

        def init_forward_metadata_cuda_graph(self, fb):
            self.init_forward_metadata(fb)

    @contextlib.contextmanager
    def graph(g, pool=None, stream=None):
        _FakeGraph.recording = g
        try:
            yield
        finally:
            _FakeGraph.recording = None

    stream = types.SimpleNamespace(wait_stream=lambda other: None)
    cuda = torch.cuda
    monkeypatch.setattr(cuda, "CUDAGraph", _FakeGraph)
    monkeypatch.setattr(cuda, "graph", graph)
    monkeypatch.setattr(cuda, "graph_pool_handle", lambda: None)
    monkeypatch.setattr(cuda, "Stream", lambda device=None: stream)
    monkeypatch.setattr(cuda, "current_stream", lambda device=None: stream)
    monkeypatch.setattr(cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(model_runner, "_create_attn_backend", lambda name, **kw: GraphTorchBackend(
        **{k: v for k, v in kw.items() if k != "flashinfer_backend"}))
    forward = model_runner.ModelRunner._graph_model_forward

    def recorded(self, *args):
        if _FakeGraph.recording is not None:
            _FakeGraph.recording.call = (forward, (self, *args))
        return forward(self, *args)

    monkeypatch.setattr(model_runner.ModelRunner, "_graph_model_forward", recorded)


def test_decode_replays_padded_cuda_graphs_with_the_eager_tokens(tiny_model_dir, monkeypatch, cpu_reference):
    # the runner's graph wiring run on the CPU with emulated graphs: capture sizes from --cuda-graph-max-bs,
    # batches padded to the next size with the reserved row, logits in the one shared buffer, eager above the
    # largest size and for extends; the tokens equal a plain CPU engine's
    import dataclasses

    from radixlang.kernels import bitmask
    from radixlang.kernels.cuda_graph import CudaGraphRunner, default_capture_sizes
    from radixlang.runtime.scheduler.build import build_scheduler

    ref = cpu_reference
    _emulate_cuda_graphs(monkeypatch)
    monkeypatch.setattr(bitmask, "apply_token_bitmask_inplace_triton", bitmask.apply_token_bitmask_inplace_torch)
    replays: list[tuple[int, int, list[int]]] = []
    replay = CudaGraphRunner.replay

    def counted(self, input_ids, positions, fb):
        out = replay(self, input_ids, positions, fb)
        graph_bs = next(s for s in self.capture_sizes if s >= fb.batch_size)
        replays.append((fb.batch_size, graph_bs, self.req_pool_indices[fb.batch_size:graph_bs].tolist()))
        assert out.untyped_storage().data_ptr() == self.outputs[self.max_bs].untyped_storage().data_ptr()
        return out

    monkeypatch.setattr(CudaGraphRunner, "replay", counted)
    assert default_capture_sizes(160) == [1, 2, 4, 8] + list(range(16, 161, 8))
    args = dataclasses.replace(_args(tiny_model_dir, "cuda"), disable_cuda_graph=False, cuda_graph_max_bs=4)
    with FakeDeviceMode():
        sched = build_scheduler(args)
        runner = sched.runner.graph_runner
        assert runner is not None and runner.capture_sizes == [1, 2, 4]
        assert sched.runner.attn_backend.graph_state == (4, sched.runner.req_to_token_pool.max_context_len)
        got = _drive(sched)
    assert got == ref
    assert {(b, g) for b, g, _ in replays} >= {(1, 1), (3, 4)}  # three decoding requests ran in the 4-graph
    pad = sched.runner.req_to_token_pool.pad_index
    assert all(rows == [pad] * (g - b) for b, g, rows in replays)  # padded with the reserved row only
