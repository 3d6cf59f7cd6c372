"""Fork: expand several tips in parallel; the shared prefix is prefilled once.

    python examples/parallel_tips.py
"""
from __future__ import annotations

import radixlang as sgl


@sgl.function
def tips(s, topic):
    s += f"Here are two tips for {topic}: 1. Balanced diet. 2. Regular exercise.\n\n"
    forks = s.fork(2)
    for i, f in enumerate(forks):
        f += f"Now, expand tip {i + 1} into a paragraph:\n"
        f += sgl.gen("detailed_tip", max_tokens=64, stop="\n\n")
    forks.join()
    s += "Tip 1: " + s["detailed_tip"][0] + "\n"
    s += "Tip 2: " + s["detailed_tip"][1] + "\n"
    s += "In summary," + sgl.gen("summary", max_tokens=32)


def run(engine) -> None:
    """Run the program on `engine` (main() passes the embedded model; the tests a tiny one)."""
    state = tips.run(topic="staying healthy", backend=engine, temperature=0)
    print(state.text())


def main() -> None:
    with sgl.Engine() as engine:  # the embedded SmolLM2-135M-Instruct
        run(engine)


if __name__ == "__main__":
    main()
