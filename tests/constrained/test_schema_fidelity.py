"""Schema fidelity on every backend: what a backend accepts, it enforces; the rest is refused.

For each schema of the corpus (the random-walk schemas and OpenAI-structured-outputs-style
ones) and each backend: either compiling it is refused with an UnsupportedGrammar that names
the keyword and the backend, or random walks through the grammar (tokens drawn uniformly from
the allowed mask, as sampling at temperature 1 from a flat model would; hypothesis picks the
seeds) produce only documents that ``jsonschema`` accepts. The sets of refused schemas are
asserted exactly, so a backend that starts (or stops) enforcing a keyword shows up here.
"""

from __future__ import annotations

import datetime
import json
import random
import re

import jsonschema
import pytest
import torch
from hypothesis import Phase, given, settings
from hypothesis import strategies as st
from schema_corpus import OPENAI_STYLE
from test_random_walk import SCHEMAS as WALK_SCHEMAS

from radixlang.constrained import BACKENDS, GrammarCompiler, TokenizerInfo, UnsupportedGrammar
from radixlang.kernels.bitmask import unpack_bitmask

CORPUS = {**WALK_SCHEMAS, **OPENAI_STYLE}

# schema -> the keyword a refusal names, per backend
REFUSED = {
    "outlines": {"price_bounds": "minimum", "tuple": "prefixItems", "tags_unique": "uniqueItems",
                 "one_of_overlap": "oneOf", "multiple_of": "multipleOf", "min_properties": "minProperties",
                 "not_keyword": "not", "times": "ipv4", "all_of": "allOf"},
    # xgrammar: length-bounded strings allow raw control characters and a dot in an optional pattern
    # group matches any character, so minLength/maxLength/pattern (and the formats spelled as patterns)
    # are refused
    "xgrammar": {"all_of": "allOf", "times": "time", "tags_unique": "uniqueItems", "one_of_overlap": "oneOf",
                 "multiple_of": "multipleOf", "min_properties": "minProperties", "not_keyword": "not",
                 "nested": "maxLength", "optional": "maxLength", "any_of": "maxLength", "nullable": "maxLength",
                 "str_len": "minLength", "escapes": "maxLength", "unicode": "maxLength", "pattern": "pattern",
                 "date": "date", "calendar_event": "maxLength", "math_reasoning": "maxLength",
                 "entity_extraction": "maxLength", "user_profile": "date-time", "payment_one_of": "pattern",
                 "defs_refs": "maxLength", "order": "pattern", "tuple": "maxLength"},
    "llguidance": {"tags_unique": "uniqueItems", "one_of_overlap": "oneOf", "multiple_of": "multipleOf",
                   "min_properties": "minProperties", "not_keyword": "not"},
}
# schemas outside a backend's language that its compiler rejects (not a policy refusal)
COMPILE_ERRORS: dict[str, set[str]] = {"outlines": set(), "xgrammar": set(), "llguidance": set()}

_RFC3339_TIME = r"([01][0-9]|2[0-3]):[0-5][0-9]:([0-5][0-9]|60)(\.[0-9]+)?([Zz]|[+-]([01][0-9]|2[0-3]):[0-5][0-9])"
FORMATS = jsonschema.FormatChecker()


@FORMATS.checks("date-time")
def _date_time(value: object) -> bool:  # jsonschema checks it only with rfc3339-validator installed
    if not isinstance(value, str):
        return True
    m = re.fullmatch(r"([0-9]{4}-[0-9]{2}-[0-9]{2})[Tt]" + _RFC3339_TIME, value)
    return bool(m) and _date(m.group(1))


@FORMATS.checks("date")
def _date(value: object) -> bool:
    if not isinstance(value, str):
        return True
    try:
        return bool(re.fullmatch(r"[0-9]{4}-[0-9]{2}-[0-9]{2}", value)) and bool(datetime.date.fromisoformat(value))
    except ValueError:
        return False


@FORMATS.checks("time")
def _time(value: object) -> bool:
    return not isinstance(value, str) or bool(re.fullmatch(_RFC3339_TIME, value))


@pytest.fixture(scope="module")
def padded_info(smollm_tokenizer) -> TokenizerInfo:
    # the model's logits are wider than the tokenizer: ids past it must never be allowed
    return TokenizerInfo.from_tokenizer(smollm_tokenizer, vocab_size=len(smollm_tokenizer) + 37)


COMPILER_INFO = "padded_info"  # the vocabulary the shared `compilers` fixture (conftest.py) compiles for


_CLOSERS = (b'"', b"}", b"]")
_TABLES: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]] = {}


def _tables(info: TokenizerInfo) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(spellable-or-EOS bool [vocab], EOS ids, single-byte ids, closer ids) of a tokenizer."""
    if id(info) not in _TABLES:
        spellable = torch.tensor([bool(b) for b in info.token_bytes])
        spellable[info.eos_token_ids] = True
        single = [i for i, b in enumerate(info.token_bytes) if b and len(b) == 1]
        closers = [i for i in single if info.token_bytes[i] in _CLOSERS]
        _TABLES[id(info)] = (spellable, torch.tensor(info.eos_token_ids), torch.tensor(single),
                             torch.tensor(closers))
    return _TABLES[id(info)]


def walk(grammar, rng: random.Random, *, explore_steps: int = 30, max_steps: int = 1500) -> bytes:
    """Draw tokens uniformly from the allowed mask, then close the document; checks the mask each step.

    Every step: the mask allows some token, allows EOS exactly when the grammar accepts, allows no
    token without bytes (specials, padding ids) but EOS, and agrees with accept_token on a sample.
    After ``explore_steps`` it takes EOS when allowed, else a closing quote/bracket or a single byte.
    """
    info = grammar.compiled.tokenizer_info
    spellable, eos_ids, single_ids, closer_ids = _tables(info)
    row = torch.zeros(info.num_words(), dtype=torch.int32)
    out = bytearray()
    for step in range(max_steps):
        grammar.allowed_token_mask(row)
        allowed = unpack_bitmask(row.unsqueeze(0), info.vocab_size)[0]
        ids = allowed.nonzero().flatten()
        assert ids.numel(), f"a live state must allow some token (after {bytes(out)!r})"
        eos = eos_ids[allowed[eos_ids]]
        assert bool(eos.numel()) == grammar.is_accepting(), bytes(out)
        assert not (allowed & ~spellable).any(), "a token without bytes (special, padding) is allowed"
        for t in rng.sample(range(info.vocab_size), 4):
            if not allowed[t]:
                assert not grammar.copy().accept_token(t), (t, bytes(out))
        if step < explore_steps:
            token = int(ids[rng.randrange(ids.numel())])
        elif eos.numel():
            token = int(eos[0])
        else:
            closers, single = closer_ids[allowed[closer_ids]], single_ids[allowed[single_ids]]
            # closers half the time (a closer can also be content, as "}" inside a string)
            options = next((o for o in ((closers, single) if rng.random() < 0.5 else (single,)) if o.numel()), ids)
            token = int(options[rng.randrange(options.numel())])
        assert grammar.accept_token(token), (token, bytes(out))
        if grammar.is_terminated():
            return bytes(out)
        out += info.token_bytes[token]
    raise AssertionError(f"no EOS after {max_steps} steps: {bytes(out)[:200]!r}")


def _compile_or_refusal(compiler: GrammarCompiler, schema: dict):
    try:
        return compiler.compile("json", json.dumps(schema)), None
    except UnsupportedGrammar as e:
        return None, e


@pytest.mark.parametrize("backend", BACKENDS)
def test_refusals_are_exactly_the_expected_ones(backend, compilers):
    refused = {}
    for name, schema in CORPUS.items():
        if name in COMPILE_ERRORS[backend]:
            with pytest.raises(ValueError):
                compilers[backend].compile("json", json.dumps(schema))
            continue
        _, err = _compile_or_refusal(compilers[backend], schema)
        if err is not None:
            refused[name] = err
            assert err.param == "json_schema"
            assert backend in str(err) and REFUSED[backend].get(name, "?") in str(err), str(err)
    assert set(refused) == set(REFUSED[backend])


_WALKED = [(b, n) for b in BACKENDS for n in sorted(CORPUS) if n not in REFUSED[b] and n not in COMPILE_ERRORS[b]]


@pytest.mark.parametrize("backend, name", _WALKED)
@settings(max_examples=3, deadline=None, derandomize=True, database=None, phases=(Phase.generate,))
@given(seed=st.integers(min_value=0, max_value=2**32 - 1))
def test_every_sampled_document_validates(backend, name, seed, compilers):
    schema = CORPUS[name]
    compiled = compilers[backend].compile("json", json.dumps(schema))
    text = walk(compiled.new_grammar(), random.Random(seed)).decode("utf-8")
    doc = json.loads(text)
    errors = [e.message for e in jsonschema.Draft202012Validator(schema, format_checker=FORMATS).iter_errors(doc)]
    assert not errors, (backend, name, text, errors)


def test_issue_24_integer_bounds_hold_on_every_backend(compilers):
    schema = OPENAI_STYLE["issue_id_bounds"]
    for backend, compiler in compilers.items():
        compiled = compiler.compile("json", json.dumps(schema))
        for seed in range(8):
            doc = json.loads(walk(compiled.new_grammar(), random.Random(seed), explore_steps=60))
            assert 1 <= doc["id"] <= 9999, (backend, doc)
