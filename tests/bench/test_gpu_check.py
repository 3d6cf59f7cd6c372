"""The GPU check's driver and bundle, without a GPU (bench/gpu_check.py, bench/prepare_gpu_bundle.py).

The phases themselves run with ``bash bench/gpu_check.sh --device cpu`` (about two minutes here): too long for
the suite, so these tests cover what the check's time depends on: a phase killed at its cap takes its
whole process group with it (compilers, workers) and leaves the figures it had written.
"""
from __future__ import annotations

import json
import os
import sys
import time
import types

import pytest

PHASE = """
import json, os, subprocess, sys, time
out = sys.argv[sys.argv.index("--out") + 1]
name = sys.argv[sys.argv.index("--phase") + 1]
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])  # a compiler, say
with open(os.path.join(out, "grandchild.pid"), "w") as f:
    f.write(str(child.pid))
with open(os.path.join(out, f"phase_{name}.json"), "w") as f:
    json.dump({"rows": {"first": {"ok": True}}}, f)  # a row done before the cap
time.sleep(120)
"""


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] == "Z"  # killed, not yet reaped
    except FileNotFoundError:
        return True


def test_a_phase_past_its_cap_is_killed_with_its_group_and_keeps_its_figures(tmp_path):
    from bench.gpu_check import _run_group

    script = tmp_path / "phase.py"
    script.write_text(PHASE)
    args = types.SimpleNamespace(out=str(tmp_path))
    groups: list = []
    start = time.monotonic()
    res = _run_group(args, [sys.executable, str(script), "--out", str(tmp_path)], "slow", 6.0, groups)
    assert time.monotonic() - start < 60
    assert res["ok"] is False and "cap" in res["error"]
    assert res["rows"] == {"first": {"ok": True}}
    pid = int((tmp_path / "grandchild.pid").read_text())
    deadline = time.monotonic() + 30
    while not _gone(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _gone(pid), "the phase's child outlived the phase"
    assert groups[0].proc.returncode is not None


def test_a_phase_that_dies_without_figures_is_a_failure_naming_its_log(tmp_path):
    from bench.gpu_check import _run_group

    args = types.SimpleNamespace(out=str(tmp_path))
    res = _run_group(args, [sys.executable, "-c", "raise SystemExit(3)"], "broken", 30.0, [])
    assert res["ok"] is False and "no figures" in res["error"]
    half = f"open({str(tmp_path / 'phase_half.json')!r}, 'w').write('{{\"rows\": {{}}}}'); raise SystemExit(1)"
    res = _run_group(args, [sys.executable, "-c", half], "half", 30.0, [])
    assert res["ok"] is False and "exited with code 1" in res["error"] and res["rows"] == {}
    assert "no time left" in _run_group(args, [sys.executable, "-c", "pass"], "late", 2.0, [])["error"]


def test_the_bundle_carries_each_config_and_one_tokenizer(tmp_path, smollm_path):
    from bench.gpu_check import dry_run
    from bench.gpu_phases import MODELS
    from bench.prepare_gpu_bundle import CONFIGS, folder_bytes, write_models

    write_models(str(tmp_path), smollm_path)
    assert sorted(os.listdir(tmp_path / "models")) == sorted(CONFIGS) == sorted(MODELS.values())
    for name in CONFIGS:
        assert os.listdir(tmp_path / "models" / name) == ["config.json"]
    assert (tmp_path / "tokenizer" / "tokenizer.json").exists()
    # the configs and the tokenizer are a few MiB of the 64 MiB bundle (the wheels and FlashInfer's sources
    # are the rest)
    assert folder_bytes(str(tmp_path)) < 4 << 20
    moe = json.loads((tmp_path / "models" / MODELS["moe"] / "config.json").read_text())
    assert moe["architectures"] == ["MixtralForCausalLM"] and moe["num_local_experts"] > moe["num_experts_per_tok"]
    problems = dry_run(str(tmp_path))["problems"]
    assert not [p for p in problems if "models/" in p or "tokenizer" in p]


@pytest.mark.parametrize("shape", ["dense", "moe", "perf"])
def test_a_cpu_run_needs_no_bundle(tmp_path, shape):
    from bench.gpu_phases import MODELS, SMALL, model_folder

    args = types.SimpleNamespace(out=str(tmp_path), bundle=str(tmp_path / "absent"), device="cpu")
    folder = model_folder(args, MODELS[shape])
    config = json.loads(open(os.path.join(folder, "config.json")).read())
    assert all(config[k] == v for k, v in SMALL[MODELS[shape]].items())
    assert os.path.exists(os.path.join(folder, "tokenizer.json"))


def test_weights_drawn_on_the_device_fill_the_same_tensors_as_the_loaders(tiny_model_dir):
    from bench.gpu_phases import device_random_weights
    from radixlang.runtime.models.loader.model_loader import random_weights, read_config

    config = read_config(tiny_model_dir)
    want = {name: tuple(t.shape) for name, t in random_weights(config, 0)}
    got = {name: tuple(t.shape) for name, t in device_random_weights("cpu")(config, 0)}
    assert got == want
