"""A few DSL programs on the embedded SmolLM2: select, stop, roles, regex and JSON gens."""
from __future__ import annotations

import json
import re

import jsonschema
import pytest

import radixlang as sgl

pytestmark = pytest.mark.e2e

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"]}


@pytest.fixture(scope="module")
def engine(smollm_path):
    with sgl.Engine(max_total_tokens=8192) as e:
        yield e
        e.check_memory_leak()


def test_select_stop_regex_and_json_on_smollm(engine):
    @sgl.function
    def prog(s, review):
        s += "Review: I loved it, wonderful film.\nSentiment: positive\n"
        s += "Review: Dull and far too long.\nSentiment: negative\n"
        s += "Review: " + review + "\nSentiment:" + sgl.select("label", [" positive", " negative"]) + "\n"
        s += "Q: What is 12 + 30?\nA:" + sgl.gen("sum", max_tokens=8, stop="\n")
        s += "\nYear:" + sgl.gen("year", regex=r" (19|20)[0-9]{2}")
        s += sgl.user("Maria is 34. Reply with her name and age as JSON.")
        s += sgl.assistant(sgl.gen("person", max_tokens=48, json_schema=PERSON))

    states = prog.run_batch([{"review": "Brilliant, I would watch it again."},
                             {"review": "Terrible acting and a boring plot."}], backend=engine, temperature=0)
    for st in states:
        assert st.error() is None, st.error()
        assert "\n" not in st["sum"]
        assert re.fullmatch(r" (19|20)[0-9]{2}", st["year"])
        jsonschema.validate(json.loads(st["person"]), PERSON)
    assert [st["label"] for st in states] == [" positive", " negative"]
