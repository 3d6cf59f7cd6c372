"""ZMQ plumbing between the server's processes: ipc:// sockets in a private folder, PUSH/PULL only.

Every receiving end binds its PULL socket and every sender connects a PUSH socket to it;
the socket files live in a folder of mode 0700 that the launcher creates and removes.
"""
from __future__ import annotations

import os
import shutil
import signal
import tempfile
from dataclasses import dataclass

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


def ignore_stop_signals() -> None:
    """For a child: Ctrl-C or a SIGTERM sent to the whole process group is the server's to handle.

    The server drains, then kills its children; a child whose server is gone exits by itself
    (see ParentWatch).
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


class ParentWatch:
    """Lets a child process notice that the process which started it is gone (killed, crashed)."""

    def __init__(self) -> None:
        self.parent_pid = os.getppid()

    def parent_alive(self) -> bool:
        return os.getppid() == self.parent_pid
