"""Target, draft and gateway as three processes over loopback gRPC: lossless, concurrent, leak-free."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from diffspec.health_probe import is_serving
from diffspec.settings import REPO_ROOT
from diffspec.v1 import gateway_pb2
from gateway.request import GenerationStats
from tests.conftest import short_prompts
from tests.gateway.conftest import CODE_PROMPTS, generate
from tests.gateway.servers import target_info, wait_all_released

MAX_NEW = 32
LONG = 2000  # ~15 s of generation: a cancel lands mid-stream, and only a propagated one frees pages in time


@pytest.mark.parametrize("policy", ["auto", "chain", "full"])
def test_generate_equals_in_process_auto(gateway_stub, auto_reference, policy):
    # the long prompt's features (~1K rows of 3 KB) cross the wire in ~60 chunks of 64 KiB
    for text in [*CODE_PROMPTS, short_prompts(1)[0][-3000:]]:
        ids, out_text, stats = generate(
            gateway_stub, text=text, max_new_tokens=MAX_NEW, policy=policy, tree_config="24:0.0:5"
        )
        assert ids == auto_reference(text, MAX_NEW)
        assert stats.new_tokens == len(ids) and stats.finish_reason == "length"
        assert stats.steps == sum(stats.stop_depth_histogram) and not stats.fell_back_to_auto
        assert out_text and stats.prefill_seconds > 0


def test_token_id_prompts_and_tokenize(gateway_stub, tokenizer, auto_reference):
    text = CODE_PROMPTS[2]
    ids = gateway_stub.Tokenize(gateway_pb2.TokenizeRequest(text=text), timeout=10).token_ids
    assert list(ids) == tokenizer(text)["input_ids"]
    got, _, _ = generate(gateway_stub, token_ids=gateway_pb2.TokenIds(ids=ids), max_new_tokens=MAX_NEW, policy="full")
    assert got == auto_reference(text, MAX_NEW)


def test_sixteen_concurrent_streams_each_equal_their_single_stream(gateway_stub, auto_reference, split_deployment):
    jobs = [(text, policy) for text in CODE_PROMPTS for policy in ("auto", "chain", "full", "uniform4")]
    with ThreadPoolExecutor(len(jobs)) as pool:
        outputs = list(
            pool.map(lambda job: generate(gateway_stub, text=job[0], max_new_tokens=MAX_NEW, policy=job[1]), jobs)
        )
    for (text, _), (ids, _, stats) in zip(jobs, outputs):
        assert ids == auto_reference(text, MAX_NEW) and stats.finish_reason == "length"
    info = wait_all_released(split_deployment)
    assert info.num_free_pages == info.num_pages and info.active_sessions == 0


def test_cancel_mid_stream_releases_every_page(gateway_stub, split_deployment):
    call = gateway_stub.Generate(gateway_pb2.GenerateRequest(text=CODE_PROMPTS[0], max_new_tokens=LONG), timeout=60)
    next(call), next(call)
    call.cancel()
    with pytest.raises(grpc.RpcError) as ended:
        list(call)
    assert ended.value.code() == grpc.StatusCode.CANCELLED
    info = wait_all_released(split_deployment)
    assert info.num_free_pages == info.num_pages and info.active_sessions == 0


def test_deadline_mid_stream_releases_every_page(gateway_stub, split_deployment):
    with pytest.raises(grpc.RpcError) as ended:
        generate(gateway_stub, timeout=0.5, text=CODE_PROMPTS[1], max_new_tokens=LONG)
    assert ended.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    info = wait_all_released(split_deployment)
    assert info.num_free_pages == info.num_pages and info.active_sessions == 0


CLIENT_THAT_VANISHES = """
import sys, time, grpc
from diffspec.v1 import gateway_pb2, gateway_pb2_grpc
stub = gateway_pb2_grpc.GatewayStub(grpc.insecure_channel(sys.argv[1]))
call = stub.Generate(gateway_pb2.GenerateRequest(text="def main(argv):", max_new_tokens=2000))
next(call)
print("streaming", flush=True)
time.sleep(60)
"""


def test_client_disconnect_mid_stream_releases_every_page(split_deployment):
    client = subprocess.Popen(
        [sys.executable, "-c", CLIENT_THAT_VANISHES, split_deployment.gateway.address],
        cwd=REPO_ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert client.stdout.readline().strip() == "streaming"
        assert target_info(split_deployment).active_sessions == 1
    finally:
        client.kill()
        client.wait(timeout=10)
        client.stdout.close()
    info = wait_all_released(split_deployment)
    assert info.num_free_pages == info.num_pages and info.active_sessions == 0


def test_cli_generate_through_the_gateway_prints_the_in_process_json(split_deployment, auto_reference):
    text = CODE_PROMPTS[3]
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "cli",
            "generate",
            "--gateway",
            split_deployment.gateway.address,
            "--prompt",
            text,
            "--max-new-tokens",
            str(MAX_NEW),
            "--policy",
            "chain",
            "--json",
        ],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 0, run.stderr
    *chunks, last = [json.loads(line) for line in run.stdout.splitlines()]
    assert last["token_ids"] == auto_reference(text, MAX_NEW) == [t for c in chunks for t in c["token_ids"]]
    assert last["text"].startswith("".join(c["text"] for c in chunks))  # + what the last chunk flushed
    assert set(last["stats"]) == set(GenerationStats().to_dict()) and last["stats"]["new_tokens"] == MAX_NEW


def test_model_info_health_and_reflection(gateway_stub, split_deployment):
    info = gateway_stub.ModelInfo(gateway_pb2.ModelInfoRequest(), timeout=10)
    assert info.vocab_size == 8192 and info.draft_available and info.max_context == 16384
    expected = {"target": "diffspec.v1.Target", "draft": "diffspec.v1.Draft", "gateway": "diffspec.v1.Gateway"}
    for server in split_deployment.servers:
        with grpc.insecure_channel(server.address) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            for service in ("", expected[server.role]):
                reply = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
                assert reply.status == health_pb2.HealthCheckResponse.SERVING
            assert is_serving(server.address, expected[server.role])
            stub = reflection_pb2_grpc.ServerReflectionStub(channel)
            replies = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
            names = {s.name for s in next(replies).list_services_response.service}
        assert names == {expected[server.role], "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"}
    with socket.socket() as nobody_listens:
        nobody_listens.bind(("127.0.0.1", 0))
        assert not is_serving(f"127.0.0.1:{nobody_listens.getsockname()[1]}")
