"""GrammarWaits: constrained requests wait in the queue while their grammar compiles.

The compiler checks and compiles in worker processes, killed at the compile timeout (so a grammar
that takes too long neither holds the scheduler nor keeps burning a CPU); each step the scheduler
polls the waiting requests' futures, attaches the per-request grammar state to those that completed
and fails (alone) those whose grammar did not compile. A request with a grammar still compiling is
never admitted.
"""
from __future__ import annotations

from concurrent.futures import FIRST_COMPLETED, Future
from concurrent.futures import wait as wait_futures
from typing import Any

from radixlang.constrained import GrammarCompiler, ReasoningGrammar, TokenizerInfo, UnsupportedGrammar
from radixlang.runtime.scheduler.batch import Req
from radixlang.runtime.scheduler.output import OutputCollector
from radixlang.runtime.sampling.sampling_params import SamplingParams


class GrammarWaits:
    def __init__(self, *, tokenizer: Any, vocab_size: int, eos_ids: frozenset[int], timeout_s: float,
                 whitespace_pattern: str | None, compiler: GrammarCompiler | None = None,
                 backend: str = "outlines") -> None:
        """``compiler``: one to use instead of building it from the tokenizer on the first grammar;
        ``backend``: the grammar backend of a compiler built here (ServerArgs.grammar_backend)."""
        self._backend = backend
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._eos_ids = eos_ids
        self._timeout_s = timeout_s
        self._whitespace_pattern = whitespace_pattern
        self._compiler = compiler

    @property
    def compiler(self) -> GrammarCompiler:
        """Built on the first constrained request (reading the vocabulary takes a moment)."""
        if self._compiler is None:
            info = TokenizerInfo.from_tokenizer(self._tokenizer, vocab_size=self._vocab_size,
                                                eos_token_ids=sorted(self._eos_ids))
            self._compiler = GrammarCompiler(info, backend=self._backend, timeout_s=self._timeout_s,
                                             whitespace_pattern=self._whitespace_pattern)
        return self._compiler

    def submit(self, params: SamplingParams) -> Future[Any] | None:
        """Start compiling the request's grammar; None when it has none.

        A kind, schema keyword or format the backend does not enforce fails the future at once
        with an UnsupportedGrammar (a ValueError whose ``param`` names the field: a 400), and so
        does a ``constrain_after`` marker the tokenizer cannot spell.
        """
        if params.grammar_key is None:
            return None
        if params.constrain_after is not None:
            try:
                self.compiler.free_text_masks(params.constrain_after)
            except ValueError as e:
                raise UnsupportedGrammar(f"the grammar cannot start after the reasoning: {e}", "constrain_after") \
                    from None
        return self.compiler.compile_async(*params.grammar_key)

    def poll(self, waiting: list[Req], outputs: OutputCollector) -> list[Future[Any]]:
        """Attach compiled grammars to waiting requests; fail those whose grammar did not compile.

        Returns the futures still compiling.
        """
        pending = []
        for req in list(waiting):
            fut = req.grammar_future
            if fut is None or req.grammar is not None:
                continue
            if not fut.done():
                pending.append(fut)
                continue
            try:
                grammar = fut.result().new_grammar()
                marker = req.sampling_params.constrain_after
                # reasoning-aware: free text until the marker, then the grammar (one state per request)
                req.grammar = grammar if marker is None else ReasoningGrammar(
                    grammar, self.compiler.free_text_masks(marker))
            except Exception as e:  # noqa: BLE001 -- a bad or too slow grammar fails only its own request
                waiting.remove(req)
                outputs.add_error(req.rid, str(e), prompt_tokens=req.prompt_len,
                                  param=getattr(e, "param", None) or _grammar_field(req.sampling_params))
        return pending

    def close(self) -> None:
        """Stop the compiler's worker processes (if it was built): compiles still waiting fail."""
        if self._compiler is not None:
            self._compiler.shutdown()

    @staticmethod
    def is_compiling(req: Req) -> bool:
        return req.grammar_future is not None and req.grammar is None

    @staticmethod
    def wait(pending: list[Future[Any]], timeout_s: float = 0.01) -> None:
        """Block until one grammar completes or ``timeout_s`` passes (a loop with nothing else to do)."""
        wait_futures(pending, timeout=timeout_s, return_when=FIRST_COMPLETED)


def _grammar_field(params: SamplingParams) -> str | None:
    """The sampling param that carried a grammar the compiler refused: the field at fault."""
    key = params.grammar_key
    if key is None:
        return None
    return {"json": "json_schema"}.get(key[0], key[0])
