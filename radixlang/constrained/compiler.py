"""GrammarCompiler: (kind, spec) -> a compiled grammar of one backend, cached LRU, sync or on worker threads.

Backends: ``outlines`` (outlines-core: regex and JSON schema through a regex, and forced
structural tags, which are regular too),
``xgrammar`` and ``llguidance`` (regex, JSON schema, EBNF, structural tags).
Every compiled grammar has ``new_grammar()`` -> the per-request state with one
interface (constrained.grammar.Grammar / constrained.library_grammar.MatcherGrammar).
A kind or schema keyword the backend cannot enforce is refused up front by
``compile_async`` with an UnsupportedGrammar (a ValueError with ``param``).
"""

from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, InvalidStateError, ThreadPoolExecutor

from outlines_core import Index, Vocabulary

from typing import Any

from radixlang.constrained.errors import UnsupportedGrammar
from radixlang.constrained.grammar import CompiledGrammar
from radixlang.constrained.reasoning import FreeTextMasks
from radixlang.constrained.json_regex import ANY_JSON_MARKER, ascii_digits, json_schema_to_regex
from radixlang.constrained.schema_policy import check_whitespace_pattern, prepare_schema
from radixlang.constrained.structural_tag import forced_tag_regex, normalize_structural_tag, parse_structural_tag
from radixlang.constrained.tokenizer_info import TokenizerInfo

GrammarKey = tuple[str, "str | None"]
KINDS = ("regex", "json", "ebnf", "structural_tag")
BACKENDS = ("outlines", "xgrammar", "llguidance")
BACKEND_KINDS = {"outlines": ("regex", "json"), "xgrammar": KINDS, "llguidance": KINDS}
# the request field each kind comes from (SamplingParams), named in a refusal
KIND_PARAM = {"regex": "regex", "json": "json_schema", "ebnf": "ebnf", "structural_tag": "structural_tag"}


def _is_forced_tag(spec: Any) -> bool:
    """A structural tag with ``forced: true`` (regular, so outlines takes it); False when it can't be read."""
    try:
        return parse_structural_tag(spec).forced
    except ValueError:
        return False


class GrammarCompileTimeout(TimeoutError, ValueError):
    """A grammar took longer than the compiler's timeout_s (a ValueError, so the request fails as bad input)."""


class GrammarCompiler:
    """Compiles regexes and JSON schemas against one tokenizer.

    ``compile`` and ``compile_async`` share one LRU cache of futures keyed by
    (kind, spec), so concurrent requests for one grammar compile it once.
    Failed compiles stay cached (they fail the same way again) except timeouts:
    a build that timed out keeps running on its worker (it cannot be interrupted);
    a later request for the same grammar waits on that build instead of starting
    another, and once it completes its result is cached like any other.
    Thread-safe; call ``shutdown`` to stop the worker threads.
    """

    def __init__(self, tokenizer_info: TokenizerInfo, cache_size: int = 64, whitespace_pattern: str | None = None,
                 max_states: int = 200_000, timeout_s: float = 30.0, num_workers: int = 2,
                 any_json_depth: int = 2, backend: str = "outlines") -> None:
        if backend not in BACKENDS:
            raise ValueError(f"grammar backend must be one of {BACKENDS}, got {backend!r}")
        self.backend = backend
        self._library: Any = None  # the xgrammar / llguidance backend object, built on first use
        self._library_lock = threading.Lock()
        if cache_size < 0:
            raise ValueError(f"cache_size must be >= 0, got {cache_size}")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        self.tokenizer_info = tokenizer_info
        self.cache_size = cache_size
        check_whitespace_pattern(backend, whitespace_pattern)  # a pattern the backend can't write: refused now
        self.whitespace_pattern = whitespace_pattern
        self.max_states = max_states
        self.timeout_s = timeout_s
        self.any_json_depth = any_json_depth
        self._cache: OrderedDict[GrammarKey, Future[CompiledGrammar]] = OrderedDict()
        self._building: dict[GrammarKey, Future[CompiledGrammar]] = {}  # worker futures not yet done
        self._lock = threading.Lock()
        self._vocabulary: Vocabulary | None = None
        self._vocab_lock = threading.Lock()
        self.vocabulary_build_s = 0.0
        self._pool = ThreadPoolExecutor(max_workers=num_workers, thread_name_prefix="grammar")
        self._free_text: dict[str, FreeTextMasks] = {}

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

        A kind, schema keyword or format the backend does not enforce fails the
        future at once with an UnsupportedGrammar (its ``param`` names the field).
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
            fut = Future()
            fut.set_running_or_notify_cancel()
            if self.cache_size > 0:
                self._cache[key] = fut
                while len(self._cache) > self.cache_size:
                    self._cache.popitem(last=False)
        self._start(key, fut)
        return fut

    def cache_len(self) -> int:
        with self._lock:
            return len(self._cache)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    # ---- internals --------------------------------------------------------

    def _check_key(self, kind: str, spec: str | None) -> GrammarKey:
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
            if spec is not None:
                self._schema(spec)  # refuses what the backend would not enforce
        if kind == "structural_tag":
            spec = normalize_structural_tag(spec)  # type: ignore[arg-type]
            for s in parse_structural_tag(spec).structures:
                prepare_schema(s.schema, self.backend, param="structural_tag")
        return (kind, spec)

    def _schema(self, spec: str) -> Any:
        """The parsed schema, checked against the backend's keyword policy, oneOf as anyOf."""
        try:
            parsed = json.loads(spec)
        except json.JSONDecodeError as e:
            raise UnsupportedGrammar(f"json schema must be valid JSON, got {spec[:80]!r}: {e}", "json_schema") \
                from None
        if not isinstance(parsed, (dict, bool)):
            raise UnsupportedGrammar(f"json schema must be a JSON object, got {type(parsed).__name__}", "json_schema")
        return prepare_schema(parsed, self.backend)

    def library(self) -> Any:
        """The xgrammar / llguidance backend object (its tokenizer tables are built once)."""
        with self._library_lock:
            if self._library is None:
                started = time.perf_counter()
                if self.backend == "xgrammar":
                    from radixlang.constrained.xgrammar_backend import XGrammarBackend
                    self._library = XGrammarBackend(self.tokenizer_info, whitespace_pattern=self.whitespace_pattern)
                else:
                    from radixlang.constrained.llguidance_backend import LLGuidanceBackend
                    self._library = LLGuidanceBackend(self.tokenizer_info,
                                                      whitespace_pattern=self.whitespace_pattern)
                self.vocabulary_build_s = time.perf_counter() - started
            return self._library

    def _start(self, key: GrammarKey, outer: Future[CompiledGrammar]) -> None:
        def finish(inner: Future[CompiledGrammar]) -> None:
            timer.cancel()
            if outer.done():
                return
            try:
                if inner.cancelled():
                    outer.set_exception(ValueError(f"grammar compiler was shut down before compiling {key[0]}"))
                elif inner.exception() is not None:
                    outer.set_exception(inner.exception())
                else:
                    outer.set_result(inner.result())
            except InvalidStateError:  # the timeout fired first
                pass

        def expire() -> None:
            with self._lock:  # out of the cache before anyone sees it failed
                if outer.done():
                    return
                try:
                    outer.set_exception(GrammarCompileTimeout(
                        f"grammar compile took longer than {self.timeout_s:g}s ({key[0]}: {str(key[1])[:80]!r})"))
                except InvalidStateError:  # lost the race with finish()
                    return
                if self._cache.get(key) is outer:
                    del self._cache[key]

        def built(inner: Future[CompiledGrammar]) -> None:
            with self._lock:
                self._building.pop(key, None)
                if (not inner.cancelled() and inner.exception() is None and self.cache_size > 0
                        and key not in self._cache):  # finished after its requests timed out: keep it
                    done: Future[CompiledGrammar] = Future()
                    done.set_running_or_notify_cancel()
                    done.set_result(inner.result())
                    self._cache[key] = done
                    while len(self._cache) > self.cache_size:
                        self._cache.popitem(last=False)

        timer = threading.Timer(self.timeout_s, expire)
        timer.daemon = True
        timer.start()
        with self._lock:
            inner = self._building.get(key)
            new = inner is None
            if new:
                inner = self._building[key] = self._pool.submit(self._build, key)
        if new:  # outside the lock: a build already done runs its callback right here
            inner.add_done_callback(built)
        inner.add_done_callback(finish)

    def _build(self, key: GrammarKey) -> Any:
        kind, spec = key
        if self.backend != "outlines":
            schema = self._schema(spec) if kind == "json" and spec is not None else None
            # \d is ASCII 0-9 on every backend (llguidance's regex engine reads it as any Unicode digit)
            return self.library().build(kind, ascii_digits(spec) if kind == "regex" else spec, schema)
        if kind == "regex":
            # \d means ASCII digits, as in xgrammar and in what users of phone/date patterns expect
            regex = ascii_digits(spec)
        elif kind == "structural_tag":  # a forced tag (the only kind _check_key lets through here)
            tag = parse_structural_tag(spec)
            bodies = [json_schema_to_regex(json.dumps(prepare_schema(s.schema, self.backend, "structural_tag")),
                                           whitespace_pattern=self.whitespace_pattern, any_depth=self.any_json_depth)
                      for s in tag.structures]
            regex = forced_tag_regex(tag, bodies)
        else:
            schema = None if spec is None else json.dumps(self._schema(spec))
            regex = json_schema_to_regex(schema, whitespace_pattern=self.whitespace_pattern,
                                         any_depth=self.any_json_depth)
        assert regex is not None
        try:
            index = Index(regex, self.vocabulary())
        except (ValueError, TypeError) as e:
            raise ValueError(f"invalid {kind} grammar: {str(e).strip()[:200]} (pattern: {regex[:80]!r})") from None
        if self.max_states:
            num_states = len(index.get_transitions())
            if num_states > self.max_states:
                raise ValueError(f"grammar has {num_states} states, more than max_states={self.max_states}")
        return CompiledGrammar(kind=kind, spec=spec, regex=regex, index=index, tokenizer_info=self.tokenizer_info)

    def vocabulary(self) -> Vocabulary:
        """The outlines-core Vocabulary of the tokenizer (built once, never from the hub)."""
        with self._vocab_lock:
            if self._vocabulary is None:
                started = time.perf_counter()
                info = self.tokenizer_info
                by_bytes: dict[bytes, list[int]] = {}
                for token_id, data in enumerate(info.token_bytes):
                    if data:
                        by_bytes.setdefault(data, []).append(token_id)
                self._vocabulary = Vocabulary(info.eos_token_ids[0], by_bytes)
                self.vocabulary_build_s = time.perf_counter() - started
            return self._vocabulary
