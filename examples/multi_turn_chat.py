"""A multi-turn chat: roles render through the model's own chat template.

    python examples/multi_turn_chat.py
"""
from __future__ import annotations

import radixlang as sgl


@sgl.function
def chat(s, questions):
    s += sgl.system("You are a concise, friendly assistant.")
    for i, q in enumerate(questions):
        s += sgl.user(q)
        s += sgl.assistant(sgl.gen(f"answer_{i}", max_tokens=48))


def run(engine) -> None:
    """Run the program on `engine` (main() passes the embedded model; the tests a tiny one)."""
    state = chat.run(questions=["What is the capital of France?", "And how many people live there?"],
                     backend=engine, temperature=0)
    for m in state.messages():
        print(f"{m['role']:>9}: {m['content']}")
    print("cached tokens in the second turn:", state.get_meta_info("answer_1")["cached_tokens"])


def main() -> None:
    with sgl.Engine() as engine:  # the embedded SmolLM2-135M-Instruct
        run(engine)


if __name__ == "__main__":
    main()
