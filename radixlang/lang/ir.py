"""Expression nodes of the DSL: what `s += ...` submits to a program's executor.

Nodes are plain data; the interpreter (interpreter.py) gives them meaning. `+`
between nodes (or a node and a str) builds an ExprList, flattened on creation.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterator

if TYPE_CHECKING:
    from radixlang.lang.choices import ChoicesSamplingMethod

# dtype -> regex, as SGLang maps them
REGEX_INT = r"[-+]?[0-9]+[ \n]*"
REGEX_FLOAT = r"[-+]?[0-9]*\.?[0-9]+[ \n]*"
REGEX_BOOL = r"(True|False)"
REGEX_STR = r"\"[\w\d\s]*\""
DTYPE_REGEX = {"int": REGEX_INT, "float": REGEX_FLOAT, "bool": REGEX_BOOL, "str": REGEX_STR}

# gen() keyword -> /generate "sampling_params" key (the wire names of runtime SamplingParams)
GEN_TO_WIRE = {
    "max_tokens": "max_new_tokens", "min_tokens": "min_new_tokens", "n": "n", "stop": "stop",
    "stop_token_ids": "stop_token_ids", "temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
    "min_p": "min_p", "frequency_penalty": "frequency_penalty", "presence_penalty": "presence_penalty",
    "ignore_eos": "ignore_eos", "regex": "regex", "json_schema": "json_schema",
}
# request-level options that travel beside sampling_params
LOGPROB_KEYS = ("return_logprob", "logprob_start_len", "top_logprobs_num", "return_text_in_logprobs")


class Expr:
    """Base of every DSL node. `a + b` concatenates."""

    def __add__(self, other: Any) -> ExprList:
        return ExprList([self, to_expr(other)])

    def __radd__(self, other: Any) -> ExprList:
        return ExprList([to_expr(other), self])


@dataclass(eq=False)
class Text(Expr):
    text: str


@dataclass(eq=False)
class ExprList(Expr):
    exprs: list[Expr]

    def __post_init__(self) -> None:
        flat: list[Expr] = []
        for e in self.exprs:
            flat.extend(e.exprs if isinstance(e, ExprList) else [e])
        self.exprs = flat


@dataclass(eq=False)
class Gen(Expr):
    name: str | None
    sampling: dict[str, Any] = field(default_factory=dict)  # wire names, only what gen() set
    logprob: dict[str, Any] = field(default_factory=dict)  # LOGPROB_KEYS that gen() set


@dataclass(eq=False)
class Select(Expr):
    name: str | None
    choices: list[str]
    temperature: float
    choices_method: ChoicesSamplingMethod


@dataclass(eq=False)
class RoleBegin(Expr):
    role: str


@dataclass(eq=False)
class RoleEnd(Expr):
    role: str


@dataclass(eq=False)
class VarScopeBegin(Expr):
    name: str


@dataclass(eq=False)
class VarScopeEnd(Expr):
    name: str


@dataclass(eq=False)
class SetVar(Expr):
    """Set a variable in program order (used by fork joins)."""
    name: str
    value: Any


@dataclass(eq=False)
class CachePrefix(Expr):
    """Send the current text as a prefill-only request so later branches reuse its KV."""


@dataclass(eq=False)
class SubProgram(Expr):
    """A @function called with arguments inside another program; it runs inline on the caller's state."""
    func: Any  # program.Function (not imported: program.py imports this module)
    args: tuple
    kwargs: dict[str, Any]


@dataclass(eq=False)
class SeparateReasoning(Expr):
    """Split variable ``name`` (a gen's output) into its answer and ``<name>_reasoning_content``."""
    name: str
    model_type: str

    @property
    def reasoning_name(self) -> str:
        return f"{self.name}_reasoning_content"


def to_expr(value: Any) -> Expr:
    if isinstance(value, Expr):
        return value
    if isinstance(value, str):
        return Text(value)
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return Text(str(value))
    raise TypeError(f"expected a str, a number or a DSL expression (gen, select, role ...), "
                    f"got {type(value).__name__}")


def flatten(expr: Expr) -> Iterator[Expr]:
    yield from (expr.exprs if isinstance(expr, ExprList) else [expr])


def produced_var(expr: Expr) -> str | None:
    """The variable a node defines when executed, if any."""
    if isinstance(expr, (Gen, Select)):
        return expr.name
    if isinstance(expr, (VarScopeEnd, SetVar)):
        return expr.name
    if isinstance(expr, SeparateReasoning):
        return expr.reasoning_name
    return None


def regex_for_dtype(dtype: Any) -> str:
    key = dtype.__name__ if isinstance(dtype, type) else dtype
    if key not in DTYPE_REGEX:
        raise ValueError(f"dtype must be one of int, float, str, bool (or their names), got {dtype!r}")
    return DTYPE_REGEX[key]


THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
REASONING_MODEL_TYPES = ("deepseek-r1", "qwen3")


def split_reasoning(text: str, model_type: str) -> tuple[str, str]:
    """(reasoning, answer) of a reply with ``<think>...</think>`` reasoning, as the server's reasoning parsers
    split it: deepseek-r1 replies start inside the reasoning (its template opens <think>), qwen3 replies only
    reason when they start with <think>."""
    body = text.lstrip()
    if body.startswith(THINK_OPEN):
        body = body[len(THINK_OPEN):]
    elif model_type == "qwen3":
        return "", text
    else:
        body = text
    head, sep, tail = body.partition(THINK_CLOSE)
    return (head, tail.lstrip("\n")) if sep else (body, "")
