"""Run ``diffspec serve ROLE`` as a child process on a loopback port, and query it, for the gRPC tests.

Each server binds ``127.0.0.1:0`` and prints the port it got, so tests never race for free
ports (a restarted server binds the address its predecessor had). ``stop`` sends SIGTERM (a
graceful drain) and kills the process if it lingers.
"""

from __future__ import annotations

import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bench.processes import ServerProcess as BenchServerProcess
from bench.processes import free_port
from diffspec.v1 import draft_pb2, draft_pb2_grpc, target_pb2, target_pb2_grpc

START_TIMEOUT_S = 90.0
# 64 KiB messages: a prompt's features cross the wire in many chunks. No warm-up: on the CPU it compiles nothing
# and records no graph, only proposes (13 of a server's 16 s to serving); the README's and the docs' commands
# (tests/cli/test_readme.py, tests/docs) start servers that warm up as users' do.
COMMON_FLAGS = [
    "--warm-up",
    "off",
    "--num-pages",
    "1024",
    "--shutdown-grace-seconds",
    "1",
    "--keepalive-seconds",
    "10",
    "--max-message-bytes",
    "65536",
]


class ServerProcess(BenchServerProcess):
    """The benchmarks' server process, with what the tests add: the common test flags, a TLS-aware
    health wait and channel, and SIGKILL."""

    start_timeout_s = START_TIMEOUT_S

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
        self.credentials = credentials
        log_path = log_dir / f"{role}-{time.monotonic_ns()}.log"
        metrics_port = free_port() if metrics else 0
        super().__init__(role, log_path, [*COMMON_FLAGS, *flags], env or {}, metrics_port, listen)

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
