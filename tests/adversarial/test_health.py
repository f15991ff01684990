"""Health tells the truth: a gateway whose target stops answering is NOT_SERVING (HTTP /ready 503) and its
streams end UNAVAILABLE within the step timeout, until the target answers again; a draining server keeps
its listener open, answering NOT_SERVING and refusing new calls, until its in-flight streams are done."""

from __future__ import annotations

import json
import signal
import time
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from diffspec.v1 import gateway_pb2, gateway_pb2_grpc
from tests.gateway.conftest import CODE_PROMPTS, generate
from tests.adversarial.conftest import STEP_TIMEOUT_S
from tests.gateway.servers import ServerProcess, wait_until


def health(server: ServerProcess) -> int:
    """The server's overall health status, asked on a fresh channel (so a closed listener shows)."""
    with grpc.insecure_channel(server.address) as channel:
        return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=3).status


def http_address(server: ServerProcess) -> str:
    """The HTTP API's host:port, from the line the server prints once it listens."""
    line = server.process.stdout.readline()
    assert "OpenAI-compatible HTTP API on http://" in line, line
    return line.split("http://", 1)[1].split("/", 1)[0]


def ready(address: str) -> tuple[int, str]:
    """/ready's (status, body status)."""
    try:
        with urllib.request.urlopen(f"http://{address}/ready", timeout=5) as reply:
            return reply.status, json.loads(reply.read())["status"]
    except urllib.error.HTTPError as refused:
        return refused.code, json.loads(refused.read())["status"]


@pytest.mark.slow
def test_a_hung_target_makes_the_gateway_not_serving_and_ends_its_streams_unavailable(bounded_deployment):
    gateway, target, http = bounded_deployment.trio.gateway, bounded_deployment.trio.target, bounded_deployment.http
    try:
        assert health(gateway) == health_pb2.HealthCheckResponse.SERVING and ready(http) == (200, "ready")
        with gateway.channel() as channel:
            stub = gateway_pb2_grpc.GatewayStub(channel)
            call = stub.Generate(gateway_pb2.GenerateRequest(text=CODE_PROMPTS[0], max_new_tokens=2000), timeout=60)
            next(call)
            target.process.send_signal(signal.SIGSTOP)
            stopped = time.monotonic()
            with pytest.raises(grpc.RpcError) as ended:
                list(call)
            assert ended.value.code() == grpc.StatusCode.UNAVAILABLE
            assert time.monotonic() - stopped < STEP_TIMEOUT_S + 3
            wait_until(lambda: health(gateway) == health_pb2.HealthCheckResponse.NOT_SERVING, 5, "NOT_SERVING")
            assert ready(http) == (503, "the target unreachable")
            target.process.send_signal(signal.SIGCONT)
            wait_until(lambda: health(gateway) == health_pb2.HealthCheckResponse.SERVING, 10, "SERVING again")
            assert ready(http) == (200, "ready")
            ids, _, stats = generate(stub, text=CODE_PROMPTS[1], max_new_tokens=8)
            assert len(ids) == 8 and stats is not None
    finally:
        target.process.send_signal(signal.SIGCONT)


@pytest.mark.slow
def test_a_draining_server_answers_not_serving_until_its_streams_end(draft_head_dir, tmp_path: Path):
    flags = ["--shutdown-grace-seconds", "4", "--http-listen", "127.0.0.1:0"]
    server = ServerProcess("all", tmp_path, *flags, env={"DIFFSPEC_DRAFT_MODEL": str(draft_head_dir)})
    try:
        http = http_address(server)
        server.wait_serving()
        with server.channel() as channel:
            stub = gateway_pb2_grpc.GatewayStub(channel)
            call = stub.Generate(gateway_pb2.GenerateRequest(text=CODE_PROMPTS[2], max_new_tokens=5000), timeout=60)
            next(call)
            started = time.monotonic()
            server.process.send_signal(signal.SIGTERM)
            wait_until(lambda: health(server) == health_pb2.HealthCheckResponse.NOT_SERVING, 2, "NOT_SERVING")
            assert ready(http) == (503, "draining")
            with pytest.raises(grpc.RpcError) as refused:
                generate(stub, text="def f():", max_new_tokens=4)
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE and "draining" in refused.value.details()
            assert time.monotonic() - started < 3  # all of it inside the grace, the listener still open
            with pytest.raises(grpc.RpcError):
                list(call)  # cancelled once the 4 s grace is over, long before 5000 tokens
        assert server.process.wait(timeout=15) == 0
        with pytest.raises(grpc.RpcError) as gone:
            health(server)
        assert gone.value.code() == grpc.StatusCode.UNAVAILABLE  # the listener closed with the drain
    finally:
        server.stop()
