"""Bad input gets INVALID_ARGUMENT with a message; overload RESOURCE_EXHAUSTED; nothing crashes a server."""

from __future__ import annotations

import math
import random
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from diffspec.v1 import (
    draft_pb2,
    draft_pb2_grpc,
    gateway_pb2,
    gateway_pb2_grpc,
    target_pb2,
    target_pb2_grpc,
)
from tests.gateway.conftest import CODE_PROMPTS, generate
from tests.gateway.servers import wait_all_released

OK_PROMPT = {"text": "def f(x):"}
BAD_REQUESTS = [
    ({}, "no prompt"),
    ({"text": ""}, "prompt is empty"),
    ({"token_ids": gateway_pb2.TokenIds(ids=[])}, "prompt is empty"),
    ({"token_ids": gateway_pb2.TokenIds(ids=[0] * 16384)}, "does not fit the context"),
    ({"token_ids": gateway_pb2.TokenIds(ids=[0, 8192])}, "out of the vocabulary"),
    ({"token_ids": gateway_pb2.TokenIds(ids=[0, -3])}, "out of the vocabulary"),
    ({**OK_PROMPT, "policy": "sideways"}, "unknown policy"),
    ({**OK_PROMPT, "policy": "full", "tree_config": "64:x:8"}, "bad tree config"),
    ({**OK_PROMPT, "policy": "chain", "tree_config": "999:0.1:8"}, "total_tokens"),
    ({**OK_PROMPT, "temperature": -0.5}, "temperature"),
    ({**OK_PROMPT, "temperature": math.nan}, "temperature"),
    ({**OK_PROMPT, "top_p": 0.0}, "top_p"),
    ({**OK_PROMPT, "top_p": 1.5}, "top_p"),
    ({**OK_PROMPT, "max_new_tokens": 0}, "max_new_tokens"),
    ({**OK_PROMPT, "max_new_tokens": -7}, "max_new_tokens"),
    ({**OK_PROMPT, "max_new_tokens": 2_000_000_000}, "max_new_tokens"),
    ({**OK_PROMPT, "stop": ["x"] * 100}, "stop sequences"),
]


@pytest.mark.parametrize("fields, message", BAD_REQUESTS, ids=[m for _, m in BAD_REQUESTS])
def test_bad_generate_requests_are_invalid_argument(gateway_stub, fields, message):
    with pytest.raises(grpc.RpcError) as rejected:
        generate(gateway_stub, **fields)
    assert rejected.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in rejected.value.details()


def test_undecodable_bytes_are_invalid_argument(split_deployment):
    with grpc.insecure_channel(split_deployment.gateway.address) as channel:
        raw = channel.unary_stream("/diffspec.v1.Gateway/Generate")  # no serializers: bytes as they are
        with pytest.raises(grpc.RpcError) as rejected:
            list(raw(b"\x0a\xff\xff\xff", timeout=10))
    assert rejected.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "malformed request message" in rejected.value.details()


def test_direct_session_misuse_is_invalid_argument(split_deployment):
    with grpc.insecure_channel(split_deployment.target.address) as channel:
        session = target_pb2_grpc.TargetStub(channel).Session
        for requests, message in [
            ([target_pb2.TargetRequest(decode=target_pb2.DecodeRequest())], "unknown session"),
            ([target_pb2.TargetRequest()], "got None"),
            ([target_pb2.TargetRequest(verify=target_pb2.VerifyRequest())], "malformed draft tree"),
        ]:
            with pytest.raises(grpc.RpcError) as rejected:
                list(session(iter(requests), timeout=10))
            assert rejected.value.code() == grpc.StatusCode.INVALID_ARGUMENT and message in rejected.value.details()
    with grpc.insecure_channel(split_deployment.draft.address) as channel:
        start = draft_pb2.StartRequest(
            prompt_ids=[0, 5, 6],
            first_token=7,
            feature_rows=2,
            options=draft_pb2.DraftOptions(policy="full", tree_config="8:0:4"),
        )
        with pytest.raises(grpc.RpcError) as rejected:
            list(draft_pb2_grpc.DraftStub(channel).Session(iter([draft_pb2.DraftRequest(start=start)]), timeout=10))
        assert rejected.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "feature rows" in rejected.value.details()


def test_admission_control_turns_the_extra_generation_away(embedded_server):
    """The embedded server admits 3 generations at once; a 4th gets RESOURCE_EXHAUSTED."""
    with grpc.insecure_channel(embedded_server.address) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        calls = [
            stub.Generate(gateway_pb2.GenerateRequest(text=CODE_PROMPTS[0], max_new_tokens=2000), timeout=60)
            for _ in range(3)
        ]
        for call in calls:
            next(call)
        with pytest.raises(grpc.RpcError) as refused:
            generate(stub, text=CODE_PROMPTS[1], max_new_tokens=4)
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "max_sessions" in refused.value.details()
        for call in calls:
            call.cancel()


def random_generate_request(rng: random.Random) -> gateway_pb2.GenerateRequest:
    """Field values drawn mostly from the invalid side; valid ones are short."""
    fields: dict = {}
    if rng.random() < 0.5:
        fields["text"] = "".join(rng.choice("ab(){}:\n \x00\u00e9\U0001f600") for _ in range(rng.randrange(0, 40)))
    elif rng.random() < 0.8:
        fields["token_ids"] = gateway_pb2.TokenIds(ids=[rng.randrange(-10, 9000) for _ in range(rng.randrange(0, 30))])
    fields["max_new_tokens"] = rng.choice([-1, 0, 1, 3, 8, 1 << 30])
    fields["temperature"] = rng.choice([0.0, 0.7, -1.0, math.inf, math.nan])
    if rng.random() < 0.5:
        fields["top_p"] = rng.choice([0.0, 0.5, 1.0, 2.0, math.nan])
    if rng.random() < 0.3:
        fields["seed"] = rng.randrange(-(1 << 63), 1 << 63)
    fields["stop"] = [rng.choice(["", "\n", "x" * 300, "):"]) for _ in range(rng.randrange(0, 3))]
    fields["policy"] = rng.choice(["", "auto", "chain", "full", "uniform3", "uniform0", "online", "???"])
    fields["tree_config"] = rng.choice(["", "8:0:4", "0:0:0", "a:b:c", "64:0.08:8", "1:2", "300:0.5:40"])
    if rng.random() < 0.5:
        fields["salience"] = rng.random() < 0.5
    return gateway_pb2.GenerateRequest(**fields)


ALLOWED = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT}


def outcome(call) -> grpc.StatusCode:
    """The call's final status code, its responses drained."""
    try:
        for _ in call:
            pass
    except grpc.RpcError as failure:
        return failure.code()
    return grpc.StatusCode.OK


def test_fuzzed_requests_never_hurt_the_servers(split_deployment, gateway_stub, auto_reference):
    rng = random.Random(1234)
    with (
        grpc.insecure_channel(split_deployment.gateway.address) as gw,
        grpc.insecure_channel(split_deployment.target.address) as tg,
    ):
        raw = {  # identity serializers: the bytes go out exactly as drawn
            "/diffspec.v1.Gateway/Generate": gw.unary_stream("/diffspec.v1.Gateway/Generate"),
            "/diffspec.v1.Target/Session": tg.stream_stream("/diffspec.v1.Target/Session"),
        }
        jobs = [("fields", random_generate_request(rng)) for _ in range(60)]
        jobs += [
            (method, bytes(rng.randrange(256) for _ in range(rng.randrange(0, 64))))
            for method in raw
            for _ in range(20)
        ]

        def run(job) -> tuple[str, grpc.StatusCode]:
            kind, payload = job
            if kind == "fields":
                return kind, outcome(gateway_stub.Generate(payload, timeout=10))
            if kind.endswith("Session"):
                return kind, outcome(raw[kind](iter([payload, payload]), timeout=10))
            return kind, outcome(raw[kind](payload, timeout=10))

        with ThreadPoolExecutor(4) as pool:
            results = list(pool.map(run, jobs))
    assert {code for _, code in results} <= ALLOWED, results
    assert sum(code == grpc.StatusCode.INVALID_ARGUMENT for _, code in results) > 50
    for server in split_deployment.servers:
        assert "Traceback" not in server.log_path.read_text()
        with grpc.insecure_channel(server.address) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
    ids, _, _ = generate(gateway_stub, text=CODE_PROMPTS[2], max_new_tokens=16, policy="full")
    assert ids == auto_reference(CODE_PROMPTS[2], 16)
    info = wait_all_released(split_deployment)
    assert info.num_free_pages == info.num_pages and info.active_sessions == 0
