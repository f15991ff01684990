"""The attack suite shares the gRPC tests' fixtures (the bundled pair, its Auto reference, server processes)
and adds a split deployment with short bounds on its peers, for the tests that hang one of them."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from tests.gateway.conftest import (  # noqa: F401 - fixtures
    auto_reference,
    draft_head_dir,
    embedded_server,
    reference_target,
    split_deployment,
    tokenizer,
)
from tests.gateway.servers import SplitDeployment

STEP_TIMEOUT_S = 5.0  # a target (or a draft owing replies) silent this long is gone
DRAFT_TIMEOUT_S = 0.5  # a step waits this long for the draft's trees
HEALTH_EVERY_S = 0.3  # the gateway asks its target this often


@dataclass(frozen=True)
class BoundedDeployment:
    trio: SplitDeployment
    http: str  # host:port of the gateway's HTTP API


@pytest.fixture(scope="session")
def bounded_deployment(draft_head_dir, tmp_path_factory) -> Iterator[BoundedDeployment]:  # noqa: F811
    """Target, draft and gateway processes; the gateway with the bounds above and an HTTP API. Tests that
    SIGSTOP a member resume it before they end."""
    flags = [
        "--step-timeout-seconds", str(STEP_TIMEOUT_S), "--draft-timeout-seconds", str(DRAFT_TIMEOUT_S),
        "--peer-health-seconds", str(HEALTH_EVERY_S), "--http-listen", "127.0.0.1:0",
    ]  # fmt: skip
    trio = SplitDeployment(tmp_path_factory.mktemp("bounded-logs"), draft_head_dir, *flags)
    line = trio.gateway.process.stdout.readline()  # the HTTP API's line, printed once it listens
    assert "OpenAI-compatible HTTP API on http://" in line, line
    yield BoundedDeployment(trio, line.split("http://", 1)[1].split("/", 1)[0])
    trio.stop()
