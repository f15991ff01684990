"""The collector's view of a serving process: what startup leaves alive is frozen out of every later collection.

Why. Python's cyclic collector now and then walks every tracked object (a full collection), and every thread
waits while it does. A process that has imported torch, Triton and transformers and loaded its models holds
millions of such objects, nearly all of them alive until it exits: on an H100 host one full collection took
0.3 s inside a timed 4K request (24 ms a step where its neighbours took 9; ``bench/RESULTS.md``, the stalls of
the reproduction protocol). ``gc.freeze`` moves everything alive into a generation no collection walks, as
vLLM's engine does once it is up, so a full collection walks only what serving created since.

Frozen objects are never freed, even once unreachable, so whatever drops a model before the process ends
(a server's close, a benchmark that loads the next model) thaws the heap first (``thaw_heap``).
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


def freeze_startup_heap() -> int:
    """Collect what startup left unreachable, then freeze every object still alive; returns how many are frozen.
    Call once the models are loaded and warmed up, before the first request is timed or served."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def thaw_heap() -> None:
    """Give every frozen object back to the collector: the next collection frees those no longer reachable."""
    gc.unfreeze()


@contextlib.contextmanager
def startup_heap_frozen() -> Iterator[int]:
    """The heap frozen for the block (a benchmark's timed runs), thawed after it; yields how many are frozen."""
    try:
        yield freeze_startup_heap()
    finally:
        thaw_heap()
