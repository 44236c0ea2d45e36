"""The statistics of a running pipeline, gathered by its collector from every process: typed
for code, and as Prometheus text.

Run it with ``python docs/examples/observing.py`` (``runtime.prometheus`` needs
``pip install 'tokenyard[metrics]'``).
"""

from __future__ import annotations

import anyio
from prometheus_client.parser import text_string_to_metric_families

from actors import Pipeline
from runtime import GetMetrics, metrics
from runtime.prometheus import render

# A series of this program's own, gathered with the pipeline's.
ASKED = metrics.counter("demo_prompts_total", "Prompts this demo sent.")


async def main() -> None:
    async with Pipeline(workers=2) as pipeline:
        for prompt in ("Hello there", "Bonjour à tous", "你好, 世界"):
            await pipeline.generate(prompt, max_new_tokens=8)
            ASKED.labels().inc()

        # Typed: one ProcessMetrics per process, one ActorMetrics per actor.
        gathered = await pipeline.collector.ask(GetMetrics())
        for process in gathered.processes:
            for actor in process.actors:
                box = actor.mailbox
                print(
                    f"{actor.ref.name} (pid {process.process.pid}): {box.handled} handled, "
                    f"{box.queued} queued, {process.process.rss_bytes >> 20} MiB resident"
                )

        # As Prometheus text, what every serve worker answers on GET /metrics.
        text = render(gathered).decode()
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name in (
                    "tokenyard:time_to_first_token_seconds_count",
                    "tokenyard:generation_tokens_total",
                    "demo_prompts_total",
                ):
                    print(f"{sample.name} {sample.value:g}")
    print("pipeline closed")


if __name__ == "__main__":
    anyio.run(main)
