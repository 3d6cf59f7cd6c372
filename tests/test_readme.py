"""The user-facing docs stay short and their references stay real."""
from __future__ import annotations

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", ROOT / "bench" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def test_readme_is_under_10000_characters():
    assert len((ROOT / "README.md").read_text(encoding="utf-8")) < 10_000


def test_local_links_and_images_exist():
    for doc in DOCS:
        for target in re.findall(r"\]\(([^)\s#]+)(?:#[^)]*)?\)", doc.read_text(encoding="utf-8")):
            if "://" in target:
                continue
            assert (doc.parent / target).exists(), f"{doc.relative_to(ROOT)} links to missing {target}"


def test_structure_names_only_modules_that_exist():
    text = (ROOT / "docs" / "structure.md").read_text(encoding="utf-8")
    rows = [line.split("|")[1] for line in text.splitlines() if line.startswith("| `")]
    assert len(rows) > 20
    for cell in rows:
        for name in re.findall(r"`([^`]+)`", cell):
            base = ROOT if name.split("/")[0] in ("bench", "tests", "radixlang") else ROOT / "radixlang"
            assert (base / name).exists(), f"docs/structure.md names {name}, which does not exist"
    # every runtime module is mentioned somewhere in the document (a new module needs its line)
    runtime = ROOT / "radixlang" / "runtime"
    for path in sorted(runtime.rglob("*.py")):
        if path.name != "__init__.py":
            assert path.name in text, f"docs/structure.md does not mention runtime/{path.relative_to(runtime)}"
