"""Few-shot sentiment classification with select, batched with run_batch on the embedded model.

    python examples/few_shot_select.py
"""
from __future__ import annotations

import radixlang as sgl

SHOTS = """Classify the sentiment of each review as positive or negative.
Review: I loved every minute of it. Sentiment: positive
Review: A waste of two hours. Sentiment: negative
Review: The actors were wonderful. Sentiment: positive
"""

DATA = [("What a delightful surprise.", "positive"), ("Boring and far too long.", "negative"),
        ("I would watch it again tomorrow.", "positive"), ("The plot made no sense at all.", "negative"),
        ("Brilliant from start to finish.", "positive"), ("I walked out halfway through.", "negative")]


@sgl.function
def classify(s, review):
    s += SHOTS  # the constant prefix: traced and prefilled once for the whole batch
    s += "Review: " + review + " Sentiment:" + sgl.select("label", [" positive", " negative"])


def run(engine) -> None:
    """Run the program on `engine` (main() passes the embedded model; the tests a tiny one)."""
    states = classify.run_batch([{"review": r} for r, _ in DATA], backend=engine, progress_bar=True)
    correct = 0
    for (review, gold), state in zip(DATA, states):
        label = state["label"].strip()
        correct += label == gold
        scores = state.get_meta_info("label")["normalized_prompt_logprobs"]
        print(f"{label:8s} (gold {gold:8s}) scores={[round(x, 3) for x in scores]}  {review}")
    print(f"accuracy: {correct}/{len(DATA)}")


def main() -> None:
    with sgl.Engine() as engine:  # the embedded SmolLM2-135M-Instruct
        run(engine)


if __name__ == "__main__":
    main()
