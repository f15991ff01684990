"""Turn the ``device`` and ``dtype`` settings into torch objects, and move small tensors without a stream sync."""

from __future__ import annotations

import array
import gc
import itertools
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from diffspec.errors import InvalidRequest
from diffspec.heap import thaw_heap

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    """auto = the first CUDA/ROCm GPU when there is one, else the CPU. A GPU comes back with its index
    (``cuda`` is ``cuda:0``), so it compares equal to the device of the tensors made on it."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(name)
    except RuntimeError as bad:
        raise InvalidRequest(f"unknown device {name!r}: {bad}") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise InvalidRequest(f"device {name!r} asked for, but no GPU is visible")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """auto = float32 on the CPU (exact tests), bfloat16 on a GPU."""
    if name == "auto":
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    if name not in _DTYPES:
        raise InvalidRequest(f"unknown dtype {name!r}; expected one of {sorted(_DTYPES)}")
    return _DTYPES[name]


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def free_gpu_memory() -> None:
    """Return the blocks of tensors no longer referenced to the GPU, so that a model loaded next can use them
    (dropped models in reference cycles need the collector first, and a frozen heap thawed: ``diffspec.heap``)."""
    thaw_heap()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def host_int64(values: Iterable[int]) -> torch.Tensor:
    """``values`` as a CPU int64 tensor. Through ``array``'s C loop: ``torch.tensor`` on a list of Python ints
    costs about three times as much (7 ms against 2 for a 64K prompt's tokens and positions on a 2-core host)."""
    packed = array.array("q", values)
    return torch.frombuffer(packed, dtype=torch.int64) if packed else torch.empty(0, dtype=torch.int64)


def upload(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``host`` on ``device`` without a stream sync. A copy from pageable memory waits for every kernel
    already queued; one from pinned memory does not (the caching host allocator keeps the pinned block
    until its copy is done), so a step's small inputs go up while the GPU still runs the last step."""
    if host.device.type != "cpu" or device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


@dataclass
class _Staged:
    """One pinned host buffer and the event of the last copy out of it."""

    host: torch.Tensor  # [capacity] int64, pinned
    read: torch.cuda.Event | None = None  # recorded after the last copy was queued


class PinnedStaging:
    """Small per-step int64 uploads staged through host buffers pinned once and reused.

    ``upload`` pins a new buffer per call, and pinning allocates from the driver whenever the host
    cache has no free block: such an allocation takes a driver lock and can stall for milliseconds. A
    buffer is reused once the device has read its last upload; while every buffer is still waiting to
    be read (uploads queued behind a long proposal, say), a new one joins the ring rather than the host
    waiting for the device."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._ring: list[_Staged] = []

    @property
    def num_buffers(self) -> int:
        return len(self._ring)

    def upload(self, *parts: Sequence[int]) -> torch.Tensor:
        """``parts`` one after another as an int64 tensor on the device, without a stream sync or a wait for the
        device. A long upload's parts are written into the staged buffer one by one, a ``range`` as an arange
        (``_fill``): a 64K prompt's tokens and positions go up without a joined list of 131K Python ints."""
        size = sum(len(part) for part in parts)
        if self.device.type != "cuda":
            host = torch.empty(size, dtype=torch.int64)
            _fill(host, parts)
            return host.to(self.device)
        staged = self._free(size)
        host = staged.host[:size]
        _fill(host, parts)
        on_device = host.to(self.device, non_blocking=True)
        staged.read = torch.cuda.Event()
        staged.read.record(torch.cuda.current_stream(self.device))
        return on_device

    def _free(self, size: int) -> _Staged:
        """A buffer of at least ``size`` whose last upload the device has read: reused, grown, or new."""
        done = [s for s in self._ring if s.read is None or s.read.query()]
        fitting = [s for s in done if s.host.numel() >= size]
        if fitting:
            return fitting[0]
        capacity = max(64, 2 * size)
        if done:  # grow a free one rather than add another
            done[0].host = torch.empty(capacity, dtype=torch.int64, pin_memory=True)
            return done[0]
        self._ring.append(_Staged(torch.empty(capacity, dtype=torch.int64, pin_memory=True)))
        return self._ring[-1]


_PER_PART_MIN = 4096  # ints in an upload from which each part is written on its own


def _fill(host: torch.Tensor, parts: tuple[Sequence[int], ...]) -> None:
    """Write ``parts`` one after another into ``host`` [sum of their lengths] int64: a step's few ints in one
    conversion (a copy per part would cost more than they do), a prompt's part by part."""
    if host.numel() < _PER_PART_MIN:
        host.copy_(host_int64(itertools.chain(*parts)))
        return
    at = 0
    for part in parts:
        stop = at + len(part)
        if isinstance(part, range) and part.step == 1:
            torch.arange(part.start, part.stop, out=host[at:stop])
        elif part:
            host[at:stop].copy_(host_int64(part))
        at = stop


class HostCopy:
    """A device tensor's copy to the host, queued behind the work that computes it: the host waits for it
    only when it first reads it (``get``), not when the copy is asked for. On a CPU it is there at once."""

    def __init__(self, source: torch.Tensor) -> None:
        self._done: torch.cuda.Event | None = None
        if source.device.type != "cuda":
            self._host = source
            return
        self._host = torch.empty(source.shape, dtype=source.dtype, pin_memory=True)
        self._host.copy_(source, non_blocking=True)
        self._done = torch.cuda.Event()
        self._done.record(torch.cuda.current_stream(source.device))

    def get(self) -> torch.Tensor:
        if self._done is not None:
            self._done.synchronize()
            self._done = None
        return self._host


class DeviceTimer:
    """Seconds from ``start`` to ``stop`` as the device runs them: CUDA events mark two points of the
    device's queue, so work queued behind a pending proposal is timed from when it starts, and reading
    the span later costs no wait. On a CPU, where work is done when its call returns, the wall clock."""

    def __init__(self, device: torch.device) -> None:
        self._stream = torch.cuda.current_stream(device) if device.type == "cuda" else None
        self._marks: list[torch.cuda.Event | float] = []

    def start(self) -> None:
        self._marks = [self._mark()]

    def stop(self) -> None:
        self._marks.append(self._mark())

    def seconds(self) -> float:
        """The span, once ``stop`` has run on the device (waits for it if it has not)."""
        started, stopped = self._marks
        if isinstance(started, float) and isinstance(stopped, float):
            return stopped - started
        assert isinstance(started, torch.cuda.Event) and isinstance(stopped, torch.cuda.Event)
        stopped.synchronize()
        return started.elapsed_time(stopped) / 1e3

    def _mark(self) -> torch.cuda.Event | float:
        if self._stream is None:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record(self._stream)
        return event
