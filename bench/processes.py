"""``diffspec serve ROLE`` as a child process on a loopback port, for benchmarks.

The server binds ``127.0.0.1:0`` and prints ``diffspec ROLE listening on HOST:PORT``; the address is
read from that line, so runs never race for free ports. ``wait_serving`` is the health probe's
``--wait-for``: the server of this process, not another one on the same port. ``stop`` sends
SIGTERM (a graceful drain) and kills the process if it lingers.
"""

from __future__ import annotations

import os
import select
import signal
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path

from diffspec.health_probe import wait_for
from diffspec.settings import REPO_ROOT

START_TIMEOUT_S = 120.0  # until the "listening on" line
STOP_TIMEOUT_S = 15.0  # the drain after SIGTERM, before SIGKILL


def free_port() -> int:
    """A loopback port nobody listens on now (for a metrics endpoint)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class ServerProcess:
    start_timeout_s = START_TIMEOUT_S  # until the "listening on" line

    def __init__(
        self,
        role: str,
        log_path: Path,
        flags: list[str],
        env: dict[str, str],
        metrics_port: int = 0,
        listen: str = "127.0.0.1:0",
    ) -> None:
        """``env``: added to this process's environment; ``metrics_port``: Prometheus ``/metrics`` (0 = off);
        ``listen``: the address to bind (a restarted server can take its predecessor's)."""
        self.role = role
        self.log_path = log_path
        self.metrics_port = metrics_port
        command = [sys.executable, "-m", "cli", "serve", role, "--listen", listen]
        command += ["--metrics-port", str(metrics_port), *flags]
        with open(log_path, "w") as log:
            self.process = subprocess.Popen(
                command, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=log, text=True, env={**os.environ, **env}
            )
        self.address = self._read_address()

    def _read_address(self) -> str:
        ready, _, _ = select.select([self.process.stdout], [], [], self.start_timeout_s)
        line = self.process.stdout.readline() if ready else ""
        if "listening on" not in line:
            self.stop()
            raise RuntimeError(f"{self.role} did not start: {line!r}\n{self.log_path.read_text()}")
        return line.split()[-1]

    def wait_serving(self, timeout_s: float) -> None:
        serving, said = wait_for(self.address, self.process.pid, timeout_s)
        if not serving:
            raise RuntimeError(f"{self.role}: {said}\n{self.log_path.read_text()}")

    def scrape(self) -> dict[str, float]:
        """Every sample of the server's Prometheus page: ``'name{labels}' -> value``."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=10) as page:
            lines = page.read().decode().splitlines()
        samples = (line.rsplit(" ", 1) for line in lines if line[:1] not in ("", "#"))
        return {name: float(value) for name, value in samples}

    def stop(self) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)
        self.process.stdout.close()
        return self.process.returncode
