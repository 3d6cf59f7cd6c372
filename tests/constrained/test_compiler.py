"""GrammarCompiler: kinds, LRU cache, async compile, time limit, errors, JSON jump-forward."""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time

import pytest

from radixlang.constrained import (CompiledGrammar, Grammar, GrammarCompiler, GrammarCompileTimeout, TokenizerInfo,
                                   UnsupportedGrammar)
from radixlang.constrained.json_regex import any_json_object_regex, integer_range_regex, json_schema_to_regex

ASCII = {chr(c): i for i, c in enumerate(range(32, 127))}
ASCII["<eos>"] = len(ASCII)


@pytest.fixture()
def compiler():
    c = GrammarCompiler(TokenizerInfo.from_vocab(ASCII, eos_token="<eos>"), cache_size=2)
    yield c
    c.shutdown()


def test_cache_is_lru(compiler):
    first = compiler.compile("regex", "a+")
    assert compiler.compile("regex", "a+") is first
    compiler.compile("regex", "b+")
    compiler.compile("regex", "a+")          # refresh a+: b+ is now the oldest
    compiler.compile("regex", "c+")
    assert compiler.cache_len() == 2
    assert compiler.compile("regex", "a+") is first
    assert compiler.compile("regex", "b+") is not None and compiler.cache_len() == 2


def test_concurrent_compiles_share_one_future(compiler):
    futures = []
    threads = [threading.Thread(target=lambda: futures.append(compiler.compile_async("regex", "[a-z]{2,9}")))
               for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len({id(f) for f in futures}) == 1
    assert futures[0].result().regex == "[a-z]{2,9}"


@pytest.mark.parametrize("kind, spec, message", [
    ("regex", "a(", "invalid regex grammar"),
    ("regex", "[z-a]", "invalid regex grammar"),
    ("json", "not json", "valid JSON"),
    ("json", '{"type": "foo"}', "unsupported or invalid json schema"),
    ("json", "[1, 2]", "must be a JSON object"),
    ("json", '{"$ref": "#/$defs/missing"}', "unsupported or invalid json schema"),
    ("json", '{"type": "string", "pattern": "("}', "invalid json grammar"),
    ("ebnf", "root ::= 'a'", "ebnf grammars are not supported by the outlines grammar backend"),
    ("sql", "SELECT", "grammar kind must be one of"),
    ("regex", None, "needs a pattern string"),
])
def test_invalid_grammars_raise_value_error(compiler, kind, spec, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        compiler.compile(kind, spec)
    if kind in ("regex", "json") and spec is not None:
        assert isinstance(compiler.compile_async(kind, spec).exception(timeout=30), ValueError)


def test_the_schema_check_runs_in_the_worker_not_the_caller(compiler, monkeypatch):
    from radixlang.constrained import schema_policy

    def boom(*args, **kwargs):
        raise AssertionError("the keyword check ran in the caller's process")

    monkeypatch.setattr(schema_policy, "check_schema", boom)  # this process only: the worker has its own
    compiled = compiler.compile("json", '{"type": "object", "properties": {"a": {"type": "integer"}}}')
    assert isinstance(compiled, CompiledGrammar) and '"a"' in compiled.regex
    with pytest.raises(UnsupportedGrammar, match="uniqueItems") as e:  # refused there, naming the field
        compiler.compile("json", '{"type": "array", "uniqueItems": true}')
    assert e.value.param == "json_schema"


def test_timeout_fails_the_future_cleanly(smollm_info):
    c = GrammarCompiler(smollm_info, timeout_s=0.01, any_json_depth=2)
    fut = c.compile_async("json", None)      # takes ~1 s on the 49k vocabulary
    exc = fut.exception(timeout=60)
    assert isinstance(exc, GrammarCompileTimeout)
    assert isinstance(exc, ValueError) and isinstance(exc, TimeoutError)
    assert "longer than 0.01s" in str(exc)
    assert c.cache_len() == 0                # a timeout is not cached: the failure is not remembered
    c.shutdown()


# outlines-core takes tens of seconds on this counted repetition over the 49k vocabulary
SLOW_REGEX = "([a-z]{2}[0-9]){1,3000}"


def _wait_for(condition, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.01)


def test_timed_out_compile_is_killed_and_not_remembered(smollm_info):
    c = GrammarCompiler(smollm_info, timeout_s=1.0)
    try:
        fut = c.compile_async("regex", SLOW_REGEX)
        _wait_for(lambda: c.workers.num_compiling() == 1)
        [pid] = c.workers.worker_pids()
        exc = fut.exception(timeout=60)
        assert isinstance(exc, GrammarCompileTimeout) and exc.param == "regex" and "longer than 1s" in str(exc)
        # the compile did not run on: its worker process was killed and reaped
        assert c.workers.num_compiling() == 0
        assert not os.path.exists(f"/proc/{pid}") if os.path.isdir("/proc") else True
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
        assert c.cache_len() == 0  # not remembered: a later request compiles it again
        compiled = c.compile("regex", "[ab]{2}")  # on a fresh worker
        assert isinstance(compiled, CompiledGrammar) and compiled.regex == "[ab]{2}"
        assert pid not in c.workers.worker_pids()
    finally:
        c.shutdown()


def test_a_worker_that_dies_fails_only_its_grammar(smollm_info):
    c = GrammarCompiler(smollm_info, timeout_s=600)
    try:
        fut = c.compile_async("regex", SLOW_REGEX)
        _wait_for(lambda: c.workers.num_compiling() == 1)
        [pid] = c.workers.compiling_pids()
        os.kill(pid, signal.SIGKILL)  # as a library crash would end it
        exc = fut.exception(timeout=60)
        assert isinstance(exc, UnsupportedGrammar) and exc.param == "regex" and "crashed" in str(exc)
        assert c.compile("regex", "[ab]{2}").regex == "[ab]{2}"
    finally:
        c.shutdown()


def test_shutdown_stops_the_workers_and_fails_compiles_in_flight(smollm_info):
    c = GrammarCompiler(smollm_info, timeout_s=600)
    fut = c.compile_async("regex", SLOW_REGEX)
    _wait_for(lambda: c.workers.num_compiling() == 1)
    [pid] = c.workers.compiling_pids()
    c.shutdown()
    with pytest.raises(ProcessLookupError):  # killed and reaped before shutdown returns
        os.kill(pid, 0)
    exc = fut.exception(timeout=60)
    assert isinstance(exc, ValueError) and "shut down" in str(exc)
    _wait_for(lambda: not c.workers.worker_pids())
    assert isinstance(c.compile_async("regex", "a").exception(timeout=5), ValueError)


def test_json_keys_are_jump_forwarded(smollm_compiler, smollm_tokenizer):
    schema = {"type": "object", "properties": {
        "customer_full_name": {"type": "string", "maxLength": 10},
        "shipping_address_line": {"type": "string", "maxLength": 10}},
        "required": ["customer_full_name", "shipping_address_line"]}
    g = Grammar(smollm_compiler.compile("json", json.dumps(schema)))
    assert g.try_jump_forward() == "{"      # then an optional space: two continuations
    assert g.accept_text('{"')
    forced = g.try_jump_forward()
    assert forced == 'customer_full_name"'
    assert g.jump_forward_accept(smollm_tokenizer.encode(forced, add_special_tokens=False))
    assert g.accept_text(':"Ann Lee"')
    assert g.try_jump_forward() is None      # "," or " ,"
    assert g.accept_text(',')
    assert g.try_jump_forward() is None      # '"' or ' "'
    assert g.accept_text('"')
    assert g.try_jump_forward() == 'shipping_address_line"'


def test_compact_whitespace_forces_more(smollm_info, smollm_tokenizer):
    c = GrammarCompiler(smollm_info, whitespace_pattern="")
    schema = {"type": "object", "properties": {"alpha_value": {"type": "integer"}, "beta_value": {"const": 1}},
              "required": ["alpha_value", "beta_value"]}
    g = Grammar(c.compile("json", json.dumps(schema)))
    assert g.try_jump_forward() == '{"alpha_value":'
    assert g.accept_text('{"alpha_value":42')
    assert g.try_jump_forward() is None      # more digits, or the comma
    assert g.accept_text(",")
    assert g.try_jump_forward() == '"beta_value":1}'
    ids = smollm_tokenizer.encode('"beta_value":1}', add_special_tokens=False)
    assert g.jump_forward_accept(ids) and g.is_accepting()
    c.shutdown()


def test_any_json_regex_shape():
    regex = any_json_object_regex(depth=2, whitespace_pattern="")
    for ok in ['{}', '{"a":1}', '{"a":[1,"x",null]}', '{"a":{"b":true}}', '{"a":"\\u00e9\\n"}']:
        assert re.fullmatch(regex, ok), ok
    for bad in ['[]', '{"a":{"b":{"c":1}}}', '{"a":01}', '{a:1}', '{"a":"\n"}']:
        assert not re.fullmatch(regex, bad), bad
    assert json_schema_to_regex(None, whitespace_pattern="") == regex


def test_integer_bounds_are_exact_in_the_regex():
    # outlines-core ignores minimum/maximum: every bounded integer becomes an exact range regex, wide
    # ranges and one-sided bounds included (the issue's {"minimum": 1, "maximum": 9999} produced 10121)
    schema = {"type": "object", "properties": {
        "a": {"type": "integer", "minimum": 1, "maximum": 3},
        "b": {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 3},
        "c": {"type": "integer", "minimum": 0},
        "d": {"type": "integer", "minimum": 1, "maximum": 9999},
        "e": {"enum": [{"type": "integer", "minimum": 0, "maximum": 1}]}}, "required": ["a", "b", "c", "d", "e"]}
    regex = json_schema_to_regex(schema, whitespace_pattern="")

    def doc(a=1, b=1, c=0, d=1):
        return f'{{"a":{a},"b":{b},"c":{c},"d":{d},"e":{{"type":"integer","minimum":0,"maximum":1}}}}'

    assert re.fullmatch(regex, doc()) and re.fullmatch(regex, doc(a=3, b=2, c=10**12, d=9999))
    for bad in (doc(a=0), doc(a=4), doc(b=0), doc(b=3), doc(c=-1), doc(d=0), doc(d=10000), doc(d=10121),
                doc(d="11111111111111111111111111111111"), doc(d="01")):
        assert not re.fullmatch(regex, bad), bad


@pytest.mark.parametrize("lo,hi", [(1, 9999), (0, 0), (-5, 5), (-120, -3), (None, 10), (7, None), (None, None),
                                   (-3, None), (None, -20), (99, 101), (123, 98765)])
def test_integer_range_regex_is_exact(lo, hi):
    import random
    pattern = re.compile(integer_range_regex(lo, hi))
    rng = random.Random(0)
    for x in [*range(-1100, 1100), *(rng.randrange(-10**7, 10**7) for _ in range(2000))]:
        inside = (lo is None or x >= lo) and (hi is None or x <= hi)
        assert bool(pattern.fullmatch(str(x))) == inside, (lo, hi, x)
    for bad in ("01", "-0", "00", "+1", "1.0", ""):
        assert not pattern.fullmatch(bad), bad


def test_shutdown_fails_queued_compiles(smollm_info):
    c = GrammarCompiler(smollm_info, num_workers=1)
    futures = [c.compile_async("regex", f"[a-z]{{{n}}}x") for n in range(1, 6)]
    c.shutdown()
    for fut in futures:
        exc = fut.exception(timeout=60)
        assert exc is None or (isinstance(exc, ValueError) and "shut down" in str(exc))
    assert any(fut.exception() is not None for fut in futures)
