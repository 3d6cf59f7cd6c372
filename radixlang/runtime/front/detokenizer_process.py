"""The detokenizer process of the server: token ids from the schedulers -> text deltas for the front.

It receives ``BatchTokenIDOut`` from every scheduler replica on one PULL socket, turns
each into a ``BatchStrOut`` with the same DetokenizerManager the Engine uses, and
pushes it to the tokenizer manager. Control replies from the schedulers pass through
unchanged, in order with the outputs around them.
"""
from __future__ import annotations

import logging
import signal
from multiprocessing.connection import Connection

import orjson
import zmq

from radixlang.runtime.front.detokenizer import DetokenizerManager
from radixlang.runtime.io_struct import BatchTokenIDOut, decode, encode
from radixlang.runtime.ipc import (
    IpcNames, ParentWatch, exit_with_parent, ignore_stop_signals, pull_socket, push_socket, remove_private_dir,
)

logger = logging.getLogger(__name__)


def run_detokenizer_process(ipc_folder: str, log_level: str, setup: Connection) -> None:
    """Process entry: bind at once, then wait on ``setup`` for the tokenizer folder (orjson: {"tokenizer_path"}).

    The tokenizer's folder is known once a scheduler has loaded the model; binding first
    lets the schedulers connect meanwhile. Empty bytes (or a closed pipe) on ``setup`` mean: exit.
    """
    parent = exit_with_parent(ipc_folder, death_signal=signal.SIGTERM)  # its handler removes the folder
    ignore_stop_signals(parent, ipc_folder)
    logging.basicConfig(level=log_level.upper(), format="[%(asctime)s detokenizer %(name)s] %(message)s")
    ipc = IpcNames(ipc_folder)
    ctx = zmq.Context()
    recv, send = pull_socket(ctx, ipc.detokenizer), push_socket(ctx, ipc.tokenizer_manager)
    try:
        data = setup.recv_bytes()
    except EOFError:  # the launcher died before it knew the tokenizer
        data = b""
    setup.close()
    if not data:
        return
    from transformers import AutoTokenizer  # only now: one process fewer competes with the model load

    tokenizer = AutoTokenizer.from_pretrained(orjson.loads(data)["tokenizer_path"])
    try:
        _serve(DetokenizerManager(tokenizer), recv, send, parent)
    finally:
        ctx.destroy(linger=0)
    if not parent.parent_alive():  # the server was killed: nobody else will remove the sockets
        remove_private_dir(ipc_folder)


def _serve(manager: DetokenizerManager, recv: zmq.Socket, send: zmq.Socket, parent: ParentWatch) -> None:
    while True:
        if not recv.poll(1000):
            if not parent.parent_alive():
                logger.warning("the server process is gone; the detokenizer exits")
                return
            continue
        data = recv.recv()
        msg = decode(data)
        if isinstance(msg, BatchTokenIDOut):
            send.send(encode(manager.handle(msg)))
        else:
            send.send(data)  # a control reply for the tokenizer manager
