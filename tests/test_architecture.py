"""The folder import rules of DESIGN.md, checked by parsing imports."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parent.parent / "radixlang"
RT = "radixlang.runtime."
FORBIDDEN = {
    "radix_cache": ("radixlang.runtime", "radixlang.lang", "radixlang.constrained"),
    "constrained": ("radixlang.runtime", "radixlang.lang", "radixlang.radix_cache"),
    "kernels": ("radixlang.runtime", "radixlang.lang", "radixlang.radix_cache", "radixlang.constrained"),
    "runtime": ("radixlang.lang",),
    # the runtime's rooms, lowest first: each may import only the rooms below it
    "runtime/sampling": tuple(RT + r for r in ("mem_cache", "models", "model_executor", "scheduler", "front",
                                               "dp", "entrypoints")),
    "runtime/dp": tuple(RT + r for r in ("sampling", "mem_cache", "models", "model_executor", "scheduler",
                                         "front", "entrypoints")),
    "runtime/mem_cache": tuple(RT + r for r in ("models", "model_executor", "scheduler", "front", "dp",
                                                "entrypoints")),
    "runtime/models": tuple(RT + r for r in ("mem_cache", "lora", "model_executor", "scheduler", "front", "dp",
                                             "entrypoints")),
    # adapters over the models' linears: below the runner, which owns them
    "runtime/lora": tuple(RT + r for r in ("mem_cache", "model_executor", "scheduler", "front", "dp",
                                           "entrypoints")),
    "runtime/model_executor": tuple(RT + r for r in ("scheduler", "front", "dp", "entrypoints")),
    # the scheduler and the request front meet only through the messages of runtime/io_struct.py
    "runtime/scheduler": tuple(RT + r for r in ("front", "dp", "entrypoints")),
    "runtime/front": tuple(RT + r for r in ("scheduler", "model_executor", "models", "mem_cache",
                                            "entrypoints")),
}


def _imports(path: Path, *, top_level_only: bool):
    tree = ast.parse(path.read_text())
    nodes = tree.body if top_level_only else ast.walk(tree)
    for node in nodes:
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            yield node.module


def _module_name(path: Path) -> str:
    parts = path.relative_to(PKG.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@pytest.mark.parametrize("folder", sorted(FORBIDDEN))
def test_folder_imports(folder):
    bad = []
    for path in (PKG / folder).rglob("*.py"):
        for mod in _imports(path, top_level_only=False):
            if mod.startswith(FORBIDDEN[folder]):
                bad.append(f"{path.relative_to(PKG)} imports {mod}")
    assert not bad, bad


# the scheduler decides each step's batch and plan; the runner executes it, samples and returns token ids
# (as vLLM v1 splits them): scheduler.py runs no model code, no sampling math and no torch op of its own
SCHEDULER_NEVER = ("torch", "radixlang.kernels.bitmask", "radixlang.runtime.models",
                   "radixlang.runtime.model_executor.model_runner", "radixlang.runtime.sampling.sampler",
                   "radixlang.runtime.sampling.step_sampler")


def test_the_scheduler_imports_no_model_code():
    path = PKG / "runtime" / "scheduler" / "scheduler.py"
    bad = [mod for mod in _imports(path, top_level_only=False)
           if any(mod == b or mod.startswith(b + ".") for b in SCHEDULER_NEVER)]
    assert not bad, f"scheduler.py imports {bad}"


def test_every_runtime_room_has_a_rule_and_a_docstring():
    rooms = sorted(p.name for p in (PKG / "runtime").iterdir() if p.is_dir() and (p / "__init__.py").exists())
    assert rooms, "runtime has no subpackages"
    for room in rooms:
        doc = ast.get_docstring(ast.parse((PKG / "runtime" / room / "__init__.py").read_text()))
        assert doc, f"runtime/{room}/__init__.py has no docstring saying what it owns"
        assert room == "entrypoints" or f"runtime/{room}" in FORBIDDEN, f"runtime/{room} has no import rule"


def test_no_import_cycles():
    """Between the package's modules, counting every import (lazy ones in functions too)."""
    graph: dict[str, set[str]] = {}
    paths = {_module_name(p): p for p in PKG.rglob("*.py")}
    for name, path in paths.items():
        deps = set()
        for mod in _imports(path, top_level_only=False):
            # `from radixlang.x import y` may name a module y of package x
            for cand in (mod, *(f"{mod}.{a.name}" for n in ast.walk(ast.parse(path.read_text()))
                                if isinstance(n, ast.ImportFrom) and n.module == mod for a in n.names)):
                if cand in paths and cand != name and not name.startswith(cand + "."):
                    deps.add(cand)
        graph[name] = {d for d in deps if not (paths[d].name == "__init__.py" and name.startswith(d))}
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(n: str) -> list[str] | None:
        state[n] = 1
        stack.append(n)
        for d in sorted(graph[n]):
            if paths[d].name == "__init__.py":
                continue  # a package's public face may re-export its modules
            if state.get(d) == 1:
                return stack[stack.index(d):] + [d]
            if d not in state and (cycle := visit(d)):
                return cycle
        stack.pop()
        state[n] = 2
        return None

    for n in sorted(graph):
        if n not in state and (cycle := visit(n)):
            pytest.fail("import cycle: " + " -> ".join(cycle))


def test_lang_never_imports_torch_at_module_level():
    bad = [f"{p.relative_to(PKG)}" for p in (PKG / "lang").rglob("*.py")
           if any(m == "torch" or m.startswith("torch.") for m in _imports(p, top_level_only=True))]
    assert not bad, bad


def test_importing_radixlang_does_not_load_torch():
    code = "import sys, radixlang; assert 'torch' not in sys.modules, 'torch loaded'"
    subprocess.run([sys.executable, "-c", code], check=True)
