"""``TokenizerPool``: prompt text -> token ids on a few threads of the gateway's own, admitted like a request.

Tokenizing a long text costs seconds of CPU and much memory, so it is kept off the pool that other
work shares (a flood of huge texts then slows only other tokenizations, never a running stream),
and at most ``max_in_flight`` tokenizations are admitted at once, running or waiting for a thread;
the next one gets RESOURCE_EXHAUSTED at once, as Generate does when the engine is full.
"""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, TypeVar

from diffspec.errors import ResourceExhausted

T = TypeVar("T")


class TokenizerPool:
    def __init__(self, num_threads: int, max_in_flight: int) -> None:
        self.num_threads = num_threads
        self.max_in_flight = max_in_flight  # admitted tokenizations, running or queued for a thread
        self._slots = threading.BoundedSemaphore(max_in_flight)
        self._executor = ThreadPoolExecutor(num_threads, thread_name_prefix="tokenize")

    async def run(self, tokenize: Callable[..., T], *args: object) -> T:
        """``tokenize(*args)`` on a pool thread; a slot is held until the thread is done with it,
        so a cancelled caller cannot free a slot whose work still runs."""
        if not self._slots.acquire(blocking=False):
            raise ResourceExhausted(f"{self.max_in_flight} tokenizations are in flight; retry later")
        try:
            job: Future[T] = self._executor.submit(tokenize, *args)
        except BaseException:
            self._slots.release()
            raise
        job.add_done_callback(lambda _: self._slots.release())
        return await asyncio.wrap_future(job)

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
