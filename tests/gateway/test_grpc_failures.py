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
from tests.gateway.servers import (
    ServerProcess,
    SplitDeployment,
    draft_info,
    free_port,
    target_info,
    wait_all_released,
    wait_until,
)

MAX_NEW = 300  # ~3 s on a quiet machine: the kill lands mid-stream
CALL_TIMEOUT_S = 300  # only a hung call reaches it, however busy the machine
CONNECT_S = 10  # a loopback connection and its HTTP/2 handshake, on a busy machine


@pytest.fixture
def deployment(draft_head_dir, tmp_path) -> Iterator[SplitDeployment]:
    """A fresh trio per test: these tests kill its members. The gateway waits for the draft's trees as long
    as it takes (``--draft-timeout-seconds``): on a busy machine a slow draft is not a late one, so whether
    a step verifies drafted tokens depends on the draft being there, not on the load."""
    trio = SplitDeployment(tmp_path, draft_head_dir, "--draft-timeout-seconds", str(CALL_TIMEOUT_S))
    yield trio
    trio.stop()


def reconnect_seconds(down_s: float) -> float:
    """How soon after a peer comes back, at the latest, a channel that has been retrying it since
    ``down_s`` seconds ago tries again: gRPC's reconnect backoff waits 1 s, then 1.6 times as long each
    time (+-20 % jitter, at most 120 s), so each wait is under 0.9 times the time already waited + 1.2 s."""
    return 0.9 * down_s + 1.2


def stream_then(stub: gateway_pb2_grpc.GatewayStub, text: str, after_chunks: int, action) -> tuple[list[int], object]:
    """Stream a long generation, run ``action`` after a few chunks; (token ids received, final stats or RpcError)."""
    ids: list[int] = []
    outcome: object = None
    request = gateway_pb2.GenerateRequest(text=text, max_new_tokens=MAX_NEW, policy="full")
    call = stub.Generate(request, timeout=CALL_TIMEOUT_S)
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
        before_kill = time.monotonic()
        ids, stats = stream_then(stub, text, 3, deployment.draft.kill)
        assert isinstance(stats, gateway_pb2.GenerationStats), stats
        assert ids == auto_reference(text, MAX_NEW) and stats.fell_back_to_auto
        # later requests find the draft gone at once and run Auto from the start
        again, _, again_stats = generate(stub, CALL_TIMEOUT_S, text=text, max_new_tokens=32, policy="full")
        assert again == auto_reference(text, 32) and again_stats.fell_back_to_auto
        deployment.restart_draft()  # at the same address; the gateway's next draft step opens a fresh stream
        # The gateway's channel has retried the address since the kill, with gRPC's backoff, so its next try
        # may come a while after the restart (the longer the draft was down, the longer), and until then
        # requests run Auto. A request that starts once that try is surely made and connected finds the draft.
        connected_by = time.monotonic() + reconnect_seconds(time.monotonic() - before_kill) + CONNECT_S
        while True:
            started = time.monotonic()
            back, _, back_stats = generate(stub, CALL_TIMEOUT_S, text=text, max_new_tokens=32, policy="full")
            if not back_stats.fell_back_to_auto or started > connected_by:
                break
            time.sleep(0.2)
        assert back == auto_reference(text, 32) and not back_stats.fell_back_to_auto
        assert back_stats.steps < 32 and sum(back_stats.stop_depth_histogram[1:]) > 0  # drafts were accepted
    info = wait_all_released(deployment, timeout=10)  # a release goes out with the loop's next iteration
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
        # one stream each ended with the gateway's death: it carried all four sessions. A killed peer's stream
        # reads EOF first, with the call not yet cancelled; it ends CANCELLED if the cancel arrives while the
        # handler still releases the sessions, else OK (grpc.aio; CI runs have seen both): either is that one stream
        for service, server in (("Target", trio.target), ("Draft", trio.draft)):
            ended = step_streams_ended(server, service)
            assert sum(ended.values()) == 1 and set(ended) <= {"CANCELLED", "OK"}, (service, ended)
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
    """It does not wait out its peer wait: it exits in a fraction of it (however slowly a busy machine runs
    its shutdown), with status 0."""
    peer_wait_s = 60
    gateway = ServerProcess(
        "gateway", tmp_path, "--target", f"127.0.0.1:{free_port()}", "--peer-wait-seconds", str(peer_wait_s)
    )
    try:
        time.sleep(0.5)
        gateway.process.send_signal(signal.SIGTERM)
        assert gateway.process.wait(timeout=peer_wait_s / 4) == 0
    finally:
        gateway.kill()
        gateway.stop()
