"""Record a CUDA graph the one way every graph here is recorded, and pick the padded shape a step runs as."""

from __future__ import annotations

from typing import Callable, Sequence, TypeVar

import torch

Outputs = TypeVar("Outputs")


def graph_bucket(
    batch: int, tree: int, batch_sizes: Sequence[int], tree_sizes: Sequence[int]
) -> tuple[int, int] | None:
    """The smallest (batch, tree) bucket, sizes ascending, that holds ``batch`` trees of at most ``tree`` nodes:
    the shape a target step graph pads them to, and so what its verify costs; None past the largest."""
    fitting_batch = next((b for b in batch_sizes if b >= batch), None)
    fitting_tree = next((t for t in tree_sizes if t >= tree), None)
    if fitting_batch is None or fitting_tree is None:
        return None
    return fitting_batch, fitting_tree


def record_graph(
    run: Callable[[], Outputs],
    pool: tuple[int, int] | None,
    device: torch.device,
    after_warm_up: Callable[[], object] | None = None,
) -> tuple[torch.cuda.CUDAGraph, Outputs]:
    """Run ``run`` once on a side stream, then capture it -> (graph, the static outputs of the capture).

    The warm-up run compiles Triton kernels, lets cuBLAS pick its kernels and makes lazy
    allocations outside the capture; ``after_warm_up`` undoes what it wrote that a replay must
    not see. Capture errors are thread-local: other threads of the process (the draft beside the
    target) keep launching their own work while this one records.
    """
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        run()
    torch.cuda.current_stream(device).wait_stream(side)
    if after_warm_up is not None:
        after_warm_up()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
        outputs = run()
    return graph, outputs
