"""Continuous batching: requests of concurrent sessions coalesce into one batched call.

Each session awaits its own request; a single worker task takes every request queued at that
moment (up to ``max_weight`` in total, e.g. tree tokens for the target), runs them as one
``run_batch`` in a worker thread, and resolves each session's future. A batch that fails is
retried one request at a time, so one bad request cannot fail its neighbours. The target
coalesces verify/decode steps this way, the draft its proposals.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Callable, Generic, TypeVar

Item = TypeVar("Item")
Result = TypeVar("Result")


@dataclass
class _Pending(Generic[Item, Result]):
    item: Item
    future: asyncio.Future[Result]


class Coalescer(Generic[Item, Result]):
    def __init__(
        self,
        run_batch: Callable[[list[Item]], list[Result]],
        weight: Callable[[Item], int],
        max_weight: int,
    ) -> None:
        self.run_batch = run_batch
        self.weight = weight
        self.max_weight = max_weight
        self._queue: asyncio.Queue[_Pending[Item, Result]] | None = None  # made in the loop that uses it
        self._worker: asyncio.Task[None] | None = None
        self.batch_sizes: list[int] = []  # requests per batched call, for stats and benchmarks

    @property
    def queue_depth(self) -> int:
        return self._queue.qsize() if self._queue is not None else 0

    async def submit(self, item: Item) -> Result:
        loop = asyncio.get_running_loop()
        if self._worker is None or self._worker.done() or self._worker.get_loop() is not loop:
            self._queue = asyncio.Queue()
            self._worker = loop.create_task(self._run(self._queue))
        future: asyncio.Future[Result] = loop.create_future()
        await self._queue.put(_Pending(item, future))
        return await future

    async def close(self) -> None:
        if self._worker is not None:
            self._worker.cancel()
            await asyncio.gather(self._worker, return_exceptions=True)

    async def _run(self, queue: asyncio.Queue[_Pending[Item, Result]]) -> None:
        while True:
            batch = [await queue.get()]
            weight = self.weight(batch[0].item)
            while not queue.empty():
                nxt = queue.get_nowait()
                if weight + self.weight(nxt.item) > self.max_weight:
                    queue.put_nowait(nxt)  # goes to the back; it leads the next batch soon enough
                    break
                batch.append(nxt)
                weight += self.weight(nxt.item)
            batch = [p for p in batch if not p.future.cancelled()]
            if batch:
                await self._execute(batch)

    async def _execute(self, batch: list[_Pending[Item, Result]]) -> None:
        self.batch_sizes.append(len(batch))
        try:
            results = await asyncio.to_thread(self.run_batch, [p.item for p in batch])
        except Exception as failure:  # noqa: BLE001 - isolate the failing request below
            if len(batch) == 1:
                _resolve(batch[0], failure)
                return
            for pending in batch:
                await self._execute([pending])
            return
        for pending, result in zip(batch, results):
            _resolve(pending, result)


def _resolve(pending: _Pending, outcome: object) -> None:
    if pending.future.done():
        return
    if isinstance(outcome, BaseException):
        pending.future.set_exception(outcome)
    else:
        pending.future.set_result(outcome)
