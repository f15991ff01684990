"""Target, draft and gateway as three processes over loopback gRPC: lossless, concurrent, leak-free."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from diffspec.health_probe import is_serving
from diffspec.sampling import SamplingParams
from diffspec.settings import REPO_ROOT
from diffspec.v1 import gateway_pb2
from gateway.engine import SpeculativeEngine
from gateway.request import GenerationRequest, GenerationStats
from tests.conftest import source_prompts
from tests.gateway.conftest import CODE_PROMPTS, generate
from tests.gateway.servers import SplitDeployment, draft_info, free_port, target_info, wait_all_released, wait_until

MAX_NEW = 32
LONG = 2000  # ~15 s of generation: a cancel lands mid-stream, and only a propagated one frees pages in time


@pytest.mark.parametrize("policy", ["auto", "chain", "full"])
def test_generate_equals_in_process_auto(gateway_stub, auto_reference, policy):
    # the long prompt's features (~1K rows of 3 KB) cross the wire in ~60 chunks of 64 KiB
    for text in [*CODE_PROMPTS, source_prompts(1)[0][-3000:]]:
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


def test_sampling_with_a_seed_is_reproducible_and_auto_equals_in_process(gateway_stub, reference_target, tokenizer):
    text = CODE_PROMPTS[0]
    fields = {"text": text, "max_new_tokens": MAX_NEW, "temperature": 0.8, "top_p": 0.95, "seed": 7}
    with ThreadPoolExecutor(4) as pool:  # the same request twice at once, batched with others, and once more alone
        jobs = [{**fields, "policy": policy} for policy in ("full", "full", "auto", "chain")]
        runs = list(pool.map(lambda job: generate(gateway_stub, **job)[0], jobs))
    assert runs[0] == runs[1] == generate(gateway_stub, **fields, policy="full")[0]
    assert runs[3] == generate(gateway_stub, **fields, policy="chain")[0]
    assert generate(gateway_stub, **{**fields, "seed": 8}, policy="full")[0] != runs[0]
    engine = SpeculativeEngine(reference_target, None, tokenizer)  # Auto in process: the target's draws alone

    async def auto_in_process() -> list[int]:
        sampling = SamplingParams(temperature=0.8, top_p=0.95, seed=7)
        request = GenerationRequest(tokenizer(text)["input_ids"], MAX_NEW, sampling)
        return [t async for chunk in engine.generate(request) for t in chunk.token_ids]

    try:
        assert runs[2] == asyncio.run(auto_in_process())
    finally:
        engine.close()


def test_speculative_samples_fork_the_prompt_across_processes(gateway_stub, split_deployment):
    """n = 3 over the split deployment: the forks' prompt features are sample 0's relayed rows, and each
    sample equals its lone run with its derived seed."""
    sampling = SamplingParams(temperature=0.9, seed=13)
    fields = {"text": CODE_PROMPTS[1], "max_new_tokens": 12, "temperature": 0.9, "policy": "full"}
    generate(gateway_stub, **fields)  # a fresh engine's first trees are planned without a measured verify cost
    samples: dict[int, list[int]] = {}
    for response in gateway_stub.Generate(gateway_pb2.GenerateRequest(**fields, seed=13, n=3), timeout=60):
        samples.setdefault(response.index, []).extend(response.token_ids)
    for index in range(3):
        assert samples[index] == generate(gateway_stub, **fields, seed=sampling.for_sample(index).seed)[0], index
    info = wait_all_released(split_deployment)
    assert info.num_free_pages == info.num_pages and info.active_sessions == 0


def sessions(deployment: SplitDeployment) -> tuple[int, int]:
    """Open sessions at the target and at the draft."""
    return target_info(deployment).active_sessions, draft_info(deployment).active_sessions


def test_cancel_mid_stream_releases_every_page(gateway_stub, split_deployment):
    request = gateway_pb2.GenerateRequest(text=CODE_PROMPTS[0], max_new_tokens=LONG, policy="full")
    call = gateway_stub.Generate(request, timeout=60)
    next(call), next(call)
    wait_until(lambda: sessions(split_deployment) == (1, 1), 5, "one session at the target and at the draft")
    call.cancel()
    with pytest.raises(grpc.RpcError) as ended:
        list(call)
    assert ended.value.code() == grpc.StatusCode.CANCELLED
    info = wait_all_released(split_deployment)
    assert info.num_free_pages == info.num_pages and info.active_sessions == 0


def test_deadline_mid_stream_releases_every_page(gateway_stub, split_deployment):
    with pytest.raises(grpc.RpcError) as ended:
        generate(gateway_stub, timeout=0.5, text=CODE_PROMPTS[1], max_new_tokens=LONG, policy="full")
    assert ended.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    info = wait_all_released(split_deployment)
    assert info.num_free_pages == info.num_pages and info.active_sessions == 0


CLIENT_THAT_VANISHES = """
import sys, time, grpc
from diffspec.v1 import gateway_pb2, gateway_pb2_grpc
stub = gateway_pb2_grpc.GatewayStub(grpc.insecure_channel(sys.argv[1]))
call = stub.Generate(gateway_pb2.GenerateRequest(text="def main(argv):", max_new_tokens=2000, policy="full"))
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
        # the draft session starts in the iteration after the first token
        wait_until(lambda: sessions(split_deployment) == (1, 1), 5, "one session at the target and at the draft")
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


def services_of(address: str) -> set[str]:
    """The services a server lists through reflection."""
    with grpc.insecure_channel(address) as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        replies = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
        return {s.name for s in next(replies).list_services_response.service}


BASE_SERVICES = {"grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"}


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
        assert services_of(server.address) == {expected[server.role], *BASE_SERVICES}
    assert not is_serving(f"127.0.0.1:{free_port()}")
