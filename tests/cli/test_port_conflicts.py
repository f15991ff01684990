"""Every port a server binds, taken by another process: the server exits 2 within seconds with one line
naming the address, before any model loads (``tests/cli/test_readme.py`` covers ``serve`` on a port that
another gRPC server holds)."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from typing import Iterator

import pytest

from diffspec.settings import REPO_ROOT


@pytest.fixture
def taken_port() -> Iterator[int]:
    """A port another process listens on (plain TCP, no SO_REUSEPORT)."""
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        yield holder.getsockname()[1]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


CASES = {
    "target-grpc": lambda taken, free: ["serve", "target", "--listen", f"127.0.0.1:{taken}"],
    "split-gateway-grpc": lambda taken, free: ["serve", "gateway", "--listen", f"127.0.0.1:{taken}", "--target",
                                               f"127.0.0.1:{free}"],  # fmt: skip
    "http": lambda taken, free: ["serve", "--listen", f"127.0.0.1:{free}", "--http-listen", f"127.0.0.1:{taken}"],
    "metrics": lambda taken, free: ["serve", "draft", "--listen", f"127.0.0.1:{free}", "--metrics-port", str(taken)],
}


@pytest.mark.parametrize("case", CASES)
def test_a_taken_port_stops_the_server_with_one_line(case, taken_port):
    started = time.monotonic()
    run = subprocess.run(
        [sys.executable, "-m", "cli", *CASES[case](taken_port, free_port())],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert run.returncode == 2, run.stderr
    errors = [line for line in run.stderr.splitlines() if line.startswith("diffspec: error:")]
    assert len(errors) == 1 and f"cannot listen on 127.0.0.1:{taken_port}" in errors[0], run.stderr
    assert "Traceback" not in run.stderr and "ready" not in run.stdout, run.stderr
    assert time.monotonic() - started < 60
