"""diffspec/heap.py: startup's objects leave the collector's generations; later ones stay in them."""

from __future__ import annotations

import gc
import weakref

from diffspec.devices import free_gpu_memory
from diffspec.heap import freeze_startup_heap, startup_heap_frozen


class Node:
    def __init__(self) -> None:
        self.peer = self  # a reference cycle: only the cyclic collector frees it


def test_freezing_takes_startups_objects_out_of_every_collection_and_frees_its_garbage_first():
    alive, garbage = Node(), Node()
    collected = weakref.ref(garbage)
    del garbage
    try:
        frozen = freeze_startup_heap()
        assert frozen > 0 and gc.get_freeze_count() > 0  # frozen objects freed by their counts leave it since
        tracked = {id(o) for o in gc.get_objects()}
        assert id(alive) not in tracked  # frozen: no collection walks it
        assert collected() is None  # collected before the freeze, not frozen with the rest
        later = Node()
        assert id(later) in {id(o) for o in gc.get_objects()}  # what serving creates is still collected
    finally:
        gc.unfreeze()


def test_a_frozen_block_thaws_after_it_so_a_model_dropped_in_it_is_freed():
    model = Node()
    dropped = weakref.ref(model)
    with startup_heap_frozen() as frozen:
        assert frozen > 0
        del model
        gc.collect()
        assert dropped() is not None  # frozen: unreachable, yet no collection walks it
    assert gc.get_freeze_count() == 0
    gc.collect()
    assert dropped() is None


def test_freeing_the_gpus_memory_thaws_a_frozen_heap_first():
    model = Node()
    dropped = weakref.ref(model)
    try:
        freeze_startup_heap()
        del model
        free_gpu_memory()  # what a protocol does before its judging loads models
        assert gc.get_freeze_count() == 0 and dropped() is None
    finally:
        gc.unfreeze()
