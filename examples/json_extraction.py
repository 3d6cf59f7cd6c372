"""Extract structured data with a JSON schema (constrained decoding).

    python examples/json_extraction.py
"""
from __future__ import annotations

import json

import radixlang as sgl

SCHEMA = {"type": "object",
          "properties": {"name": {"type": "string"}, "age": {"type": "integer"}, "city": {"type": "string"}},
          "required": ["name", "age", "city"]}


@sgl.function
def extract(s, passage):
    s += sgl.user("Extract the person's name, age and city as JSON.\n\n" + passage)
    s += sgl.assistant(sgl.gen("person", max_tokens=64, json_schema=SCHEMA))


def run(engine) -> None:
    """Run the program on `engine` (main() passes the embedded model; the tests a tiny one)."""
    state = extract.run(passage="Maria Lopez, 34, moved to Lisbon last spring to open a bakery.",
                        backend=engine, temperature=0)
    if state.error() is not None:
        print("generation failed:", state.error())
        return
    try:
        person = json.loads(state["person"])
    except json.JSONDecodeError:  # the schema holds for every prefix, but max_tokens can cut the object short
        print("incomplete JSON (raise max_tokens):", state["person"])
        return
    print(json.dumps(person, indent=2))


def main() -> None:
    with sgl.Engine() as engine:  # the embedded SmolLM2-135M-Instruct
        run(engine)


if __name__ == "__main__":
    main()
