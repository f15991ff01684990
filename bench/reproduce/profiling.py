"""Nsight Systems around the protocol: the run re-executes itself under ``nsys profile``, which records
only between the CUDA profiler start and stop that bracket the first evaluated prompt's arms at the
first context (the NVTX range of each run names its arm), so the report holds steady-state steps,
not loading, warm-up or tuning."""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import sys
import time
from typing import Iterator

from bench.reproduce.presets import ProtocolConfig, default_out_dir

NSYS_MISSING = (
    "--nsys: no `nsys` on PATH. Install Nsight Systems (it ships with the CUDA toolkit, e.g. "
    "/usr/local/cuda/bin/nsys) or drop --nsys; nothing was run."
)


def nsys_command(argv: list[str], config: ProtocolConfig, nsys: str) -> list[str]:
    """The same reproduce command under nsys, writing into the run's results folder."""
    out_dir = config.out_dir or default_out_dir(config.preset, time.time())
    inner = [a for a in argv if a != "--nsys"]
    if config.out_dir is None:
        inner += ["--out-dir", str(out_dir)]
    return [
        nsys, "profile", "--trace=cuda,nvtx,osrt", "--capture-range=cudaProfilerApi", "--capture-range-end=stop",
        f"--output={out_dir / 'nsys_profile'}", "--force-overwrite=true",
        sys.executable, "-m", "bench.reproduce", *inner, "--profile-window",
    ]


def run_under_nsys(argv: list[str], config: ProtocolConfig) -> int:
    nsys = shutil.which("nsys")
    if nsys is None:
        print(NSYS_MISSING, file=sys.stderr)
        return 2
    command = nsys_command(argv, config, nsys)
    print("running:", " ".join(command), flush=True)
    return subprocess.run(command, check=False).returncode


@contextlib.contextmanager
def profiled(active: bool) -> Iterator[None]:
    """The CUDA profiler on inside the block when ``active`` and a GPU is present."""
    import torch

    on = active and torch.cuda.is_available()
    if on:
        torch.cuda.synchronize()
        torch.cuda.profiler.start()
    try:
        yield
    finally:
        if on:
            torch.cuda.synchronize()
            torch.cuda.profiler.stop()


@contextlib.contextmanager
def nvtx_range(name: str) -> Iterator[None]:
    """An NVTX range on a GPU (what the Nsight timeline shows per run); nothing elsewhere."""
    import torch

    on = torch.cuda.is_available()
    if on:
        torch.cuda.nvtx.range_push(name)
    try:
        yield
    finally:
        if on:
            torch.cuda.nvtx.range_pop()
