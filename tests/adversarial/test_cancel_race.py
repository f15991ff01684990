"""Generations cancelled around the moment their draft session starts, many times over (seeded), leave no
session on either service and every KV page free (issue 14, case 4), and a service's stream cancelled while
a step runs releases only after that step."""

from __future__ import annotations

import asyncio
import random
import time

import grpc
import pytest

from diffspec.serving import StepWorker
from diffspec.v1 import gateway_pb2, gateway_pb2_grpc
from tests.gateway.conftest import CODE_PROMPTS
from tests.gateway.servers import draft_info, wait_all_released

ITERATIONS = 100
SEED = 14


@pytest.mark.slow
def test_cancels_around_the_draft_start_leak_nothing(split_deployment):
    rng = random.Random(SEED)
    with grpc.insecure_channel(split_deployment.gateway.address) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        for _ in range(ITERATIONS):
            text = rng.choice(CODE_PROMPTS) * rng.randint(1, 8)
            call = stub.Generate(gateway_pb2.GenerateRequest(text=text, max_new_tokens=64, policy="full"), timeout=30)
            if rng.random() < 0.5:
                next(call, None)  # the first token is out: the draft's start is on its way
            time.sleep(rng.uniform(0, 0.02))
            call.cancel()
    info = wait_all_released(split_deployment, timeout=10)
    assert info.num_free_pages == info.num_pages and info.active_sessions == 0
    assert draft_info(split_deployment).active_sessions == 0


def test_a_streams_release_runs_after_the_step_its_cancellation_interrupted():
    """A service's stream cancelled while a step (a session start) runs on its thread releases only once that
    step is done, so the release sees the session the step opened."""
    order: list[str] = []

    def start() -> None:
        time.sleep(0.2)
        order.append("start")

    async def cancelled_mid_step() -> None:
        worker = StepWorker()
        step = asyncio.ensure_future(worker.run(start))
        await asyncio.sleep(0.05)
        step.cancel()
        await worker.finally_run(order.append, "release")

    asyncio.run(cancelled_mid_step())
    assert order == ["start", "release"]
