"""Every flag in `launch_server --help` is a ServerArgs field that the package reads somewhere.

A field nobody reads is a flag that silently does nothing; this guard fails when one is added.
"""
from __future__ import annotations

import ast
import dataclasses
import pathlib
import re

import pytest

from radixlang import launch_server
from radixlang.runtime.server_args import ServerArgs

PACKAGE = pathlib.Path(launch_server.__file__).parent
SERVER_ARGS_PY = PACKAGE / "runtime" / "server_args.py"

# Fields allowed to be unread while other work wires them (empty: every field is read today).
# Remove a name here as soon as it is read; the test below fails if an entry is read already (stale).
NOT_YET_WIRED: set[str] = set()


def _help_flags(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> set[str]:
    monkeypatch.setenv("COLUMNS", "10000")  # no line wrapping inside a flag name
    with pytest.raises(SystemExit) as exc:
        launch_server.main(["--help"])
    assert exc.value.code == 0
    text = capsys.readouterr().out
    flags = set(re.findall(r"(?<![\w-])--([a-z][a-z0-9-]*)", text))
    return {f for f in flags if f != "help" and not f.startswith("no-")}


def _is_args(node: ast.expr) -> bool:
    name = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else ""
    return name == "args" or name.endswith("_args") and name != "kwargs"


def _names_read() -> set[str]:
    """Attributes read off something called `args` / `*_args` (or via getattr with a constant name)."""
    read: set[str] = set()
    for path in PACKAGE.rglob("*.py"):
        if path == SERVER_ARGS_PY:
            continue
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Attribute) and _is_args(node.value):
                read.add(node.attr)
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr"
                  and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant)):
                read.add(str(node.args[1].value))
    return read


def test_help_lists_exactly_the_fields(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    fields = {f.name.replace("_", "-") for f in dataclasses.fields(ServerArgs)}
    assert _help_flags(capsys, monkeypatch) == fields


def test_every_field_is_read_outside_server_args() -> None:
    read = _names_read()
    unread = {f.name for f in dataclasses.fields(ServerArgs)} - read
    assert unread <= NOT_YET_WIRED, f"flags nobody reads (wire them or remove them): {sorted(unread - NOT_YET_WIRED)}"
    assert not NOT_YET_WIRED & read, f"now read, drop from NOT_YET_WIRED: {sorted(NOT_YET_WIRED & read)}"


def test_the_guard_sees_a_real_read() -> None:
    # the scanner must find reads the code is known to make, or the guard above would pass vacuously
    assert {"page_size", "dp_size", "api_key", "disable_radix_cache"} <= _names_read()


def test_removed_flag_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        launch_server.main(["--log-requests"])
    assert exc.value.code == 2
    assert "--log-requests" in capsys.readouterr().err


@pytest.mark.parametrize("page_size", [2, 16])
def test_page_size_other_than_one_is_refused(page_size: int) -> None:
    with pytest.raises(ValueError, match=f"page_size must be 1 .*got {page_size}"):
        ServerArgs(page_size=page_size)
    assert ServerArgs(page_size=1).page_size == 1
