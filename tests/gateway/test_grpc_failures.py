"""A service that dies, a server that drains, a gateway whose target never came up."""

from __future__ import annotations

import signal
import socket
import time
from typing import Iterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from diffspec.v1 import gateway_pb2, gateway_pb2_grpc
from tests.gateway.conftest import CODE_PROMPTS, generate
from tests.gateway.servers import ServerProcess, SplitDeployment, draft_info, target_info

MAX_NEW = 300  # ~3 s: the kill lands mid-stream


@pytest.fixture
def deployment(draft_head_dir, tmp_path) -> Iterator[SplitDeployment]:
    """A fresh trio per test: these tests kill its members."""
    trio = SplitDeployment(tmp_path, draft_head_dir)
    yield trio
    trio.stop()


def stream_then(stub: gateway_pb2_grpc.GatewayStub, text: str, after_chunks: int, action) -> tuple[list[int], object]:
    """Stream a long generation, run ``action`` after a few chunks; (token ids received, final stats or RpcError)."""
    ids: list[int] = []
    outcome: object = None
    call = stub.Generate(gateway_pb2.GenerateRequest(text=text, max_new_tokens=MAX_NEW, policy="full"), timeout=60)
    try:
        for n, response in enumerate(call):
            ids += response.token_ids
            if n + 1 == after_chunks:
                action()
            if response.HasField("stats"):
                outcome = response.stats
    except grpc.RpcError as failure:
        outcome = failure
    return ids, outcome


def test_draft_killed_mid_stream_finishes_with_auto(deployment, auto_reference):
    text = CODE_PROMPTS[0]
    with grpc.insecure_channel(deployment.gateway.address) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        ids, stats = stream_then(stub, text, 3, deployment.draft.kill)
        assert isinstance(stats, gateway_pb2.GenerationStats), stats
        assert ids == auto_reference(text, MAX_NEW) and stats.fell_back_to_auto
        # later requests find the draft gone at once and run Auto from the start
        again, _, again_stats = generate(stub, text=text, max_new_tokens=MAX_NEW, policy="full")
        assert again == ids and again_stats.fell_back_to_auto
    info = target_info(deployment)
    assert info.num_free_pages == info.num_pages and info.active_sessions == 0


def test_target_killed_mid_stream_ends_unavailable_after_a_right_prefix(deployment, auto_reference):
    text = CODE_PROMPTS[1]
    with grpc.insecure_channel(deployment.gateway.address) as channel:
        ids, failure = stream_then(gateway_pb2_grpc.GatewayStub(channel), text, 3, deployment.target.kill)
    assert isinstance(failure, grpc.RpcError) and failure.code() == grpc.StatusCode.UNAVAILABLE, failure
    assert "target service unavailable" in failure.details()
    assert len(ids) >= 3 and ids == auto_reference(text, MAX_NEW)[: len(ids)]
    assert draft_info(deployment).active_sessions == 0


def test_sigterm_drains_then_cancels_in_flight_streams(draft_head_dir, tmp_path):
    server = ServerProcess("all", tmp_path, env={"DIFFSPEC_DRAFT_MODEL": str(draft_head_dir)})
    try:
        server.wait_serving()
        with grpc.insecure_channel(server.address) as channel:
            watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(), timeout=30)
            assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
            stub = gateway_pb2_grpc.GatewayStub(channel)
            call = stub.Generate(gateway_pb2.GenerateRequest(text=CODE_PROMPTS[2], max_new_tokens=5000), timeout=60)
            next(call)
            started = time.monotonic()
            server.process.send_signal(signal.SIGTERM)
            assert next(watch).status == health_pb2.HealthCheckResponse.NOT_SERVING
            with pytest.raises(grpc.RpcError):
                list(call)  # cancelled once the 1 s grace is over, long before 5000 tokens
            assert time.monotonic() - started < 10
        assert server.process.wait(timeout=15) == 0
    finally:
        server.stop()


def test_gateway_is_not_serving_until_its_target_answers(tmp_path):
    with socket.socket() as nobody_listens:
        nobody_listens.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{nobody_listens.getsockname()[1]}"
        gateway = ServerProcess("gateway", tmp_path, "--target", dead, "--peer-wait-seconds", "60")
        try:
            with grpc.insecure_channel(gateway.address) as channel:
                time.sleep(0.5)  # still waiting for the target, not about to be ready
                health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
                assert health.status == health_pb2.HealthCheckResponse.NOT_SERVING
                with pytest.raises(grpc.RpcError) as refused:
                    generate(gateway_pb2_grpc.GatewayStub(channel), text="def f():", max_new_tokens=4)
                assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
                assert "still loading" in refused.value.details()
        finally:
            assert gateway.stop() == 0
