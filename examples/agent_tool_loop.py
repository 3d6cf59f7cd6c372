"""A small agent loop: select a tool, generate its JSON arguments, run it, answer.

    python examples/agent_tool_loop.py
"""
from __future__ import annotations

import json

import radixlang as sgl

TOOLS = {
    "calculator": ({"type": "object", "properties": {
                       "expression": {"type": "string", "pattern": "^[0-9+*/() .-]{1,24}$"}},
                    "required": ["expression"]},
                   lambda a: str(eval(a["expression"], {"__builtins__": {}}, {}))),  # demo only: trusted input
    "weather": ({"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
                lambda a: f"18 C and cloudy in {a['city']}"),
    "answer": (None, None),
}


@sgl.function
def agent(s, question, max_steps=3):
    s += sgl.system("You can use tools: calculator (arithmetic), weather (a city's weather), "
                    "or answer when you know enough.")
    s += sgl.user(question)
    for step in range(max_steps):
        s += sgl.assistant("Tool: " + sgl.select(f"tool_{step}", list(TOOLS)))
        tool = s[f"tool_{step}"]
        if tool == "answer":
            break
        schema, fn = TOOLS[tool]
        s += sgl.assistant("Arguments: " + sgl.gen(f"args_{step}", max_tokens=48, json_schema=schema))
        try:
            result = fn(json.loads(s[f"args_{step}"]))
        except Exception as e:  # the model's arguments may be unusable; tell it so
            result = f"error: {e}"
        s += sgl.user(f"Tool result: {result}")
    s += sgl.assistant(sgl.gen("final", max_tokens=64))


def run(engine) -> None:
    """Run the program on `engine` (main() passes the embedded model; the tests a tiny one)."""
    try:
        state = agent.run(question="What is 17 * 23?", backend=engine, temperature=0)
    except (RuntimeError, ValueError) as e:  # e.g. a server without constrained decoding
        print("the program failed:", e)
        return
    for m in state.messages():
        print(f"{m['role']:>9}: {m['content']}")


def main() -> None:
    with sgl.Engine() as engine:  # the embedded SmolLM2-135M-Instruct
        run(engine)


if __name__ == "__main__":
    main()
