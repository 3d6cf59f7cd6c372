"""StreamExecutor: runs one program's expressions in order on a worker thread.

The program body (user code) submits nodes and keeps going; reading a variable
waits until the nodes that define it have run. An error in a node is kept in
``error_``; later nodes are skipped and every waiter wakes up with the error, so
nothing hangs. In ``synchronous`` mode (tracing) nodes run in the caller's
thread and exceptions propagate.
"""
from __future__ import annotations

import queue
import threading
from typing import Any, Iterator

from radixlang.lang import ir
from radixlang.lang.backends.base import Backend, GenParams
from radixlang.lang.chat_template import ChatTemplate

_END = object()


class StreamExecutor:
    def __init__(self, backend: Backend, chat_template: ChatTemplate, defaults: dict[str, Any], *,
                 stream: bool = False, synchronous: bool = False) -> None:
        self.backend = backend
        self.chat_template = chat_template
        self.defaults = defaults  # wire sampling names plus ir.LOGPROB_KEYS, from run()
        self.stream = stream
        self.synchronous = synchronous
        self.text_ = ""
        self.variables: dict[str, Any] = {}
        self.meta_info: dict[str, Any] = {}
        self.messages_: list[dict[str, str]] = []
        self.cur_role: str | None = None
        self.role_start = 0
        self.fork_start = 0
        self.error_: BaseException | None = None
        self.children: list[StreamExecutor] = []
        self._scopes: dict[str, int] = {}
        # (var or None, delta, appended to text?) ; var_end markers are (name, None, False)
        self.chunks: list[tuple[str | None, str | None, bool]] = []
        self.cond = threading.Condition()
        self._producers: dict[str, int] = {}  # submitted, not yet run, nodes defining each var
        self._pending = 0
        self._ended = False
        self.finished = False
        self._queue: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None

    # ---- body side ---------------------------------------------------------------------------
    def submit(self, node: ir.Expr) -> None:
        if self.synchronous:
            self._execute(node)
            return
        with self.cond:
            if self._ended:
                raise RuntimeError("the program has ended; its state takes no more expressions")
            self._pending += 1
            name = ir.produced_var(node)
            if name is not None:
                self._producers[name] = self._producers.get(name, 0) + 1
            if self._thread is None:
                self._thread = threading.Thread(target=self._worker, name="radixlang-program", daemon=True)
                self._thread.start()
        self._queue.put(node)

    def sync(self) -> None:
        with self.cond:
            self.cond.wait_for(lambda: self._pending == 0)

    def end(self) -> None:
        """No more nodes; the worker drains what is queued, then the program is finished."""
        with self.cond:
            if self._ended:
                return
            self._ended = True
            if self._thread is None:
                self.finished = True
                self.cond.notify_all()
        if self._thread is not None:
            self._queue.put(_END)
        for child in self.children:
            child.end()

    def set_error(self, error: BaseException) -> None:
        with self.cond:
            if self.error_ is None:
                self.error_ = error
            self.cond.notify_all()

    def get_var(self, name: str) -> Any:
        with self.cond:
            while True:
                if self._producers.get(name, 0) == 0 and name in self.variables:
                    return self.variables[name]
                if self.error_ is not None:
                    raise self.error_
                if self._producers.get(name, 0) == 0:
                    raise KeyError(f"variable {name!r} is not set and nothing pending sets it; "
                                   f"set variables: {sorted(self.variables)}")
                self.cond.wait()

    def fork(self, size: int) -> list[StreamExecutor]:
        if not isinstance(size, int) or size < 1:
            raise ValueError(f"fork size must be an int >= 1, got {size!r}")
        if size > 1:
            self.submit(ir.CachePrefix())
        self.sync()
        children = []
        for _ in range(size):
            ex = StreamExecutor(self.backend, self.chat_template, self.defaults, stream=self.stream,
                                synchronous=self.synchronous)
            ex.text_, ex.variables, ex.meta_info = self.text_, dict(self.variables), dict(self.meta_info)
            ex.messages_, ex.cur_role, ex.role_start = list(self.messages_), self.cur_role, self.role_start
            ex.fork_start, ex.error_ = len(self.text_), self.error_
            children.append(ex)
        self.children.extend(children)
        return children

    def iter_chunks(self, var: str | None) -> Iterator[str]:
        """Deltas of the whole text (var None) or of one variable, as they are produced."""
        i = 0
        while True:
            with self.cond:
                self.cond.wait_for(lambda: i < len(self.chunks) or self.finished or self.error_ is not None)
                new = self.chunks[i:]
                i = len(self.chunks)
                done = self.finished or self.error_ is not None
            for name, delta, appended in new:
                if var is None and appended and delta:
                    yield delta
                elif var is not None and name == var:
                    if delta is None:
                        return
                    if delta:
                        yield delta
            if done and not new:
                return

    # ---- worker side -------------------------------------------------------------------------
    def _worker(self) -> None:
        while True:
            node = self._queue.get()
            if node is _END:
                with self.cond:
                    self.finished = True
                    self.cond.notify_all()
                return
            try:
                if self.error_ is None:
                    self._execute(node)
            except BaseException as e:  # kept for state.error() and every waiter
                self.set_error(e)
            finally:
                with self.cond:
                    self._pending -= 1
                    name = ir.produced_var(node)
                    if name is not None:
                        self._producers[name] -= 1
                    self.cond.notify_all()

    def _append(self, delta: str, var: str | None = None) -> None:
        with self.cond:
            self.text_ += delta
            self.chunks.append((var, delta, True))
            self.cond.notify_all()

    def _set_var(self, name: str, value: Any, meta: Any = None, *, emit: bool = False) -> None:
        with self.cond:
            self.variables[name] = value
            if meta is not None:
                self.meta_info[name] = meta
            if emit:
                self.chunks.append((name, str(value), False))
            self.chunks.append((name, None, False))
            self.cond.notify_all()

    def _execute(self, node: ir.Expr) -> None:
        match node:
            case ir.Text(text=text):
                self._append(text)
            case ir.ExprList(exprs=exprs):
                for e in exprs:
                    self._execute(e)
            case ir.Gen():
                self._execute_gen(node)
            case ir.Select():
                decision = self.backend.select(self.text_, node.choices, node.temperature, node.choices_method)
                self._append(decision.decision, node.name)
                if node.name is not None:
                    self._set_var(node.name, decision.decision, decision.meta_info)
            case ir.RoleBegin(role=role):
                self._role_begin(role)
            case ir.RoleEnd(role=role):
                self._role_end(role)
            case ir.VarScopeBegin(name=name):
                self._scopes[name] = len(self.text_)
            case ir.VarScopeEnd(name=name):
                if name not in self._scopes:
                    raise ValueError(f"var_scope({name!r}) ended without a beginning")
                self._set_var(name, self.text_[self._scopes.pop(name):], emit=True)
            case ir.SetVar(name=name, value=value):
                self._set_var(name, value, emit=True)
            case ir.SeparateReasoning():
                self._separate_reasoning(node)
            case ir.CachePrefix():
                if self.text_:
                    self.backend.cache_prefix(self.text_)
            case _:
                raise TypeError(f"expected a DSL expression, got {type(node).__name__}")

    def _separate_reasoning(self, node: ir.SeparateReasoning) -> None:
        value = self.variables.get(node.name)
        if not isinstance(value, str):
            raise ValueError(f"separate_reasoning: variable {node.name!r} holds no generated text")
        reasoning, answer = ir.split_reasoning(value, node.model_type)
        with self.cond:
            if self.text_.endswith(value):  # the text keeps the answer only, as SGLang's does
                self.text_ = self.text_[:len(self.text_) - len(value)] + answer
        self._set_var(node.name, answer, self.meta_info.get(node.name))
        self._set_var(node.reasoning_name, reasoning)

    def _execute_gen(self, node: ir.Gen) -> None:
        params = self.resolve(node)
        opens_turn = self.cur_role == "assistant" and self.role_start == len(self.text_)
        messages = list(self.messages_) if opens_turn else None
        if self.stream:
            parts: list[str] = []
            meta: dict[str, Any] = {}
            for delta, meta in self.backend.generate_stream(self.text_, params, messages=messages):
                parts.append(delta)
                self._append(delta, node.name)
            text = "".join(parts)
        else:
            text, meta = self.backend.generate(self.text_, params, messages=messages)
            self._append(text, node.name)
        if node.name is not None:
            self._set_var(node.name, text, meta)

    def resolve(self, node: ir.Gen) -> GenParams:
        """run() defaults, overridden by what gen() set, plus the chat template's stop strings."""
        merged = {**self.defaults, **node.sampling, **node.logprob}
        logprob = {k: merged.pop(k) for k in ir.LOGPROB_KEYS if k in merged}
        sampling = {k: v for k, v in merged.items() if v is not None}
        stop = sampling.get("stop")
        stop = [stop] if isinstance(stop, str) else list(stop or [])
        stop += [s for s in self.chat_template.stop_str if s not in stop]
        if stop:
            sampling["stop"] = stop
        if sampling.get("n", 1) != 1:
            raise ValueError(f"gen(n=...) must be 1 (use s.fork(n) for several samples), got {sampling['n']}")
        sampling.pop("n", None)
        return GenParams(sampling_params=sampling, return_logprob=bool(logprob.get("return_logprob")),
                         logprob_start_len=logprob.get("logprob_start_len"),
                         top_logprobs_num=int(logprob.get("top_logprobs_num") or 0),
                         return_text_in_logprobs=bool(logprob.get("return_text_in_logprobs")))

    def _role_begin(self, role: str) -> None:
        if self.cur_role is not None:
            raise ValueError(f"roles do not nest: {role!r} began inside {self.cur_role!r}")
        if not self.messages_ and role != "system" and self.chat_template.default_system_prompt:
            self._role_begin("system")
            self._append(self.chat_template.default_system_prompt)
            self._role_end("system")
        prefix, _ = self.chat_template.get_prefix_and_suffix(role, self.messages_)
        self._append(prefix)
        self.cur_role, self.role_start = role, len(self.text_)

    def _role_end(self, role: str) -> None:
        if self.cur_role != role:
            raise ValueError(f"expected the end of role {self.cur_role!r}, got the end of {role!r}")
        content = self.text_[self.role_start:]
        _, suffix = self.chat_template.get_prefix_and_suffix(role, self.messages_)
        self._append(suffix)
        self.messages_.append({"role": role, "content": content})
        self.cur_role = None
