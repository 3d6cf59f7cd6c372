"""The DSL primitives: gen, select, roles, and the default-backend helpers."""
from __future__ import annotations

from typing import Any, Sequence

from radixlang.lang import ir
from radixlang.lang.backends.base import Backend
from radixlang.lang.choices import ChoicesSamplingMethod, token_length_normalized
from radixlang.lang.context import DEFAULT_CONTEXT
from radixlang.lang.program import Function, function

__all__ = ["function", "Function", "gen", "gen_int", "gen_string", "select", "system", "user", "assistant",
           "system_begin", "system_end", "user_begin", "user_end", "assistant_begin", "assistant_end",
           "set_default_backend", "get_default_backend", "flush_cache", "get_server_info"]


def gen(name: str | None = None, max_tokens: int | None = None, min_tokens: int | None = None,
        n: int | None = None, stop: str | list[str] | None = None, stop_token_ids: list[int] | None = None,
        temperature: float | None = None, top_p: float | None = None, top_k: int | None = None,
        min_p: float | None = None, frequency_penalty: float | None = None, presence_penalty: float | None = None,
        ignore_eos: bool | None = None, return_logprob: bool | None = None, logprob_start_len: int | None = None,
        top_logprobs_num: int | None = None, return_text_in_logprobs: bool | None = None, dtype: Any = None,
        choices: Sequence[str] | None = None, choices_method: ChoicesSamplingMethod | None = None,
        regex: str | None = None, json_schema: str | dict | None = None) -> ir.Expr:
    """Generate into variable ``name``; unset options inherit from run(). ``choices`` makes it a select."""
    if choices is not None:
        return select(name, choices, temperature=0.0 if temperature is None else temperature,
                      choices_method=choices_method or token_length_normalized)
    given = dict(max_tokens=max_tokens, min_tokens=min_tokens, n=n, stop=stop, stop_token_ids=stop_token_ids,
                 temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p,
                 frequency_penalty=frequency_penalty, presence_penalty=presence_penalty, ignore_eos=ignore_eos,
                 regex=regex, json_schema=json_schema)
    if dtype is not None:
        if regex is not None or json_schema is not None:
            raise ValueError("give at most one of dtype, regex, json_schema")
        given["regex"] = ir.regex_for_dtype(dtype)
    if regex is not None and json_schema is not None:
        raise ValueError("give at most one of regex, json_schema")
    if isinstance(json_schema, dict):
        import json
        given["json_schema"] = json.dumps(json_schema)
    sampling = {ir.GEN_TO_WIRE[k]: v for k, v in given.items() if v is not None}
    logprob = {k: v for k, v in dict(return_logprob=return_logprob, logprob_start_len=logprob_start_len,
                                     top_logprobs_num=top_logprobs_num,
                                     return_text_in_logprobs=return_text_in_logprobs).items() if v is not None}
    return ir.Gen(name, sampling, logprob)


def gen_int(name: str | None = None, **kwargs: Any) -> ir.Expr:
    return gen(name, dtype=int, **kwargs)


def gen_string(name: str | None = None, **kwargs: Any) -> ir.Expr:
    return gen(name, dtype=str, **kwargs)


def select(name: str | None = None, choices: Sequence[str] | None = None, temperature: float = 0.0,
           choices_method: ChoicesSamplingMethod = token_length_normalized) -> ir.Expr:
    """Pick one of ``choices`` by the logprob the model gives each as a continuation."""
    if not choices or not all(isinstance(c, str) and c for c in choices):
        raise ValueError(f"choices must be a non-empty list of non-empty strings, got {choices!r}")
    if not isinstance(temperature, (int, float)) or temperature < 0:
        raise ValueError(f"temperature must be a number >= 0, got {temperature!r}")
    if not isinstance(choices_method, ChoicesSamplingMethod):
        raise ValueError(f"choices_method must be one of token_length_normalized, greedy_token_selection, "
                         f"unconditional_likelihood_normalized, got {choices_method!r}")
    return ir.Select(name, list(choices), float(temperature), choices_method)


def separate_reasoning(expr: ir.Expr, model_type: str = "deepseek-r1") -> ir.Expr:
    """After ``expr`` (a named gen), split its variable into the answer (kept under its name, and in the
    text) and the reasoning, stored as ``<name>_reasoning_content``, as SGLang's ``sgl.separate_reasoning``."""
    if not isinstance(expr, ir.Gen) or expr.name is None:
        raise TypeError("separate_reasoning takes a named gen(...)")
    if model_type not in ir.REASONING_MODEL_TYPES:
        raise ValueError(f"model_type must be one of {', '.join(ir.REASONING_MODEL_TYPES)}, got {model_type!r}")
    return ir.ExprList([expr, ir.SeparateReasoning(expr.name, model_type)])


def _role(role: str, expr: Any) -> ir.Expr:
    if expr is None:
        return ir.RoleBegin(role) + ir.RoleEnd(role)
    return ir.RoleBegin(role) + ir.to_expr(expr) + ir.RoleEnd(role)


def system(expr: Any = None) -> ir.Expr:
    return _role("system", expr)


def user(expr: Any = None) -> ir.Expr:
    return _role("user", expr)


def assistant(expr: Any = None) -> ir.Expr:
    return _role("assistant", expr)


def system_begin() -> ir.Expr:
    return ir.RoleBegin("system")


def system_end() -> ir.Expr:
    return ir.RoleEnd("system")


def user_begin() -> ir.Expr:
    return ir.RoleBegin("user")


def user_end() -> ir.Expr:
    return ir.RoleEnd("user")


def assistant_begin() -> ir.Expr:
    return ir.RoleBegin("assistant")


def assistant_end() -> ir.Expr:
    return ir.RoleEnd("assistant")


def set_default_backend(backend: Any) -> Backend | None:
    """Use ``backend`` (a Backend, or a radixlang Engine, wrapped) when run() gets none."""
    return DEFAULT_CONTEXT.set(backend)


def get_default_backend() -> Backend | None:
    return DEFAULT_CONTEXT.get()


def flush_cache(backend: Any = None) -> bool:
    return DEFAULT_CONTEXT.resolve(backend).flush_cache()


def get_server_info(backend: Any = None) -> dict[str, Any]:
    return DEFAULT_CONTEXT.resolve(backend).get_server_info()

