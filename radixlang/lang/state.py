"""ProgramState (what a program body sees as `s`) and the group a fork returns."""
from __future__ import annotations

import asyncio
import contextlib
from typing import Any, AsyncIterator, Iterator

from radixlang.lang import ir
from radixlang.lang.interpreter import StreamExecutor


class ProgramState:
    """`s += expr` submits; `s["var"]` waits for the variable; text/messages sync first."""

    def __init__(self, executor: StreamExecutor) -> None:
        self.stream_executor = executor
        self.ret_value: Any = None

    # ---- building ----------------------------------------------------------------------------
    def __iadd__(self, other: Any) -> ProgramState:
        for node in ir.flatten(ir.to_expr(other)):
            if isinstance(node, ir.SubProgram):
                node.func.run_inline(self, *node.args, **node.kwargs)
            else:
                self.stream_executor.submit(node)
        return self

    def _role(self, role: str, expr: Any) -> contextlib.AbstractContextManager | None:
        if expr is not None:
            self += ir.RoleBegin(role) + ir.to_expr(expr) + ir.RoleEnd(role)
            return None
        return self._role_scope(role)

    @contextlib.contextmanager
    def _role_scope(self, role: str) -> Iterator[None]:
        self += ir.RoleBegin(role)
        yield
        self += ir.RoleEnd(role)

    def system(self, expr: Any = None) -> Any:
        return self._role("system", expr)

    def user(self, expr: Any = None) -> Any:
        return self._role("user", expr)

    def assistant(self, expr: Any = None) -> Any:
        return self._role("assistant", expr)

    @contextlib.contextmanager
    def var_scope(self, name: str) -> Iterator[None]:
        self += ir.VarScopeBegin(name)
        yield
        self += ir.VarScopeEnd(name)

    def set_var(self, name: str, value: Any) -> None:
        self += ir.SetVar(name, value)

    def fork(self, size: int = 1) -> ProgramStateGroup:
        """Branches that share this state's text so far; the prefix is prefilled once when size > 1."""
        return ProgramStateGroup([ProgramState(ex) for ex in self.stream_executor.fork(size)], self)

    # ---- reading -----------------------------------------------------------------------------
    def __getitem__(self, name: str) -> Any:
        return self.stream_executor.get_var(name)

    def get_var(self, name: str) -> Any:
        return self.stream_executor.get_var(name)

    def get_meta_info(self, name: str) -> Any:
        self.stream_executor.get_var(name)
        return self.stream_executor.meta_info.get(name)

    def text(self) -> str:
        self.sync()
        return self.stream_executor.text_

    def messages(self) -> list[dict[str, str]]:
        self.sync()
        return list(self.stream_executor.messages_)

    def sync(self) -> ProgramState:
        self.stream_executor.sync()
        return self

    def wait(self) -> ProgramState:
        """Wait until the whole program (not just what is submitted so far) has finished."""
        ex = self.stream_executor
        with ex.cond:
            ex.cond.wait_for(lambda: ex.finished)
        return self

    def error(self) -> BaseException | None:
        return self.stream_executor.error_

    def text_iter(self, var_name: str | None = None) -> Iterator[str]:
        """Deltas of the text (or of one variable) as they come; they join to the final value."""
        return self.stream_executor.iter_chunks(var_name)

    async def text_async_iter(self, var_name: str | None = None, return_meta_data: bool = False
                              ) -> AsyncIterator[Any]:
        it = self.text_iter(var_name)
        sentinel = object()
        while True:
            delta = await asyncio.to_thread(next, it, sentinel)
            if delta is sentinel:
                break
            yield (delta, {}) if return_meta_data else delta

    def __contains__(self, name: str) -> bool:
        self.sync()
        return name in self.stream_executor.variables

    def __repr__(self) -> str:
        return f"ProgramState({self.text()!r})"


class ProgramStateGroup:
    """The branches of a fork: `+=` applies to every branch; join() gathers their variables."""

    def __init__(self, states: list[ProgramState], parent: ProgramState) -> None:
        self.states = states
        self.parent = parent

    def __len__(self) -> int:
        return len(self.states)

    def __iter__(self) -> Iterator[ProgramState]:
        return iter(self.states)

    def __getitem__(self, i: int) -> ProgramState:
        return self.states[i]

    def __setitem__(self, i: int, value: ProgramState) -> None:
        if value is not self.states[i]:
            raise ValueError("a fork's branches cannot be replaced; use forks[i] += expr")

    def __iadd__(self, other: Any) -> ProgramStateGroup:
        if isinstance(other, (list, tuple)):
            if len(other) != len(self.states):
                raise ValueError(f"expected one expression per branch ({len(self.states)}), got {len(other)}")
            for state, expr in zip(self.states, other):
                state += expr
        elif callable(other) and not isinstance(other, ir.Expr):
            for i, state in enumerate(self.states):
                state += other(i)
        else:
            for state in self.states:
                state += other
        return self

    def join(self, mode: str = "gather_variable") -> None:
        """gather_variable: parent[v] = [branch values] for every variable the branches set;
        concate_join: the branches' new text is appended to the parent in order."""
        if mode not in ("gather_variable", "concate_join"):
            raise ValueError(f"join mode must be gather_variable or concate_join, got {mode!r}")
        for s in self.states:
            s.sync()
        errors = [e for e in (s.error() for s in self.states) if e is not None]
        before = self.parent.stream_executor.variables
        if mode == "gather_variable":
            names: list[str] = []
            for s in self.states:
                for k, v in s.stream_executor.variables.items():
                    if k not in names and (k not in before or before[k] is not v):
                        names.append(k)
            for k in names:
                self.parent += ir.SetVar(k, [s.stream_executor.variables.get(k) for s in self.states])
        else:
            for s in self.states:
                ex = s.stream_executor
                self.parent += ex.text_[ex.fork_start:]
        for s in self.states:
            s.stream_executor.end()
        if errors:
            self.parent.stream_executor.set_error(errors[0])
