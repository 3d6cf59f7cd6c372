"""@function -> Function: run, run_batch, bind, trace."""
from __future__ import annotations

import inspect
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Iterator, Sequence

from radixlang.lang import ir
from radixlang.lang.backends.base import Backend
from radixlang.lang.context import DEFAULT_CONTEXT, INSIDE_PROGRAM
from radixlang.lang.interpreter import StreamExecutor
from radixlang.lang.state import ProgramState
from radixlang.lang.tracer import TraceResult, trace_program


def sampling_defaults(*, max_new_tokens: int = 128, min_new_tokens: int | None = None, stop: Any = None,
                      stop_token_ids: list[int] | None = None, temperature: float = 1.0, top_p: float = 1.0,
                      top_k: int = -1, min_p: float = 0.0, frequency_penalty: float = 0.0,
                      presence_penalty: float = 0.0, ignore_eos: bool = False, return_logprob: bool | None = None,
                      logprob_start_len: int | None = None, top_logprobs_num: int | None = None,
                      return_text_in_logprobs: bool | None = None) -> dict[str, Any]:
    """run()'s sampling keywords -> the executor's defaults (wire names plus logprob options)."""
    return {"max_new_tokens": max_new_tokens, "min_new_tokens": min_new_tokens, "stop": stop,
            "stop_token_ids": stop_token_ids, "temperature": temperature, "top_p": top_p, "top_k": top_k,
            "min_p": min_p, "frequency_penalty": frequency_penalty, "presence_penalty": presence_penalty,
            "ignore_eos": ignore_eos, "return_logprob": return_logprob, "logprob_start_len": logprob_start_len,
            "top_logprobs_num": top_logprobs_num, "return_text_in_logprobs": return_text_in_logprobs}


_SAMPLING_KW = set(inspect.signature(sampling_defaults).parameters)


def _split_kwargs(kwargs: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    sampling = {k: kwargs.pop(k) for k in list(kwargs) if k in _SAMPLING_KW}
    return sampling_defaults(**sampling), kwargs


class Function:
    """A DSL program. The wrapped function takes the state first: ``def prog(s, question): ...``."""

    def __init__(self, func: Callable[..., Any], *, num_api_spec_tokens: int | None = None,
                 bind_arguments: dict[str, Any] | None = None) -> None:
        self.func = func
        self.num_api_spec_tokens = num_api_spec_tokens  # accepted for SGLang compatibility; unused
        self.bind_arguments = dict(bind_arguments or {})
        params = list(inspect.signature(func).parameters.values())
        if not params:
            raise ValueError(f"a @function takes the program state as its first argument; {func.__name__}() "
                             f"takes none")
        kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
        self.arg_names = [p.name for p in params[1:] if p.kind in kinds]
        self.__name__ = getattr(func, "__name__", "program")
        self.__doc__ = func.__doc__

    def bind(self, **kwargs: Any) -> Function:
        unknown = sorted(set(kwargs) - set(self.arg_names))
        if unknown:
            raise TypeError(f"{self.__name__}() has no argument(s) {', '.join(unknown)}; it takes {self.arg_names}")
        return Function(self.func, num_api_spec_tokens=self.num_api_spec_tokens,
                        bind_arguments={**self.bind_arguments, **kwargs})

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if args and isinstance(args[0], ProgramState):
            return self.run_inline(args[0], *args[1:], **kwargs)
        if INSIDE_PROGRAM.get():
            return ir.SubProgram(self, args, kwargs)
        return self.run(*args, **kwargs)

    def run_inline(self, state: ProgramState, *args: Any, **kwargs: Any) -> Any:
        """Run the body on an existing state (a sub-program shares its caller's text and variables)."""
        return self.func(state, *args, **{**self.bind_arguments, **kwargs})

    # ---- running -----------------------------------------------------------------------------
    def _new_state(self, backend: Backend, defaults: dict[str, Any], *, stream: bool) -> ProgramState:
        return ProgramState(StreamExecutor(backend, backend.chat_template, defaults, stream=stream))

    def _execute(self, state: ProgramState, args: Sequence[Any], kwargs: dict[str, Any], *,
                 capture: bool) -> None:
        token = INSIDE_PROGRAM.set(True)
        try:
            state.ret_value = self.func(state, *args, **{**self.bind_arguments, **kwargs})
        except Exception as e:
            state.stream_executor.set_error(e)
            if not capture:
                raise
        finally:
            INSIDE_PROGRAM.reset(token)
            state.stream_executor.end()

    def run(self, *args: Any, stream: bool = False, backend: Any = None, use_thread: bool = True,
            **kwargs: Any) -> ProgramState:
        """Run once. Sampling keywords (max_new_tokens, temperature, stop, ...) are the defaults of every gen;
        other keywords are the program's arguments. With stream=True the body runs in a thread and the
        state is returned at once (read it with text_iter). An exception raised by the body itself
        propagates; a failed model call is in state.error() and raised by state[var]."""
        backend = DEFAULT_CONTEXT.resolve(backend)
        defaults, prog_kwargs = _split_kwargs(kwargs)
        state = self._new_state(backend, defaults, stream=stream)
        if stream:
            threading.Thread(target=self._execute, args=(state, args, prog_kwargs), kwargs={"capture": True},
                             name="radixlang-stream-body", daemon=True).start()
            return state
        try:
            self._execute(state, args, prog_kwargs, capture=False)
        finally:
            state.wait()
            backend.end_program([state])
        return state

    def run_batch(self, batch_kwargs: Sequence[dict[str, Any] | tuple | list], *, backend: Any = None,
                  num_threads: int | str = "auto", progress_bar: bool = False, generator_style: bool = False,
                  **sampling: Any) -> list[ProgramState] | Iterator[ProgramState]:
        """Run once per item (a dict of keyword arguments or a tuple of positional ones), results in input
        order. The constant prefix is traced and prefilled once first. Errors stay in each state."""
        backend = DEFAULT_CONTEXT.resolve(backend)
        defaults, extra = _split_kwargs(dict(sampling))
        if extra:
            raise TypeError(f"run_batch() got unexpected keyword(s) {', '.join(sorted(extra))}; program "
                            f"arguments go in batch_kwargs")
        items = [self._normalize_item(x) for x in batch_kwargs]
        if num_threads == "auto":
            num_threads = max(1, min(len(items), max(16, (os.cpu_count() or 1) * 8)))
        if not isinstance(num_threads, int) or num_threads < 1:
            raise ValueError(f"num_threads must be 'auto' or an int >= 1, got {num_threads!r}")
        if len(items) > 1:
            prefix = self.trace(backend=backend).prefix
            if prefix:
                backend.cache_prefix(prefix)
        results = self._batch_iter(items, backend, defaults, num_threads, progress_bar)
        return results if generator_style else list(results)

    def _batch_iter(self, items, backend: Backend, defaults: dict[str, Any], num_threads: int,
                    progress_bar: bool) -> Iterator[ProgramState]:
        def one(item: tuple[tuple, dict]) -> ProgramState:
            state = self._new_state(backend, defaults, stream=False)
            self._execute(state, item[0], item[1], capture=True)
            state.wait()
            return state
        bar = _progress(len(items)) if progress_bar else None
        with ThreadPoolExecutor(max_workers=num_threads, thread_name_prefix="radixlang-batch") as pool:
            futures = [pool.submit(one, item) for item in items]
            if bar is not None:
                for f in futures:
                    f.add_done_callback(lambda _: bar.update(1))
            try:
                for f in futures:
                    yield f.result()
            finally:
                if bar is not None:
                    bar.close()
        backend.end_program([f.result() for f in futures if f.done() and f.exception() is None])

    def _normalize_item(self, item: Any) -> tuple[tuple, dict[str, Any]]:
        if isinstance(item, dict):
            return (), dict(item)
        if isinstance(item, (tuple, list)):
            return tuple(item), {}
        raise TypeError(f"run_batch items must be dicts (keyword arguments) or tuples (positional), "
                        f"got {type(item).__name__}")

    def trace(self, *, backend: Any = None, **kwargs: Any) -> TraceResult:
        """The constant prefix; arguments given here (or bound) are treated as constants."""
        backend = DEFAULT_CONTEXT.resolve(backend)
        defaults, prog_kwargs = _split_kwargs(kwargs)
        return trace_program(self.func, self.arg_names, {**self.bind_arguments, **prog_kwargs},
                             backend.chat_template, defaults)


def _progress(total: int) -> Any:
    try:
        from tqdm import tqdm
    except ImportError as e:
        raise ImportError("progress_bar=True needs tqdm: pip install tqdm") from e
    return tqdm(total=total)


def function(func: Callable[..., Any] | None = None, *, num_api_spec_tokens: int | None = None) -> Any:
    """Decorator: ``@function`` or ``@function(num_api_spec_tokens=...)``."""
    if func is None:
        return lambda f: Function(f, num_api_spec_tokens=num_api_spec_tokens)
    return Function(func, num_api_spec_tokens=num_api_spec_tokens)
