"""Continuous batching: verify/decode steps of concurrent sessions coalesce into one forward.

Each session awaits its own step; a single worker task takes every step queued at that
moment (up to ``max_batch_tokens`` tree tokens), runs them as one ``verify_batch`` in a
thread, and resolves each session's future. A batch that fails is retried one step at a
time, so one bad request cannot fail its neighbours.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from target_service.backend import VerifyResult
from target_service.runtime import TargetRuntime, VerifyStep


@dataclass
class _Pending:
    step: VerifyStep
    future: asyncio.Future[VerifyResult]


class StepBatcher:
    def __init__(self, runtime: TargetRuntime, max_batch_tokens: int) -> None:
        self.runtime = runtime
        self.max_batch_tokens = max_batch_tokens
        self._queue: asyncio.Queue[_Pending] | None = None  # made in the event loop that uses it
        self._worker: asyncio.Task[None] | None = None
        self.batch_sizes: list[int] = []  # sessions per forward, for stats and tests

    @property
    def queue_depth(self) -> int:
        return self._queue.qsize() if self._queue is not None else 0

    async def submit(self, step: VerifyStep) -> VerifyResult:
        loop = asyncio.get_running_loop()
        if self._worker is None or self._worker.done() or self._worker.get_loop() is not loop:
            self._queue = asyncio.Queue()
            self._worker = loop.create_task(self._run(self._queue))
        future: asyncio.Future[VerifyResult] = loop.create_future()
        await self._queue.put(_Pending(step, future))
        return await future

    async def close(self) -> None:
        if self._worker is not None:
            self._worker.cancel()
            await asyncio.gather(self._worker, return_exceptions=True)

    async def _run(self, queue: asyncio.Queue[_Pending]) -> None:
        while True:
            batch = [await queue.get()]
            tokens = batch[0].step.tree.num_nodes
            while not queue.empty():
                nxt = queue.get_nowait()
                if tokens + nxt.step.tree.num_nodes > self.max_batch_tokens:
                    queue.put_nowait(nxt)  # goes to the back; it leads the next batch soon enough
                    break
                batch.append(nxt)
                tokens += nxt.step.tree.num_nodes
            batch = [p for p in batch if not p.future.cancelled()]
            if batch:
                await self._execute(batch)

    async def _execute(self, batch: list[_Pending]) -> None:
        self.batch_sizes.append(len(batch))
        try:
            results = await asyncio.to_thread(self.runtime.verify_batch, [p.step for p in batch])
        except Exception as failure:  # noqa: BLE001 - isolate the failing step below
            if len(batch) == 1:
                _resolve(batch[0], failure)
                return
            for pending in batch:
                await self._execute([pending])
            return
        for pending, result in zip(batch, results):
            _resolve(pending, result)


def _resolve(pending: _Pending, outcome: VerifyResult | BaseException) -> None:
    if pending.future.done():
        return
    if isinstance(outcome, BaseException):
        pending.future.set_exception(outcome)
    else:
        pending.future.set_result(outcome)
