"""A service that dies or comes back, a gateway that dies, a server that drains, a gateway whose
target never came up."""

from __future__ import annotations

import signal
import time
from typing import Iterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from diffspec.v1 import gateway_pb2, gateway_pb2_grpc
from tests.gateway.conftest import CODE_PROMPTS, generate
from tests.gateway.servers import ServerProcess, SplitDeployment, draft_info, free_port, target_info, wait_until

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


@pytest.mark.slow
def test_a_killed_draft_turns_streams_to_auto_and_a_restarted_one_is_used_again(deployment, auto_reference):
    text = CODE_PROMPTS[0]
    with grpc.insecure_channel(deployment.gateway.address) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        ids, stats = stream_then(stub, text, 3, deployment.draft.kill)
        assert isinstance(stats, gateway_pb2.GenerationStats), stats
        assert ids == auto_reference(text, MAX_NEW) and stats.fell_back_to_auto
        # later requests find the draft gone at once and run Auto from the start
        again, _, again_stats = generate(stub, text=text, max_new_tokens=MAX_NEW, policy="full")
        assert again == ids and again_stats.fell_back_to_auto
        deployment.restart_draft()  # at the same address; the gateway's next draft step opens a fresh stream
        deadline = time.monotonic() + 30  # the gateway's channel retries the address with backoff
        while True:
            back, _, back_stats = generate(stub, text=text, max_new_tokens=32, policy="full")
            if not back_stats.fell_back_to_auto or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert back == auto_reference(text, 32) and not back_stats.fell_back_to_auto
        assert back_stats.steps < 32 and sum(back_stats.stop_depth_histogram[1:]) > 0  # drafts were accepted
    info = target_info(deployment)
    assert info.num_free_pages == info.num_pages and info.active_sessions == 0
    assert draft_info(deployment).active_sessions == 0


@pytest.mark.slow
def test_target_killed_mid_stream_ends_unavailable_after_a_right_prefix(deployment, auto_reference):
    text = CODE_PROMPTS[1]
    with grpc.insecure_channel(deployment.gateway.address) as channel:
        ids, failure = stream_then(gateway_pb2_grpc.GatewayStub(channel), text, 3, deployment.target.kill)
    assert isinstance(failure, grpc.RpcError) and failure.code() == grpc.StatusCode.UNAVAILABLE, failure
    assert "target service unavailable" in failure.details()
    assert len(ids) >= 3 and ids == auto_reference(text, MAX_NEW)[: len(ids)]
    assert draft_info(deployment).active_sessions == 0


def step_streams_ended(server: ServerProcess, service: str) -> dict[str, float]:
    """Status code -> Step calls of ``service`` that ended at ``server``, from its metrics."""
    method = f'method="/diffspec.v1.{service}/Step"'
    return {
        name.split('code="')[1].split('"')[0]: value
        for name, value in server.scrape().items()
        if name.startswith("diffspec_requests_total{") and method in name
    }


@pytest.mark.slow
def test_one_step_stream_carries_a_gateways_sessions_and_a_killed_gateway_frees_them(draft_head_dir, tmp_path):
    """Four generations at once are four sessions at the target and at the draft, all on one Step
    stream each: when the gateway dies, that one stream ends and frees all of them."""
    trio = SplitDeployment(tmp_path, draft_head_dir, metrics=True)
    try:
        with grpc.insecure_channel(trio.gateway.address) as channel:
            stub = gateway_pb2_grpc.GatewayStub(channel)
            calls = [
                stub.Generate(gateway_pb2.GenerateRequest(text=text, max_new_tokens=2000, policy="full"), timeout=60)
                for text in CODE_PROMPTS
            ]
            for call in calls:
                next(call)

            def counts() -> tuple[int, int]:
                return target_info(trio).active_sessions, draft_info(trio).active_sessions

            wait_until(lambda: counts() == (4, 4), 10, "four sessions at the target and at the draft")
            assert step_streams_ended(trio.target, "Target") == {} and step_streams_ended(trio.draft, "Draft") == {}
            trio.gateway.kill()
            for call in calls:
                call.cancel()
        wait_until(lambda: counts() == (0, 0), 10, "the dead gateway's sessions freed")
        info = target_info(trio)
        assert info.num_free_pages == info.num_pages
        # one stream each ended, cancelled by the gateway's death: it carried all four sessions
        assert step_streams_ended(trio.target, "Target") == {"CANCELLED": 1}
        assert step_streams_ended(trio.draft, "Draft") == {"CANCELLED": 1}
    finally:
        trio.stop()


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
    gateway = ServerProcess("gateway", tmp_path, "--target", f"127.0.0.1:{free_port()}", "--peer-wait-seconds", "60")
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
        gateway.kill()
        gateway.stop()


def test_a_gateway_waiting_for_its_target_stops_at_once_on_sigterm(tmp_path):
    gateway = ServerProcess("gateway", tmp_path, "--target", f"127.0.0.1:{free_port()}", "--peer-wait-seconds", "60")
    try:
        time.sleep(0.5)
        gateway.process.send_signal(signal.SIGTERM)
        assert gateway.process.wait(timeout=5) == 0
    finally:
        gateway.kill()
        gateway.stop()
