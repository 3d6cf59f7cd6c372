"""Streaming: print a generation as it is produced (sync and async).

    python examples/streaming.py
"""
from __future__ import annotations

import asyncio

import radixlang as sgl


@sgl.function
def story(s, topic):
    s += sgl.user(f"Write a three-sentence story about {topic}.")
    s += sgl.assistant(sgl.gen("story", max_tokens=80))


async def stream_async(engine) -> None:
    state = story.run(topic="a lighthouse", backend=engine, stream=True, temperature=0.7)
    async for delta in state.text_async_iter("story"):
        print(delta, end="", flush=True)
    print()


def run(engine) -> None:
    """Run the program on `engine` (main() passes the embedded model; the tests a tiny one)."""
    state = story.run(topic="a robot cat", backend=engine, stream=True, temperature=0)
    for delta in state.text_iter("story"):
        print(delta, end="", flush=True)
    print("\n---")
    asyncio.run(stream_async(engine))


def main() -> None:
    with sgl.Engine() as engine:  # the embedded SmolLM2-135M-Instruct
        run(engine)


if __name__ == "__main__":
    main()
