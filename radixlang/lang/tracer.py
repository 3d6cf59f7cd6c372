"""Trace a program's constant prefix: the text it emits before anything depends on arguments or the model.

The body runs synchronously against a backend that stops at the first model
call, with placeholders for every unbound argument that stop at first use.
Tracing is best-effort: any exception ends the trace, and what was emitted
before it is the prefix.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from radixlang.lang.backends.base import Backend
from radixlang.lang.chat_template import ChatTemplate
from radixlang.lang.interpreter import StreamExecutor
from radixlang.lang.state import ProgramState


class StopTracing(Exception):
    pass


class _TracingBackend(Backend):
    def __init__(self, template: ChatTemplate) -> None:
        self._template = template

    def generate(self, state_text, sampling, *, messages=None):
        raise StopTracing("gen")

    def generate_stream(self, state_text, sampling, *, messages=None):
        raise StopTracing("gen")

    def select(self, state_text, choices, temperature, choices_method):
        raise StopTracing("select")

    def cache_prefix(self, prefix_text: str) -> None:
        raise StopTracing("fork")

    @property
    def chat_template(self) -> ChatTemplate:
        return self._template


class ArgPlaceholder:
    """Stands for an argument during tracing; any use of it ends the trace."""

    def __init__(self, name: str) -> None:
        object.__setattr__(self, "_name", name)

    def _stop(self, *args: Any, **kwargs: Any) -> Any:
        raise StopTracing(f"argument {object.__getattribute__(self, '_name')}")

    __str__ = __format__ = __add__ = __radd__ = __getitem__ = __iter__ = __len__ = __bool__ = _stop
    __eq__ = __lt__ = __gt__ = __call__ = __int__ = __float__ = __contains__ = _stop
    __hash__ = None  # type: ignore[assignment]

    def __getattr__(self, item: str) -> Any:
        return self._stop()

    def __repr__(self) -> str:
        return self._stop()


@dataclass
class TraceResult:
    prefix: str  # the constant text every run starts with
    messages: list[dict[str, str]] = field(default_factory=list)
    stopped_at: str = "end"  # what ended the trace: "gen", "select", "fork", "argument NAME", an error, or "end"


def trace_program(func: Any, arg_names: list[str], bound: dict[str, Any], chat_template: ChatTemplate,
                  defaults: dict[str, Any]) -> TraceResult:
    ex = StreamExecutor(_TracingBackend(chat_template), chat_template, defaults, synchronous=True)
    state = ProgramState(ex)
    kwargs = {name: bound.get(name, ArgPlaceholder(name)) for name in arg_names}
    stopped = "end"
    try:
        func(state, **kwargs)
    except StopTracing as e:
        stopped = str(e)
    except Exception as e:  # a placeholder used in a way we cannot see (len(), arithmetic ...)
        stopped = f"{type(e).__name__}: {e}"
    return TraceResult(prefix=ex.text_, messages=list(ex.messages_), stopped_at=stopped)
