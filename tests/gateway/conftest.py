"""Fixtures for the gRPC tests: a draft head on disk, server processes, and in-process references."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Callable, Iterator

import grpc
import pytest
from transformers import AutoTokenizer

from diffspec.settings import BUNDLED_DRAFT, DiffSpecSettings
from diffspec.v1 import gateway_pb2, gateway_pb2_grpc
from gateway.engine import SpeculativeEngine
from gateway.request import GenerationRequest
from target_service.inprocess import InProcessTarget
from target_service.runtime import TargetRuntime
from tests.gateway.servers import ServerProcess, SplitDeployment

CODE_PROMPTS = [
    "import os\nimport sys\n\n\ndef main(argv):",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):",
    "def fibonacci(n):",
    "import numpy as np\n\n\ndef normalize(x, axis=0):",
]
Generated = tuple[list[int], str, gateway_pb2.GenerationStats | None]


@pytest.fixture(scope="session")
def reference_target(tiny_target_dir) -> InProcessTarget:
    return InProcessTarget(TargetRuntime(DiffSpecSettings(base_model=tiny_target_dir, num_pages=1024)))


@pytest.fixture(scope="session")
def tokenizer(tiny_target_dir):
    return AutoTokenizer.from_pretrained(tiny_target_dir)


@pytest.fixture(scope="session")
def draft_head_dir() -> Path:
    """The shipped head for the bundled target (the servers' default draft model)."""
    return BUNDLED_DRAFT


@pytest.fixture(scope="session")
def auto_reference(reference_target, tokenizer) -> Callable[[str, int], list[int]]:
    """prompt text, max_new_tokens -> the in-process Auto output (greedy), memoised."""
    engine = SpeculativeEngine(reference_target, None, tokenizer)
    memo: dict[tuple[str, int], list[int]] = {}

    async def run(text: str, n: int) -> list[int]:
        ids: list[int] = []
        async for chunk in engine.generate(GenerationRequest(tokenizer(text)["input_ids"], n)):
            ids += chunk.token_ids
        return ids

    def reference(text: str, n: int) -> list[int]:
        if (text, n) not in memo:
            memo[(text, n)] = asyncio.run(run(text, n))
        return memo[(text, n)]

    return reference


@pytest.fixture(scope="session")
def split_deployment(draft_head_dir, tmp_path_factory) -> Iterator[SplitDeployment]:
    """Target, draft and gateway processes shared by the tests that leave them running."""
    deployment = SplitDeployment(tmp_path_factory.mktemp("split-logs"), draft_head_dir)
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
