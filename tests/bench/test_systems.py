"""The run_all systems beyond the Engine: the HTTP server (always) and llama.cpp (when installed)."""
from __future__ import annotations

import pytest

from bench.run_all import run_workload
from bench.systems import CountingRuntime, System, close, default_systems
from bench.workloads import all_workloads

pytestmark = pytest.mark.e2e


def _workload(name: str):
    return next(w for w in all_workloads() if w.name == name)


def test_server_system_runs_programs_over_http(tiny_model_dir):
    server = CountingRuntime(model_path=tiny_model_dir, load_format="dummy", max_total_tokens=8192,
                             log_level="warning", launch_timeout=120)
    try:
        select = run_workload(_workload("mmlu_5shot_select"), server, n=4, concurrency=4)
        gen = run_workload(_workload("fewshot_417"), server, n=4, concurrency=4)
    finally:
        close(server)
    assert server.pid is None  # close() stopped the server it launched
    for row in (select, gen):
        assert "error" not in row, row.get("error")
        assert row["programs"] == 4
    assert select["hit_rate"] > 0.5  # the 5-shot prefix is shared through the server's radix cache
    assert gen["tokens_s"] > 0 and all(isinstance(s["answer"], str) for s in gen["states"])


def test_missing_optional_systems_are_skipped(capsys):
    names = [s.name for s in default_systems(4)]
    assert names[:5] == ["radixlang", "radixlang_bf16", "radixlang_no_cache", "radixlang_server", "transformers"]
    out = capsys.readouterr().out
    for name in ("llama.cpp", "outlines"):
        assert (name in names) != (f"skipping {name}" in out)
    only_json = next((s for s in default_systems(4) if s.name == "outlines"), System("x", 1, ("json_extraction",)))
    assert only_json.runs("json_extraction") and not only_json.runs("mmlu_5shot_gen")


def test_llama_cpp_runs_gen_and_select(smollm_path):
    pytest.importorskip("llama_cpp")
    system = next(s for s in default_systems(1) if s.name == "llama.cpp")
    backend = system.open(smollm_path)
    try:
        select = run_workload(_workload("mmlu_5shot_select"), backend, n=1, concurrency=1)
        gen = run_workload(_workload("fewshot_417"), backend, n=2, concurrency=1)
    finally:
        close(backend)
    assert "error" not in select and "error" not in gen, (select.get("error"), gen.get("error"))
    assert select["states"][0]["answer"] in (" A", " B", " C", " D")
    # llama.cpp reuses the previous prompt's prefix: choices 2-4 after the first, program 2's few-shot prefix
    assert select["hit_rate"] > 0.5 and gen["hit_rate"] > 0.3
