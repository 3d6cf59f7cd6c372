"""Waiting on conditions in tests: generous deadlines, so a loaded machine makes a test slower, not red.

A suite run on a machine at load 6-12 takes several times as long as on an idle one; every wait a test
makes for a server, a thread or a process goes through here, with a deadline far above what an idle run
needs, and fails with what it was waiting for."""
from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

# seconds; an idle 2-core machine needs a few at most for any condition these tests wait on
GENEROUS = 180.0


def wait_until(condition: Callable[[], T], *, what: str, timeout: float = GENEROUS, interval: float = 0.05) -> T:
    """Poll ``condition`` until it returns something truthy and return that; fail naming ``what`` at the
    deadline."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"waited {timeout:.0f} s for {what}")
        time.sleep(interval)
