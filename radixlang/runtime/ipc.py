"""ZMQ plumbing between the server's processes: ipc:// sockets in a private folder, PUSH/PULL only.

Every receiving end binds its PULL socket and every sender connects a PUSH socket to it;
the socket files live in a folder of mode 0700 that the launcher creates and removes.
"""
from __future__ import annotations

import ctypes
import multiprocessing
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Any

import zmq


@dataclass(frozen=True)
class IpcNames:
    """The addresses of the server's sockets, all inside ``folder``."""
    folder: str

    def scheduler(self, replica: int) -> str:
        return f"ipc://{os.path.join(self.folder, f'scheduler-{replica}')}"

    @property
    def detokenizer(self) -> str:
        return f"ipc://{os.path.join(self.folder, 'detokenizer')}"

    @property
    def tokenizer_manager(self) -> str:
        return f"ipc://{os.path.join(self.folder, 'tokenizer-manager')}"


def make_private_dir() -> str:
    """A fresh folder only this user can enter (the sockets in it accept anyone who can)."""
    folder = tempfile.mkdtemp(prefix="radixlang-")
    os.chmod(folder, 0o700)
    return folder


def remove_private_dir(folder: str) -> None:
    shutil.rmtree(folder, ignore_errors=True)


def pull_socket(ctx: zmq.Context, address: str) -> zmq.Socket:
    sock = ctx.socket(zmq.PULL)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVHWM, 0)  # no limit: a message is never dropped or held back
    sock.bind(address)
    return sock


def push_socket(ctx: zmq.Context, address: str) -> zmq.Socket:
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 0)  # no limit: a send never blocks its loop
    sock.connect(address)
    return sock


_PR_SET_PDEATHSIG = 1  # linux/prctl.h
_WATCH_INTERVAL_S = 0.5


class ParentWatch:
    """Lets a child process notice that the process which started it is gone (killed, crashed).

    The parent is the one ``multiprocessing`` recorded when it spawned this process (so a parent that
    died before the child ran is still seen as gone); outside a multiprocessing child, the current one.
    """

    def __init__(self) -> None:
        parent = multiprocessing.parent_process()
        self.parent_pid = parent.pid if parent is not None and parent.pid is not None else os.getppid()

    def parent_alive(self) -> bool:
        return os.getppid() == self.parent_pid


def exit_with_parent(ipc_folder: str | None = None, *, death_signal: int = signal.SIGKILL) -> ParentWatch:
    """For a server child, first thing: it must not outlive the launcher, whatever it is busy with.

    The loops' own check runs between steps, and one step (a 2048-token prefill chunk of a large model on
    the CPU) ran for minutes while the orphan ignored its supervisor's SIGTERM. So on Linux the kernel
    sends ``death_signal`` the moment the launcher ends (PR_SET_PDEATHSIG): SIGKILL for a process that may
    be deep in a step (the scheduler), SIGTERM for one whose main thread is always ready to run the
    handler of ``ignore_stop_signals`` (the detokenizer: it removes ``ipc_folder``, which a killed
    launcher leaves behind). A watchdog thread polls the parent as well (the only watch elsewhere) and
    ends the process from any point of a step.
    """
    watch = ParentWatch()
    set_parent_death_signal(death_signal)
    if not watch.parent_alive():  # the launcher died before the death signal was armed
        _exit_orphan(ipc_folder)
    threading.Thread(target=_watch_parent, args=(watch, ipc_folder), name="radixlang-parent-watch",
                     daemon=True).start()
    return watch


def set_parent_death_signal(sig: int) -> bool:
    """Linux: have the kernel send ``sig`` to this process when the thread that started it exits. False elsewhere."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    except (OSError, AttributeError):  # no libc symbol to call: the watchdog thread still covers it
        return False


def _watch_parent(watch: ParentWatch, ipc_folder: str | None) -> None:
    while watch.parent_alive():
        time.sleep(_WATCH_INTERVAL_S)
    _exit_orphan(ipc_folder)


def _exit_orphan(ipc_folder: str | None) -> None:
    if ipc_folder is not None:
        remove_private_dir(ipc_folder)
    os._exit(0)  # from any thread, in the middle of a step: nothing of a child's needs a clean exit


def ignore_stop_signals(watch: ParentWatch | None = None, ipc_folder: str | None = None) -> None:
    """For a child: Ctrl-C or a SIGTERM sent to the whole process group is the server's to handle.

    The server drains, then kills its children. A SIGTERM that reaches a child whose server is gone
    (``watch`` says so) ends it: an orphan must not shrug off a supervisor's stop.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if watch is None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        return

    def on_term(sig: int, frame: Any) -> None:
        if not watch.parent_alive():
            _exit_orphan(ipc_folder)

    signal.signal(signal.SIGTERM, on_term)

