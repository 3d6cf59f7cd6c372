"""A live `python -m radixlang.launch_server` for tests: 127.0.0.1, a free port, stopped by PID.

A thin wrapper over the DSL's ``Runtime`` (which owns the launch, health wait and
SIGTERM-then-SIGKILL stop), with the tiny random-weight model's defaults.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from radixlang.lang.backends.runtime import Runtime


@contextlib.contextmanager
def live_runtime(model_dir: str, **server_args: Any) -> Iterator[Runtime]:
    """Yield the Runtime (``.url``, ``.pid``); ``server_args`` are ServerArgs fields overriding the test defaults."""
    args = {"load_format": "dummy", "max_total_tokens": 4096, "log_level": "warning", **server_args}
    with Runtime(model_path=model_dir, launch_timeout=300, **args) as runtime:
        yield runtime


@contextlib.contextmanager
def live_server(model_dir: str, **server_args: Any) -> Iterator[str]:
    """Yield the server's base URL (see live_runtime)."""
    with live_runtime(model_dir, **server_args) as runtime:
        yield runtime.url
