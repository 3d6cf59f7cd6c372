"""bench.run_all runs each system in its own process and brings every row back, failures included."""
from __future__ import annotations

from dataclasses import dataclass

from bench.run_all import run_system
from bench.systems import RadixSystem, System
from bench.workloads import all_workloads


@dataclass(frozen=True)
class BrokenSystem(System):
    def open(self, model_dir: str):
        raise RuntimeError("cannot start")


def _workloads(*names: str):
    return [w for w in all_workloads() if w.name in names]


def test_system_runs_in_a_child_process(tiny_model_dir):
    system = RadixSystem("radixlang", 2, engine_kwargs=(("load_format", "dummy"), ("max_total_tokens", 4096)))
    rows = dict(run_system(system, _workloads("mmlu_5shot_gen", "mmlu_5shot_select"), tiny_model_dir, 3))
    assert set(rows) == {"mmlu_5shot_gen", "mmlu_5shot_select"}
    for row in rows.values():
        assert "error" not in row, row
        assert row["programs"] == 3 and row["seconds"] > 0 and 0 < row["hit_rate"] <= 1


def test_a_system_that_cannot_start_reports_an_error_row(tiny_model_dir):
    rows = list(run_system(BrokenSystem("broken", 1), _workloads("mmlu_5shot_gen"), tiny_model_dir, 1))
    assert rows == [(None, {"error": "RuntimeError: cannot start"})]
