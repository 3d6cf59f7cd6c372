"""GrammarCompiler: (kind, spec) -> a compiled grammar of one backend, cached LRU, compiled in worker processes.

Backends: ``outlines`` (outlines-core: regex and JSON schema through a regex, and forced
structural tags, which are regular too),
``xgrammar`` and ``llguidance`` (regex, JSON schema, EBNF, structural tags).
Every compiled grammar has ``new_grammar()`` -> the per-request state with one
interface (constrained.grammar.Grammar / constrained.library_grammar.MatcherGrammar).

Everything that can take long runs in compile worker processes (compile_pool.py): the
JSON-Schema keyword check (schema_policy) and the library compile, killed at ``timeout_s``.
The caller's thread only checks the kind and the spec's type: a kind the backend does not
take fails the future at once; a schema keyword or format it does not enforce fails it with
an UnsupportedGrammar (a ValueError whose ``param`` names the field) when the worker answers.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections import OrderedDict
from concurrent.futures import Future
from typing import Any

from radixlang.constrained.compile_pool import KIND_PARAM, CompileWorkers, GrammarCompileTimeout
from radixlang.constrained.compile_worker import WorkerConfig
from radixlang.constrained.errors import UnsupportedGrammar
from radixlang.constrained.grammar import CompiledGrammar
from radixlang.constrained.json_regex import ANY_JSON_MARKER
from radixlang.constrained.reasoning import FreeTextMasks
from radixlang.constrained.schema_policy import check_whitespace_pattern
from radixlang.constrained.structural_tag import normalize_structural_tag, parse_structural_tag
from radixlang.constrained.tokenizer_info import TokenizerInfo

__all__ = ["BACKENDS", "BACKEND_KINDS", "GrammarCompileTimeout", "GrammarCompiler", "KINDS", "KIND_PARAM"]

GrammarKey = tuple[str, "str | None"]
KINDS = ("regex", "json", "ebnf", "structural_tag")
BACKENDS = ("outlines", "xgrammar", "llguidance")
BACKEND_KINDS = {"outlines": ("regex", "json"), "xgrammar": KINDS, "llguidance": KINDS}


def _is_forced_tag(spec: Any) -> bool:
    """A structural tag with ``forced: true`` (regular, so outlines takes it); False when it can't be read."""
    try:
        return parse_structural_tag(spec).forced
    except ValueError:
        return False


class _Loader:
    """Turns a worker's payload into the compiled grammar (on a compile slot's thread).

    Apart from the compiler so that the slot threads keep no reference to it: a compiler
    nobody holds is collected, and its finalizer stops its workers.
    """

    def __init__(self, tokenizer_info: TokenizerInfo, backend: str, whitespace_pattern: str | None) -> None:
        self.tokenizer_info = tokenizer_info
        self.backend = backend
        self.whitespace_pattern = whitespace_pattern
        self._library: Any = None
        self._lock = threading.Lock()
        self.library_build_s = 0.0

    def library(self) -> Any:
        """The xgrammar / llguidance backend object (its tokenizer tables are built once)."""
        with self._lock:
            if self._library is None:
                started = time.perf_counter()
                if self.backend == "xgrammar":
                    from radixlang.constrained.xgrammar_backend import XGrammarBackend
                    self._library = XGrammarBackend(self.tokenizer_info, whitespace_pattern=self.whitespace_pattern)
                else:
                    from radixlang.constrained.llguidance_backend import LLGuidanceBackend
                    self._library = LLGuidanceBackend(self.tokenizer_info,
                                                      whitespace_pattern=self.whitespace_pattern)
                self.library_build_s = time.perf_counter() - started
            return self._library

    def __call__(self, kind: str, spec: Any, payload: Any) -> Any:
        if self.backend == "outlines":
            regex, index = payload
            return CompiledGrammar(kind=kind, spec=spec, regex=regex, index=index, tokenizer_info=self.tokenizer_info)
        return self.library().load(kind, spec, payload)


class GrammarCompiler:
    """Compiles regexes, JSON schemas, EBNF and structural tags against one tokenizer.

    ``compile`` and ``compile_async`` share one LRU cache of futures keyed by
    (kind, spec), so concurrent requests for one grammar compile it once.
    Failed compiles stay cached (they fail the same way again) except timeouts:
    a compile that outlasts ``timeout_s`` is killed with its worker process, its
    future fails with GrammarCompileTimeout and it leaves the cache, so a later
    request for the grammar compiles it again (and is killed again).
    Thread-safe; call ``shutdown`` to stop the workers (a compiler that is garbage
    collected stops them too).
    """

    def __init__(self, tokenizer_info: TokenizerInfo, cache_size: int = 64, whitespace_pattern: str | None = None,
                 max_states: int = 200_000, timeout_s: float = 30.0, num_workers: int = 2,
                 any_json_depth: int = 2, backend: str = "outlines") -> None:
        if backend not in BACKENDS:
            raise ValueError(f"grammar backend must be one of {BACKENDS}, got {backend!r}")
        if cache_size < 0:
            raise ValueError(f"cache_size must be >= 0, got {cache_size}")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        check_whitespace_pattern(backend, whitespace_pattern)  # a pattern the backend can't write: refused now
        self.backend = backend
        self.tokenizer_info = tokenizer_info
        self.cache_size = cache_size
        self.whitespace_pattern = whitespace_pattern
        self.max_states = max_states
        self.timeout_s = timeout_s
        self.any_json_depth = any_json_depth
        self._cache: OrderedDict[GrammarKey, Future[Any]] = OrderedDict()
        self._lock = threading.Lock()
        self._free_text: dict[str, FreeTextMasks] = {}
        self._loader = _Loader(tokenizer_info, backend, whitespace_pattern)
        config = WorkerConfig(backend=backend, tokenizer_info=tokenizer_info, whitespace_pattern=whitespace_pattern,
                              max_states=max_states, any_json_depth=any_json_depth)
        self.workers = CompileWorkers(config, load=self._loader, timeout_s=timeout_s, num_workers=num_workers)
        weakref.finalize(self, self.workers.shutdown)

    def free_text_masks(self, marker: str) -> FreeTextMasks:
        """The reasoning-part masks for an end-of-reasoning marker (built once per marker); ValueError
        when the tokenizer cannot spell it."""
        with self._lock:
            masks = self._free_text.get(marker)
        if masks is None:
            masks = FreeTextMasks(self.tokenizer_info, marker)
            with self._lock:
                masks = self._free_text.setdefault(marker, masks)
        return masks

    # ---- public API -------------------------------------------------------

    def compile(self, kind: str, spec: str | None) -> Any:
        """Compile (or fetch from the cache); ValueError for a bad or too slow grammar."""
        return self.compile_async(kind, spec).result()

    def compile_async(self, kind: str, spec: str | None) -> Future[Any]:
        """A future resolving to the compiled grammar, or to ValueError / GrammarCompileTimeout.

        Returns at once: the checks here read only the kind and the spec's type (a kind the
        backend does not take fails the future now); the schema keyword check and the compile
        run in a worker process.
        """
        try:
            key = self._check_key(kind, spec)
        except ValueError as e:
            failed: Future[Any] = Future()
            failed.set_running_or_notify_cancel()
            failed.set_exception(e)
            return failed
        with self._lock:
            fut = self._cache.get(key)
            if fut is not None:
                self._cache.move_to_end(key)
                return fut
            fut = self.workers.submit(*key)
            if self.cache_size > 0:
                self._cache[key] = fut
                while len(self._cache) > self.cache_size:
                    self._cache.popitem(last=False)
        fut.add_done_callback(lambda done: self._forget_if_transient(key, done))
        return fut

    def cache_len(self) -> int:
        with self._lock:
            return len(self._cache)

    def library(self) -> Any:
        """The xgrammar / llguidance backend object of this process (its tokenizer tables are built once)."""
        return self._loader.library()

    def shutdown(self) -> None:
        """Stop the workers: queued compiles and those in flight fail."""
        self.workers.shutdown()

    # ---- internals --------------------------------------------------------

    def _forget_if_transient(self, key: GrammarKey, fut: Future[Any]) -> None:
        """A timeout or a shutdown says nothing about the grammar: out of the cache, so it is tried again."""
        exc = fut.exception()
        if exc is None or not (isinstance(exc, GrammarCompileTimeout) or self.workers.closed):
            return
        with self._lock:
            if self._cache.get(key) is fut:
                del self._cache[key]

    def _check_key(self, kind: str, spec: Any) -> GrammarKey:
        """The cache key, after the checks that cost nothing (kind, the spec's type); the rest runs in a worker."""
        if kind not in KINDS:
            raise ValueError(f"grammar kind must be one of {KINDS}, got {kind!r}")
        if kind not in BACKEND_KINDS[self.backend] and not (kind == "structural_tag" and _is_forced_tag(spec)):
            raise UnsupportedGrammar(f"{kind} grammars are not supported by the {self.backend} grammar backend "
                                     f"(it takes {', '.join(BACKEND_KINDS[self.backend])}; "
                                     f"xgrammar and llguidance take all of {', '.join(KINDS)})", KIND_PARAM[kind])
        if kind == "regex" and not isinstance(spec, str):
            raise UnsupportedGrammar(f"a regex grammar needs a pattern string, got {type(spec).__name__}", "regex")
        if kind in ("ebnf", "structural_tag") and not isinstance(spec, (str, dict) if kind != "ebnf" else str):
            raise UnsupportedGrammar(f"a {kind} grammar needs a string, got {type(spec).__name__}", KIND_PARAM[kind])
        if kind == "json":
            if spec == ANY_JSON_MARKER:
                spec = None
            if spec is not None and not isinstance(spec, str):
                raise ValueError(f"a json grammar needs a schema string or None, got {type(spec).__name__}")
        if kind == "structural_tag":
            spec = normalize_structural_tag(spec)
            parse_structural_tag(spec)  # its JSON shape (begin / schema / end ...); the schemas: in the worker
        return (kind, spec)
