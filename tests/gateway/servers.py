"""Run ``diffspec serve ROLE`` as a child process on a loopback port, and query it, for the gRPC tests.

Each server binds ``127.0.0.1:0`` and prints the port it got, so tests never race for free
ports (a restarted server binds the address its predecessor had). ``stop`` sends SIGTERM (a
graceful drain) and kills the process if it lingers.
"""

from __future__ import annotations

import os
import select
import socket
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from diffspec.settings import REPO_ROOT
from diffspec.v1 import draft_pb2, draft_pb2_grpc, target_pb2, target_pb2_grpc

START_TIMEOUT_S = 90.0
# 64 KiB messages: a prompt's features cross the wire in many chunks
COMMON_FLAGS = [
    "--num-pages",
    "1024",
    "--shutdown-grace-seconds",
    "1",
    "--keepalive-seconds",
    "10",
    "--max-message-bytes",
    "65536",
]


def free_port() -> int:
    """A loopback port nobody listens on now (for HTTP endpoints and dead addresses)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class ServerProcess:
    def __init__(
        self,
        role: str,
        log_dir: Path,
        *flags: str,
        env: dict[str, str] | None = None,
        listen: str = "127.0.0.1:0",
        metrics: bool = False,
        credentials: grpc.ChannelCredentials | None = None,
    ) -> None:
        """``metrics``: serve Prometheus metrics on ``self.metrics_port`` (see ``scrape``);
        ``credentials``: what ``wait_serving`` connects with to a TLS server."""
        self.role = role
        self.credentials = credentials
        self.log_path = log_dir / f"{role}-{time.monotonic_ns()}.log"
        self.metrics_port = free_port() if metrics else 0
        command = [
            sys.executable,
            "-m",
            "cli",
            "serve",
            role,
            "--listen",
            listen,
            *COMMON_FLAGS,
            *(["--metrics-port", str(self.metrics_port)] if metrics else []),
            *flags,
        ]
        with open(self.log_path, "w") as log:
            self.process = subprocess.Popen(
                command, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=log, text=True, env={**os.environ, **(env or {})}
            )
        self.address = self._read_address()

    def _read_address(self) -> str:
        """The ``host:port`` from the server's one stdout line."""
        ready, _, _ = select.select([self.process.stdout], [], [], START_TIMEOUT_S)
        line = self.process.stdout.readline() if ready else ""
        if "listening on" not in line:
            self.stop()
            raise RuntimeError(f"{self.role} did not start: {line!r}\n{self.log_path.read_text()}")
        return line.split()[-1]

    def wait_serving(self, timeout: float = START_TIMEOUT_S) -> None:
        """Poll the standard health check until the server says SERVING."""
        deadline = time.monotonic() + timeout
        with self.channel() as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            while time.monotonic() < deadline:
                if self.process.poll() is not None:
                    raise RuntimeError(f"{self.role} exited:\n{self.log_path.read_text()}")
                try:
                    reply = stub.Check(health_pb2.HealthCheckRequest(), timeout=2)
                    if reply.status == health_pb2.HealthCheckResponse.SERVING:
                        return
                except grpc.RpcError:
                    pass  # not up yet
                time.sleep(0.1)
        raise TimeoutError(f"{self.role} not SERVING after {timeout} s:\n{self.log_path.read_text()}")

    def channel(self) -> grpc.Channel:
        """A channel to this server: TLS with ``credentials`` when given, else plaintext."""
        if self.credentials is None:
            return grpc.insecure_channel(self.address)
        return grpc.secure_channel(self.address, self.credentials)

    def kill(self) -> None:
        """SIGKILL: the process vanishes mid-stream, as a crashed service would."""
        self.process.kill()
        self.process.wait(timeout=10)

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
                self.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)
        self.process.stdout.close()
        return self.process.returncode


class SplitDeployment:
    """Target, draft and gateway as three processes; the target and the draft load in parallel.

    ``metrics``: the target and the draft serve Prometheus metrics (``server.scrape()``);
    ``service_flags``: the target's and the draft's extra flags (TLS, a token);
    ``credentials``: how the tests' own channels reach TLS servers (``ServerProcess.channel``)."""

    def __init__(
        self,
        log_dir: Path,
        draft_dir: Path,
        *gateway_flags: str,
        metrics: bool = False,
        service_flags: tuple[str, ...] = (),
        credentials: grpc.ChannelCredentials | None = None,
    ) -> None:
        self.log_dir = log_dir
        self.env = {"DIFFSPEC_DRAFT_MODEL": str(draft_dir)}
        self.servers: list[ServerProcess] = []
        services = dict(env=self.env, metrics=metrics, credentials=credentials)
        try:
            self.target = self._start(ServerProcess("target", log_dir, *service_flags, **services))
            self.draft = self._start(ServerProcess("draft", log_dir, *service_flags, **services))
            peers = ["--target", self.target.address, "--draft", self.draft.address]
            self.gateway = self._start(
                ServerProcess("gateway", log_dir, *peers, *gateway_flags, env=self.env, credentials=credentials)
            )
            for server in self.servers:
                server.wait_serving()
        except BaseException:
            self.stop()
            raise

    def _start(self, server: ServerProcess) -> ServerProcess:
        self.servers.append(server)
        return server

    def restart_draft(self) -> None:
        """A fresh draft process at the address the gateway knows (the old one must be gone)."""
        self.servers.remove(self.draft)
        self.draft = self._start(ServerProcess("draft", self.log_dir, env=self.env, listen=self.draft.address))
        self.draft.wait_serving()

    def stop(self) -> None:
        for server in reversed(self.servers):
            server.stop()


def target_info(deployment: SplitDeployment) -> target_pb2.TargetInfoResponse:
    with grpc.insecure_channel(deployment.target.address) as channel:
        return target_pb2_grpc.TargetStub(channel).Info(target_pb2.TargetInfoRequest(), timeout=5)


def draft_info(deployment: SplitDeployment) -> draft_pb2.DraftInfoResponse:
    with grpc.insecure_channel(deployment.draft.address) as channel:
        return draft_pb2_grpc.DraftStub(channel).Info(draft_pb2.DraftInfoRequest(), timeout=5)


def wait_until(condition, timeout: float, what: str) -> None:  # noqa: ANN001 - () -> bool
    """Poll ``condition`` every 50 ms; fail the test after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout} s: {what}")
        time.sleep(0.05)


def wait_all_released(deployment: SplitDeployment, timeout: float = 3.0) -> target_pb2.TargetInfoResponse:
    """Poll until the target's pool is whole and neither service holds a session; the last target info.

    3 s is far less than a long test generation takes, so only a cancel that reached the
    services frees everything in time."""
    deadline = time.monotonic() + timeout
    while True:
        info = target_info(deployment)
        clean = info.num_free_pages == info.num_pages and info.active_sessions == 0
        if (clean and draft_info(deployment).active_sessions == 0) or time.monotonic() > deadline:
            return info
        time.sleep(0.05)
