"""Fixtures for the gRPC tests: a draft head on disk, server processes, and in-process references."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Callable, Iterator

import grpc
import pytest
import torch
from transformers import AutoTokenizer

from diffspec.settings import BUNDLED_DRAFT, DiffSpecSettings
from diffspec.v1 import gateway_pb2, gateway_pb2_grpc
from draft_service.eagle3_head import Eagle3Head
from draft_service.runtime import DraftRuntime
from gateway.engine import SpeculativeEngine
from gateway.request import GenerationRequest, GenerationStats
from target_service.runtime import TargetRuntime
from tests.conftest import CODE_PROMPTS  # noqa: F401 (the gateway tests' prompts, imported from here)
from tests.gateway.servers import ServerProcess, SplitDeployment

Generated = tuple[list[int], str, gateway_pb2.GenerationStats | None]
Collected = tuple[list[int], str, GenerationStats | None]


@pytest.fixture(scope="session")
def reference_target(tiny_target_dir) -> TargetRuntime:
    return TargetRuntime(DiffSpecSettings(base_model=tiny_target_dir, num_pages=1024))


@pytest.fixture(scope="session")
def tokenizer(tiny_target_dir):
    return AutoTokenizer.from_pretrained(tiny_target_dir)


@pytest.fixture(scope="session")
def draft_head_dir() -> Path:
    """The shipped head for the bundled target (the servers' default draft model)."""
    return BUNDLED_DRAFT


@pytest.fixture(scope="module")
def fp32_target(tiny_target_dir) -> TargetRuntime:
    """The bundled target in fp32, one per test module: a module's tests count what it computes (prompt
    positions, sessions, prefix-cache hits), so no other module's requests may touch it."""
    return TargetRuntime(DiffSpecSettings(base_model=tiny_target_dir, num_pages=512, dtype="float32"))


@pytest.fixture(scope="module")
def fp32_draft(fp32_target: TargetRuntime) -> DraftRuntime:
    """The shipped head over ``fp32_target``'s embeddings, in fp32."""
    head = Eagle3Head.load(BUNDLED_DRAFT, fp32_target.model.embed_tokens, torch.device("cpu"), torch.float32)
    return DraftRuntime(head)


@pytest.fixture(scope="module")
def fp32_engine(fp32_target: TargetRuntime, fp32_draft: DraftRuntime, tokenizer) -> Iterator[SpeculativeEngine]:
    """The in-process engine over ``fp32_target`` and ``fp32_draft``."""
    engine = SpeculativeEngine(fp32_target, fp32_draft, tokenizer)
    yield engine
    engine.close()


@pytest.fixture(scope="session")
def auto_reference(reference_target, tokenizer) -> Iterator[Callable[[str, int], list[int]]]:
    """prompt text, max_new_tokens -> the in-process Auto output (greedy), memoised."""
    engine = SpeculativeEngine(reference_target, None, tokenizer)
    memo: dict[tuple[str, int], list[int]] = {}

    def reference(text: str, n: int) -> list[int]:
        if (text, n) not in memo:
            memo[(text, n)] = collect(engine, GenerationRequest(tokenizer(text)["input_ids"], n))[0]
        return memo[(text, n)]

    yield reference
    engine.close()


def collect(engine: SpeculativeEngine, request: GenerationRequest, timeout: float | None = None) -> Collected:
    """Run one in-process generation to the end: (token ids, text, final stats)."""
    return asyncio.run(collect_async(engine, request, timeout))


async def collect_async(
    engine: SpeculativeEngine, request: GenerationRequest, timeout: float | None = None
) -> Collected:
    ids: list[int] = []
    text = ""
    stats = None
    async for chunk in engine.generate(request, timeout):
        ids += chunk.token_ids
        text += chunk.text
        stats = chunk.stats or stats
    return ids, text, stats


def assert_all_released(engine: SpeculativeEngine, timeout: float = 10.0) -> None:
    """Releases go out with the engine's next iterations: wait for them, then check every page and session."""
    target, draft = engine.target, engine.draft
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        info = target.info()
        draft_sessions = draft.sessions if draft is not None else {}
        idle = not info.active_sessions and not draft_sessions and not _pins(draft)
        if info.num_free_pages == info.num_pages and idle:
            return
        time.sleep(0.01)
    info = target.info()
    assert info.num_free_pages == info.num_pages and info.active_sessions == 0
    assert draft is None or not draft.sessions
    assert not _pins(draft)


def _pins(draft) -> int:  # noqa: ANN001 - a draft runtime, a recording of one, or None
    """Prompts the draft's prefix cache holds pinned for lookups no start or release has taken."""
    cache = getattr(draft, "prefix_cache", None)
    return cache.pinned_sessions if cache is not None else 0


@pytest.fixture(scope="session")
def split_deployment(draft_head_dir, tmp_path_factory) -> Iterator[SplitDeployment]:
    """Target, draft and gateway processes shared by the tests that leave them running. The gateway admits
    as many tokenizations at once as the tests send (16 concurrent text prompts in test_grpc_split.py): past
    its default of 8, on a busy machine where each waits for a tokenizer thread, it refuses them. It waits a
    minute for the draft's proposals: past the default second (a busy machine's slow reply), a step verifies
    Auto trees, which keeps the distribution but not a seeded request's draws, and these tests compare seeded
    samples across batchings (the late draft has tests of its own: tests/adversarial)."""
    flags = ("--max-tokenizations", "16", "--draft-timeout-seconds", "60")
    deployment = SplitDeployment(tmp_path_factory.mktemp("split-logs"), draft_head_dir, *flags)
    yield deployment
    deployment.stop()


@pytest.fixture(scope="session")
def embedded_server(draft_head_dir, tmp_path_factory) -> Iterator[ServerProcess]:
    """``diffspec serve`` (the gateway over an in-process target and draft, one port), admitting
    at most 3 generations, with Prometheus metrics (``server.scrape()``)."""
    server = ServerProcess(
        "all",
        tmp_path_factory.mktemp("all-logs"),
        "--max-sessions",
        "3",
        env={"DIFFSPEC_DRAFT_MODEL": str(draft_head_dir)},
        metrics=True,
    )
    try:
        server.wait_serving()
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def gateway_stub(split_deployment) -> Iterator[gateway_pb2_grpc.GatewayStub]:
    with grpc.insecure_channel(split_deployment.gateway.address) as channel:
        yield gateway_pb2_grpc.GatewayStub(channel)


def generate(stub: gateway_pb2_grpc.GatewayStub, timeout: float = 60, **fields) -> Generated:
    """Run one Generate to the end: (token ids, text, final stats)."""
    ids: list[int] = []
    text = ""
    stats = None
    for response in stub.Generate(gateway_pb2.GenerateRequest(**fields), timeout=timeout):
        ids += response.token_ids
        text += response.text
        if response.HasField("stats"):
            stats = response.stats
    return ids, text, stats
