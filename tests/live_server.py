"""Start `python -m radixlang.launch_server` on 127.0.0.1 and a free port, wait for health, stop it by PID."""
from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def live_server(model_dir: str, *extra_args: str, timeout_s: float = 120) -> Iterator[str]:
    """Yield the server's base URL; SIGTERM (then SIGKILL after 20 s) on exit."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "radixlang.launch_server", "--model-path", model_dir,
                             "--load-format", "dummy", "--port", str(port), "--max-total-tokens", "4096",
                             "--log-level", "warning", *extra_args],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(proc.stderr.read().decode()[-2000:])
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.5)
        else:
            raise RuntimeError("server did not become healthy")
        yield url
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.kill(proc.pid, signal.SIGKILL)
