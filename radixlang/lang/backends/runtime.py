"""Runtime: launch `python -m radixlang.launch_server` in a child process and use it as a backend."""
from __future__ import annotations

import atexit
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any, Iterator, Sequence

from radixlang.lang.backends.base import Backend, GenParams
from radixlang.lang.backends.runtime_endpoint import RuntimeEndpoint
from radixlang.lang.chat_template import ChatTemplate
from radixlang.lang.choices import ChoicesDecision, ChoicesSamplingMethod


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def server_args_to_cli(server_args: dict[str, Any]) -> list[str]:
    """ServerArgs fields -> flags: underscores become dashes, booleans become --flag / --no-flag."""
    argv: list[str] = []
    for key, value in server_args.items():
        if value is None:
            continue
        flag = "--" + key.replace("_", "-")
        if isinstance(value, bool):
            argv.append(flag if value else "--no-" + key.replace("_", "-"))
        else:
            argv += [flag, str(value)]
    return argv


class Runtime(Backend):
    """``Runtime(model_path=..., **server_args)``: a server on 127.0.0.1 and a free port, stopped by PID."""

    def __init__(self, *, launch_timeout: float = 300.0, **server_args: Any) -> None:
        server_args.setdefault("host", "127.0.0.1")
        server_args.setdefault("port", free_port(server_args["host"]))
        self.url = f"http://{server_args['host']}:{server_args['port']}"
        self._log = tempfile.TemporaryFile()  # a file, not a pipe: a chatty child cannot block on it
        cmd = [sys.executable, "-m", "radixlang.launch_server", *server_args_to_cli(server_args)]
        self._proc: subprocess.Popen | None = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=self._log)
        atexit.register(self.shutdown)
        try:
            self._wait_healthy(launch_timeout)
        except BaseException:
            self.shutdown()
            raise
        self.endpoint = RuntimeEndpoint(self.url, api_key=server_args.get("api_key"))

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    def _stderr_tail(self, limit: int = 4000) -> str:
        self._log.seek(0)
        return self._log.read().decode(errors="replace")[-limit:]

    def _wait_healthy(self, timeout: float) -> None:
        import httpx
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._proc is None:
                raise RuntimeError("no server process to wait for")
            if self._proc.poll() is not None:
                raise RuntimeError(f"the server exited with code {self._proc.returncode} before becoming "
                                   f"healthy; its stderr:\n{self._stderr_tail()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"the server at {self.url} was not healthy after {timeout}s; its stderr:\n"
                           f"{self._stderr_tail()}")

    def shutdown(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        atexit.unregister(self.shutdown)
        if getattr(self, "endpoint", None) is not None:
            self.endpoint.shutdown()
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
        self._log.close()

    def __enter__(self) -> Runtime:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    # ---- Backend: delegate to the endpoint ---------------------------------------------------
    def generate(self, state_text: str, sampling: GenParams, *, messages=None) -> tuple[str, dict[str, Any]]:
        return self.endpoint.generate(state_text, sampling, messages=messages)

    def generate_stream(self, state_text: str, sampling: GenParams, *, messages=None
                        ) -> Iterator[tuple[str, dict[str, Any]]]:
        return self.endpoint.generate_stream(state_text, sampling, messages=messages)

    def select(self, state_text: str, choices: Sequence[str], temperature: float,
               choices_method: ChoicesSamplingMethod) -> ChoicesDecision:
        return self.endpoint.select(state_text, choices, temperature, choices_method)

    def cache_prefix(self, prefix_text: str) -> None:
        self.endpoint.cache_prefix(prefix_text)

    @property
    def chat_template(self) -> ChatTemplate:
        return self.endpoint.chat_template

    def get_server_info(self) -> dict[str, Any]:
        return self.endpoint.get_server_info()

    def flush_cache(self) -> bool:
        return self.endpoint.flush_cache()
