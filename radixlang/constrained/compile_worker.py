"""The grammar compile worker: a child process that checks and compiles one grammar at a time.

compile_pool.CompileWorkers starts it (``main``, given the parent's pid and import path) and
kills it when a compile outlasts the timeout: a library compile (outlines-core, xgrammar,
llguidance) runs in native code that no thread can interrupt, and the JSON-Schema keyword check
is Python that would hold the GIL. Killing the process frees the CPU and cannot stall the server.
The worker imports no torch for outlines and llguidance (xgrammar imports it itself), so it
starts in a fraction of a second.

Frames, both ways: an 8-byte big-endian length, then a pickle (parent and child are one program;
nothing else writes these pipes). The parent sends a ``WorkerConfig``, the worker answers
``("ready",)``; then per compile the parent sends ``(kind, spec)`` and the worker answers
``("ok", payload)`` or ``("error", message, param, is_value_error)``. Payloads, which the parent
turns back into a compiled grammar: outlines ``(regex, Index)``; xgrammar
``CompiledGrammar.serialize_json()``; llguidance the validated grammar text.
"""

from __future__ import annotations

import ctypes
import json
import os
import pickle
import signal
import struct
import sys
from dataclasses import dataclass
from typing import Any

from radixlang.constrained.json_regex import ascii_digits, json_schema_to_regex
from radixlang.constrained.schema_policy import load_schema, prepare_schema
from radixlang.constrained.structural_tag import forced_tag_regex, parse_structural_tag
from radixlang.constrained.tokenizer_info import TokenizerInfo

_HEADER = struct.Struct(">Q")


@dataclass(frozen=True)
class WorkerConfig:
    """What a worker compiles for: one backend, one tokenizer, the compiler's options."""

    backend: str
    tokenizer_info: TokenizerInfo
    whitespace_pattern: str | None = None
    max_states: int = 200_000
    any_json_depth: int = 2


def write_frame(fd: int, obj: Any) -> None:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    view = memoryview(_HEADER.pack(len(data)) + data)
    while view:
        view = view[os.write(fd, view):]


def read_frame(fd: int) -> Any:
    """The next frame's object; EOFError when the other side closed (or died) first."""
    size = _HEADER.unpack(_read_exact(fd, _HEADER.size))[0]
    return pickle.loads(_read_exact(fd, size))


def _read_exact(fd: int, size: int) -> bytes:
    chunks, left = [], size
    while left:
        chunk = os.read(fd, min(left, 1 << 20))
        if not chunk:
            raise EOFError("the other end of the grammar worker pipe closed")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


class GrammarBuilder:
    """(kind, spec) -> the payload of one backend (runs in the worker; the parent checked kind and type)."""

    def __init__(self, config: WorkerConfig) -> None:
        self.config = config
        self._library: Any = None  # xgrammar's backend or llguidance's compiler
        self._vocabulary: Any = None  # outlines-core's Vocabulary

    def warm(self) -> None:
        """Build the tokenizer tables now, so that no compile's time limit pays for them."""
        if self.config.backend == "outlines":
            self._outlines_vocabulary()
        else:
            self._backend_object()

    def build(self, kind: str, spec: Any) -> Any:
        backend = self.config.backend
        schema = load_schema(spec, backend) if kind == "json" and spec is not None else None
        if kind == "regex":  # \d is ASCII 0-9 on every backend (the Rust regex engines read any Unicode digit)
            spec = ascii_digits(spec)
        if backend == "xgrammar":
            return self._backend_object().build(kind, spec, schema).handle.serialize_json()
        if backend == "llguidance":
            compiler = self._backend_object()
            grammar = compiler.grammar(kind, spec, schema)
            compiler.matcher(grammar)  # the parent builds one too: what takes too long must fail here
            return grammar
        return self._outlines(kind, spec, schema)

    def _backend_object(self) -> Any:
        if self._library is None:
            c = self.config
            if c.backend == "xgrammar":
                from radixlang.constrained.xgrammar_backend import XGrammarBackend
                self._library = XGrammarBackend(c.tokenizer_info, whitespace_pattern=c.whitespace_pattern)
            else:
                from radixlang.constrained.llguidance_compile import LLGuidanceCompiler
                self._library = LLGuidanceCompiler(c.tokenizer_info, whitespace_pattern=c.whitespace_pattern)
        return self._library

    def _outlines(self, kind: str, spec: Any, schema: Any) -> tuple[str, Any]:
        from outlines_core import Index

        c = self.config
        if kind == "regex":
            regex = spec
        elif kind == "structural_tag":  # a forced tag (the only kind the parent lets through here)
            tag = parse_structural_tag(spec)
            bodies = [json_schema_to_regex(json.dumps(prepare_schema(s.schema, c.backend, "structural_tag")),
                                           whitespace_pattern=c.whitespace_pattern, any_depth=c.any_json_depth)
                      for s in tag.structures]
            answer = (None if tag.answer_schema is None else json_schema_to_regex(
                json.dumps(prepare_schema(tag.answer_schema, c.backend, "structural_tag")),
                whitespace_pattern=c.whitespace_pattern, any_depth=c.any_json_depth))
            regex = forced_tag_regex(tag, bodies, answer)
        else:
            regex = json_schema_to_regex(None if schema is None else json.dumps(schema),
                                         whitespace_pattern=c.whitespace_pattern, any_depth=c.any_json_depth)
        try:
            index = Index(regex, self._outlines_vocabulary())
        except (ValueError, TypeError) as e:
            raise ValueError(f"invalid {kind} grammar: {str(e).strip()[:200]} (pattern: {regex[:80]!r})") from None
        if c.max_states:
            num_states = len(index.get_transitions())
            if num_states > c.max_states:
                raise ValueError(f"grammar has {num_states} states, more than max_states={c.max_states}")
        return regex, index

    def _outlines_vocabulary(self) -> Any:
        """The outlines-core Vocabulary of the tokenizer (built once, never from the hub)."""
        if self._vocabulary is None:
            from outlines_core import Vocabulary

            info = self.config.tokenizer_info
            by_bytes: dict[bytes, list[int]] = {}
            for token_id, data in enumerate(info.token_bytes):
                if data:
                    by_bytes.setdefault(data, []).append(token_id)
            self._vocabulary = Vocabulary(info.eos_token_ids[0], by_bytes)
        return self._vocabulary


def _die_with(parent_pid: int) -> None:
    """Exit when the parent does, even in the middle of a compile (Linux; elsewhere the pipe's EOF does)."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass
    if os.getppid() != parent_pid:  # the parent was gone before prctl took effect
        os._exit(0)


def main() -> None:
    """The worker's loop; argv[1] is the parent's pid (compile_pool starts it)."""
    _die_with(int(sys.argv[1]))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C in a terminal is the parent's to handle
    proto_in, proto_out = sys.stdin.fileno(), os.dup(sys.stdout.fileno())
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # a library's print must not land in a frame
    try:
        builder = GrammarBuilder(read_frame(proto_in))
        builder.warm()
        write_frame(proto_out, ("ready",))
        while True:
            kind, spec = read_frame(proto_in)
            try:
                reply: tuple[Any, ...] = ("ok", builder.build(kind, spec))
            except ValueError as e:
                reply = ("error", str(e), getattr(e, "param", None), True)
            except Exception as e:  # noqa: BLE001 -- a library bug fails this grammar, not the worker
                reply = ("error", f"{type(e).__name__}: {e}", None, False)
            write_frame(proto_out, reply)
    except EOFError:  # the parent closed the pipe: shut down
        pass
