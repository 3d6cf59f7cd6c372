"""SamplingParams: the one definition of a request's sampling options.

Torch-free so that the HTTP layer and clients can validate without the
runtime. Names and defaults follow SGLang's native API. Built and validated
once, in the request front, and frozen: the scheduler receives the same
object (or, over a process boundary, its fields, not validated again) and
keeps its own per-request state (the token budget left) on its request.
"""
from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass, field
from typing import Any

from radixlang.runtime.errors import RequestError

_GREEDY_EPS = 1e-6
# the token budget of a request that sets no max_new_tokens (SGLang's); capped to the context left, where an
# explicit max_new_tokens past it is refused
DEFAULT_MAX_NEW_TOKENS = 128
# json_schema value meaning "any JSON object" (SGLang's spelling for OpenAI's json_object response format)
ANY_JSON = "$$ANY$$"


_GRAMMAR_FIELDS = ("regex", "json_schema", "ebnf", "structural_tag")


@dataclass(kw_only=True, frozen=True)
class SamplingParams:
    max_new_tokens: int | None = None  # None: not asked for (DEFAULT_MAX_NEW_TOKENS, capped to the context)
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    n: int = 1
    sampling_seed: int | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    regex: str | None = None
    json_schema: str | None = None
    ebnf: str | None = None
    # token id (a decimal string: JSON object keys are strings) -> bias added to its logit before sampling
    logit_bias: dict[str, float] | None = None
    # regexes: generation stops once the output text matches one; the text is cut before the match
    stop_regex: list[str] = field(default_factory=list)
    structural_tag: str | None = None  # {"type": "structural_tag", "structures": [...], "triggers": [...]}
    # the end-of-reasoning marker (e.g. "</think>"): the grammar applies only after it, free text before
    constrain_after: str | None = None

    def __post_init__(self) -> None:
        def put(name: str, value: Any) -> None:  # normalizing the caller's spellings, before freezing
            object.__setattr__(self, name, value)

        if isinstance(self.stop_regex, str):
            put("stop_regex", [self.stop_regex])
        elif self.stop_regex is None:
            put("stop_regex", [])
        if isinstance(self.logit_bias, dict):
            put("logit_bias", _canonical_bias(self.logit_bias))
        if isinstance(self.stop, str):
            put("stop", [self.stop])
        elif self.stop is None:
            put("stop", [])
        if self.stop_token_ids is None:
            put("stop_token_ids", [])
        if isinstance(self.json_schema, dict):
            put("json_schema", json.dumps(self.json_schema))
        if isinstance(self.structural_tag, dict):
            put("structural_tag", json.dumps(self.structural_tag))
        self.validate()

    @property
    def token_budget(self) -> int:
        """max_new_tokens as asked, or the default."""
        return DEFAULT_MAX_NEW_TOKENS if self.max_new_tokens is None else self.max_new_tokens

    def validate(self) -> None:
        if self.max_new_tokens is not None:
            _check_int("max_new_tokens", self.max_new_tokens, lo=0)
        _check_int("min_new_tokens", self.min_new_tokens, lo=0)
        if self.min_new_tokens > self.token_budget:
            raise RequestError(f"min_new_tokens must be <= max_new_tokens, "
                               f"got {self.min_new_tokens} > {self.token_budget}", "min_new_tokens")
        _check_num("temperature", self.temperature)
        if self.temperature < 0:
            raise RequestError(f"temperature must be >= 0, got {self.temperature}", "temperature")
        _check_num("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise RequestError(f"top_p must be in (0, 1], got {self.top_p}", "top_p")
        _check_int("top_k", self.top_k)
        if self.top_k < 1 and self.top_k != -1:
            raise RequestError(f"top_k must be -1 (disabled) or >= 1, got {self.top_k}", "top_k")
        _check_num("min_p", self.min_p)
        if not 0.0 <= self.min_p <= 1.0:
            raise RequestError(f"min_p must be in [0, 1], got {self.min_p}", "min_p")
        for name in ("frequency_penalty", "presence_penalty"):
            value = getattr(self, name)
            _check_num(name, value)
            if not -2.0 <= value <= 2.0:
                raise RequestError(f"{name} must be in [-2, 2], got {value}", name)
        _check_num("repetition_penalty", self.repetition_penalty)
        if not 0.0 < self.repetition_penalty <= 2.0:
            raise RequestError(f"repetition_penalty must be in (0, 2], got {self.repetition_penalty}",
                               "repetition_penalty")
        if not isinstance(self.stop, list) or not all(isinstance(s, str) for s in self.stop):
            raise RequestError(f"stop must be a string or a list of strings, got {self.stop!r}", "stop")
        if any(s == "" for s in self.stop):
            raise RequestError("stop strings must be non-empty", "stop")
        if not isinstance(self.stop_token_ids, list) or not all(
                isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.stop_token_ids):
            raise RequestError(f"stop_token_ids must be a list of non-negative ints, got {self.stop_token_ids!r}",
                               "stop_token_ids")
        _check_int("n", self.n, lo=1)
        if self.sampling_seed is not None:
            _check_int("sampling_seed", self.sampling_seed)
        for name in ("ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim"):
            if not isinstance(getattr(self, name), bool):
                raise RequestError(f"{name} must be a bool, got {getattr(self, name)!r}", name)
        given = [name for name in _GRAMMAR_FIELDS if getattr(self, name) is not None]
        if len(given) > 1:
            raise RequestError(f"only one of {', '.join(_GRAMMAR_FIELDS)} may be given, got {', '.join(given)}",
                               given[0])
        for name in given:
            if not isinstance(getattr(self, name), str):
                raise RequestError(f"{name} must be a string, got {type(getattr(self, name)).__name__}", name)
        if self.constrain_after is not None:
            if not isinstance(self.constrain_after, str) or not self.constrain_after:
                raise RequestError(f"constrain_after must be a non-empty string, got {self.constrain_after!r}",
                                   "constrain_after")
            if not given:
                raise RequestError(f"constrain_after needs a grammar ({', '.join(_GRAMMAR_FIELDS)})",
                                   "constrain_after")
        if self.json_schema is not None and self.json_schema != ANY_JSON:
            try:
                json.loads(self.json_schema)
            except ValueError as e:
                raise RequestError(f"json_schema is not valid JSON: {e}", "json_schema") from None

        if not isinstance(self.stop_regex, list) or not all(isinstance(r, str) and r for r in self.stop_regex):
            raise RequestError(f"stop_regex must be a regex or a list of non-empty regexes, got {self.stop_regex!r}",
                               "stop_regex")
        for pattern in self.stop_regex:
            try:
                re.compile(pattern)
            except re.error as e:
                raise RequestError(f"stop_regex {pattern!r} is not a valid regex: {e}", "stop_regex") from None
        if self.logit_bias is not None and not isinstance(self.logit_bias, dict):
            raise RequestError(f"logit_bias must be an object of token id -> bias, got {self.logit_bias!r}",
                               "logit_bias")

    @property
    def logit_bias_ids(self) -> list[tuple[int, float]]:
        """logit_bias as (token id, bias) pairs; ids are checked against the vocabulary by the scheduler."""
        return [(int(k), v) for k, v in (self.logit_bias or {}).items()]

    @property
    def is_greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS or self.top_k == 1

    @property
    def grammar_key(self) -> tuple[str, str | None] | None:
        """(kind, spec) for the grammar compiler, or None when unconstrained."""
        if self.regex is not None:
            return ("regex", self.regex)
        if self.json_schema is not None:
            return ("json", None if self.json_schema == ANY_JSON else self.json_schema)
        if self.ebnf is not None:
            return ("ebnf", self.ebnf)
        if self.structural_tag is not None:
            return ("structural_tag", self.structural_tag)
        return None

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> SamplingParams:
        """Build from an API dict; unknown keys are a ValueError naming them."""
        data = dict(data or {})
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise RequestError(f"unknown sampling parameter(s): {', '.join(unknown)}", unknown[0])
        return cls(**data)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_wire(cls, data: dict[str, Any]) -> SamplingParams:
        """The params a front built and validated, back from ``to_dict`` after crossing a process boundary:
        the same fields, not validated again."""
        params = object.__new__(cls)
        for f in dataclasses.fields(cls):
            object.__setattr__(params, f.name, data[f.name])
        return params


def _canonical_bias(bias: dict[Any, Any]) -> dict[str, float]:
    out: dict[str, float] = {}
    for key, value in bias.items():
        token = key if isinstance(key, int) and not isinstance(key, bool) else None
        if isinstance(key, str) and re.fullmatch(r"\s*\d+\s*", key):
            token = int(key)
        if token is None or token < 0:
            raise RequestError(f"logit_bias keys must be token ids (non-negative integers), got {key!r}", "logit_bias")
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not -100 <= value <= 100:
            raise RequestError(f"logit_bias values must be numbers in [-100, 100], got {value!r} for token {token}",
                               "logit_bias")
        out[str(token)] = float(value)
    return out


def _check_int(name: str, value: Any, lo: int | None = None) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise RequestError(f"{name} must be an integer, got {value!r}", name)
    if lo is not None and value < lo:
        raise RequestError(f"{name} must be >= {lo}, got {value}", name)


def _check_num(name: str, value: Any) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or value != value:
        raise RequestError(f"{name} must be a number, got {value!r}", name)
