"""Chunks the engine thread hands to clients, held until the host next waits for the device.

Why: handing a chunk wakes the thread that streams it (an asyncio loop, a gRPC worker), and that thread then
takes the interpreter's lock from the engine thread at its next torch call. Handed right after a verify's
results, that delay fell on the host's path from those results to the next verify's launch, every
iteration. Held until the target has queued the next step's device work and is about to wait for its results,
the streaming threads run while the engine thread sleeps. What a step still holds at its end (a step with no
verify, a target over the wire that never calls back) is handed then. The price: a chunk reaches its stream
up to one step later, at the next verify's wait.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

from gateway.request import GenerationChunk
from gateway.running_request import OutputSink

log = logging.getLogger(__name__)


class Outbox:
    """One engine's held deliveries, in the order they were made; used from the engine thread only."""

    def __init__(self) -> None:
        self._held: list[Callable[[], None]] = []  # the held sinks append to this very list

    def holding(self, sink: OutputSink) -> OutputSink:
        """``sink`` with its chunks and failure held here until ``flush``."""
        return _HeldSink(sink, self._held)

    def flush(self) -> None:
        """Hand everything held to its sink; a sink that fails (its client's loop closing under it) fails alone."""
        held = list(self._held)
        self._held.clear()
        for deliver in held:
            try:
                deliver()
            except Exception:  # noqa: BLE001 - one client's stream never stops another's
                log.exception("handing a chunk to its stream failed")


class _HeldSink:
    def __init__(self, sink: OutputSink, held: list[Callable[[], None]]) -> None:
        self._sink, self._held = sink, held

    def put(self, chunk: GenerationChunk) -> None:
        self._held.append(functools.partial(self._sink.put, chunk))

    def fail(self, error: BaseException) -> None:
        self._held.append(functools.partial(self._sink.fail, error))
