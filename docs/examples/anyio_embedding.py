"""A `Pipeline` embedded in a plain anyio program: no web framework, one ``anyio.run``.

The pipeline's processes start when the ``async with`` block is entered and are gone when it
is left. Requests may come from any task of the loop, one at a time or many at once.

Run it with ``python docs/examples/anyio_embedding.py``.
"""

from __future__ import annotations

import anyio

from actors import GenerateResult, Pipeline

PROMPTS = ["Hello there", "Bonjour à tous", "def f(x): return x", "你好, 世界"]


async def main() -> None:
    async with Pipeline(workers=2) as pipeline:
        # One at a time.
        result = await pipeline.generate("Once upon a time", max_new_tokens=16)
        print(
            f"worker {result.worker}: {result.completion_tokens} tokens "
            f"({result.finish_reason}): {result.text!r}"
        )

        # Many at once, from tasks of a task group: the workers share them.
        results: dict[str, GenerateResult] = {}

        async def one(prompt: str) -> None:
            results[prompt] = await pipeline.generate(prompt, max_new_tokens=12)

        async with anyio.create_task_group() as tg:
            for prompt in PROMPTS:
                tg.start_soon(one, prompt)
        for prompt in PROMPTS:
            r = results[prompt]
            print(f"worker {r.worker}: {prompt!r} -> {r.text!r}")

        # Streamed, piece by piece; joined, the pieces are the whole text.
        pieces = [piece async for piece in pipeline.stream("Hello there", max_new_tokens=12)]
        print(f"streamed {len(pieces)} pieces: {pieces}")
        assert "".join(pieces) == results["Hello there"].text
    print("pipeline closed: every worker process stopped")


if __name__ == "__main__":
    anyio.run(main)
