"""Turn the ``device`` and ``dtype`` settings into torch objects, and move small tensors without a stream sync."""

from __future__ import annotations

import time

import torch

from diffspec.errors import InvalidRequest

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


def upload(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``host`` on ``device`` without a stream sync. A copy from pageable memory waits for every kernel
    already queued; one from pinned memory does not (the caching host allocator keeps the pinned block
    until its copy is done), so a step's small inputs go up while the GPU still runs the last step."""
    if host.device.type != "cpu" or device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def copy_in(target: torch.Tensor, host: torch.Tensor) -> None:
    """``target`` (on a device) filled from ``host`` without a stream sync (see ``upload``)."""
    if host.device.type != "cpu" or target.device.type != "cuda":
        target.copy_(host)
        return
    target.copy_(host.pin_memory(), non_blocking=True)


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
        self._done.record()

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
