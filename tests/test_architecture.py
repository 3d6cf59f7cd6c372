"""The folder import rules of DESIGN.md, checked by parsing imports."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parent.parent / "radixlang"
FORBIDDEN = {
    "radix_cache": ("radixlang.runtime", "radixlang.lang", "radixlang.constrained"),
    "constrained": ("radixlang.runtime", "radixlang.lang", "radixlang.radix_cache"),
    "kernels": ("radixlang.runtime", "radixlang.lang", "radixlang.radix_cache", "radixlang.constrained"),
    "runtime": ("radixlang.lang",),
}


def _imports(path: Path, *, top_level_only: bool):
    tree = ast.parse(path.read_text())
    nodes = tree.body if top_level_only else ast.walk(tree)
    for node in nodes:
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            yield node.module


@pytest.mark.parametrize("folder", sorted(FORBIDDEN))
def test_folder_imports(folder):
    bad = []
    for path in (PKG / folder).rglob("*.py"):
        for mod in _imports(path, top_level_only=False):
            if mod.startswith(FORBIDDEN[folder]):
                bad.append(f"{path.relative_to(PKG)} imports {mod}")
    assert not bad, bad


def test_lang_never_imports_torch_at_module_level():
    bad = [f"{p.relative_to(PKG)}" for p in (PKG / "lang").rglob("*.py")
           if any(m == "torch" or m.startswith("torch.") for m in _imports(p, top_level_only=True))]
    assert not bad, bad


def test_importing_radixlang_does_not_load_torch():
    code = "import sys, radixlang; assert 'torch' not in sys.modules, 'torch loaded'"
    subprocess.run([sys.executable, "-c", code], check=True)
