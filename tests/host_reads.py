"""Which ops of a piece of work read a tensor's values back to the host: on a GPU each one waits for every
kernel queued before it. Run on the CPU under the profiler, so a test of device-side code catches them
without a GPU (CUDA's sync debug mode, which needs one, names them by source line instead)."""

from __future__ import annotations

from typing import Callable

from torch.profiler import ProfilerActivity, profile

# ops whose result size or value the host needs: a scalar read (``item``, indexing with a 0-dim tensor, ``int()``)
# and the ops whose output shape depends on the data
READBACK_OPS = frozenset({"aten::_local_scalar_dense", "aten::nonzero", "aten::masked_select", "aten::_unique2"})


def host_reads(work: Callable[[], object]) -> list[str]:
    """The read-back ops ``work`` ran, in order."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        work()
    return [event.name for event in prof.events() if event.name in READBACK_OPS]
