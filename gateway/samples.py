"""``n`` independent samples of one prompt, merged into one stream of chunks tagged with their index.

Sample i is the request with ``n = 1`` and ``sampling.for_sample(i)``: sample 0 keeps the request's
seed, the others get distinct seeds derived from it, so a seeded request repeats; greedy samples
are all the same. All n are submitted at once and share a ``PromptShare``: the first to open
computes the prompt while the others wait unopened; then they fork its target session's prompt
pages (copy-on-write, each computing only the last prompt position for its own first token) and
start their drafts on its prompt features, so the prompt is computed once. Closing the stream
aborts every sample; one sample's failure ends the stream with its error.
"""

from __future__ import annotations

import asyncio
from contextlib import aclosing
from dataclasses import replace
from typing import AsyncIterator

from gateway.engine import SpeculativeEngine
from gateway.request import GenerationChunk, GenerationRequest, PromptShare


async def generate_samples(
    engine: SpeculativeEngine, request: GenerationRequest, timeout: float | None = None
) -> AsyncIterator[GenerationChunk]:
    """Every sample's chunks as they come, each with its ``index``; each sample's last chunk carries its stats.

    ``timeout``: seconds the whole request (every sample) may take."""
    if request.n == 1:
        async with aclosing(engine.generate(request, timeout)) as chunks:
            async for chunk in chunks:
                yield chunk
        return
    merged: asyncio.Queue[GenerationChunk | BaseException] = asyncio.Queue()
    share = PromptShare(forks_left=request.n - 1)

    async def run(index: int) -> None:
        sample = replace(request, n=1, sampling=request.sampling.for_sample(index), prompt_share=share)
        try:
            async with aclosing(engine.generate(sample, timeout)) as chunks:
                async for chunk in chunks:
                    merged.put_nowait(replace(chunk, index=index))
        except Exception as failure:  # noqa: BLE001 - handed to the reader, which raises it
            merged.put_nowait(failure)

    tasks = [asyncio.create_task(run(index)) for index in range(request.n)]
    try:
        running = request.n
        while running:
            item = await merged.get()
            if isinstance(item, BaseException):
                raise item
            running -= item.stats is not None
            yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
