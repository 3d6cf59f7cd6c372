"""Every example in examples/ runs: each file's run(engine) on the tiny random-weight model.

The examples' main() builds an Engine on the embedded SmolLM2 (what a user runs); run(engine) is the
program itself, so the tests drive it on the session's tiny engine. Random weights make the text
meaningless; what is checked is that every example executes end to end and prints what it promises.
"""
from __future__ import annotations

import importlib.util
import pathlib

import pytest

pytestmark = pytest.mark.e2e

EXAMPLES = pathlib.Path(__file__).resolve().parents[2] / "examples"
FILES = sorted(EXAMPLES.glob("*.py"))

# a line each example must print
EXPECTED = {
    "agent_tool_loop.py": "user: What is 17 * 23?",
    "few_shot_select.py": "accuracy: ",
    "json_extraction.py": '"name"',  # the schema's first key, forced by constrained decoding
    "multi_turn_chat.py": "cached tokens in the second turn: ",
    "parallel_tips.py": "Here are two tips for staying healthy",
    "streaming.py": "---",
}


def _load(path: pathlib.Path):
    spec = importlib.util.spec_from_file_location(f"example_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_example_is_covered():
    assert {p.name for p in FILES} == set(EXPECTED)


@pytest.mark.parametrize("path", FILES, ids=[p.stem for p in FILES])
def test_example_runs(path, tiny_engine, capsys):
    module = _load(path)
    assert callable(module.main)  # what `python examples/<name>.py` runs
    module.run(tiny_engine)
    out = capsys.readouterr().out
    assert out.strip(), f"{path.name} printed nothing"
    assert EXPECTED[path.name] in out
