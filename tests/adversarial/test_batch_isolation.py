"""One request cannot hurt the requests it shares a step or a server with: poisonous sampling numbers beside
innocent streams, and multi-megabyte texts beside an innocent stream (issue 14, cases 1 and 2)."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from diffspec.settings import BUNDLED_DRAFT, DiffSpecSettings
from diffspec.v1 import gateway_pb2, gateway_pb2_grpc
from draft_service.inprocess import load_draft_runtime
from gateway.engine import SpeculativeEngine
from gateway.engine_core import EngineLimits
from target_service.runtime import TargetRuntime
from tests.adversarial.harness import InProcessGateway
from tests.gateway.conftest import CODE_PROMPTS, assert_all_released

MAX_NEW = 40
POISONS = [
    {"temperature": 2e-38},
    {"temperature": 1.0, "top_p": 1e-300},
    {"temperature": 1e-45, "top_p": 5e-324},
    {"temperature": 3e38, "top_k": 1},
]
HUGE_TEXT_CHARS = 3_900_000  # under the 4 MiB message limit, 16x more characters than the context could hold


@pytest.fixture(scope="module")
def served(tiny_target_dir, tokenizer) -> Iterator[tuple[SpeculativeEngine, str]]:
    # more tokenizations than the 12 texts a test sends at once: a refusal there is the tokenizer pool's
    # admission (tested on its own), not what this module is about
    settings = DiffSpecSettings(base_model=tiny_target_dir, num_pages=512, max_tokenizations=16)
    target = TargetRuntime(settings)
    draft = load_draft_runtime(DiffSpecSettings(draft_model=BUNDLED_DRAFT), target)
    engine = SpeculativeEngine(target, draft, tokenizer, EngineLimits(16, 4096, 2048))
    gateway = InProcessGateway(engine, settings)
    yield engine, gateway.address
    gateway.stop()
    engine.close()


def _stream(stub: gateway_pb2_grpc.GatewayStub, **fields) -> tuple[str, list[int]]:
    """(status name, token ids) of one Generate run to its end."""
    ids: list[int] = []
    try:
        for response in stub.Generate(gateway_pb2.GenerateRequest(**fields), timeout=120):
            ids += response.token_ids
    except grpc.RpcError as ended:
        return ended.code().name, ids
    return "OK", ids


def test_poisonous_sampling_numbers_leave_every_innocent_stream_exact(served, auto_reference):
    engine, address = served
    innocent = [CODE_PROMPTS[i % len(CODE_PROMPTS)] for i in range(8)]
    start = threading.Barrier(len(innocent) + len(POISONS))
    with grpc.insecure_channel(address) as channel, ThreadPoolExecutor(len(innocent) + len(POISONS)) as pool:
        stub = gateway_pb2_grpc.GatewayStub(channel)

        def run(fields: dict) -> tuple[str, list[int]]:
            start.wait()
            return _stream(stub, **fields)

        innocents = [pool.submit(run, {"text": t, "max_new_tokens": MAX_NEW, "policy": "full"}) for t in innocent]
        poisons = [pool.submit(run, {"text": CODE_PROMPTS[0], "max_new_tokens": MAX_NEW, "policy": "full", **p})
                   for p in POISONS]  # fmt: skip
        for text, outcome in zip(innocent, innocents):
            assert outcome.result() == ("OK", auto_reference(text, MAX_NEW))
        assert {p.result()[0] for p in poisons} <= {"OK", "INVALID_ARGUMENT"}
    assert_all_released(engine)


def _rss_mb() -> float:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def test_multi_megabyte_texts_are_refused_unread_while_an_innocent_stream_runs(served, auto_reference):
    engine, address = served
    huge = "def f(x):\n    return x\n" * (HUGE_TEXT_CHARS // 24)
    rss_before = _rss_mb()
    with grpc.insecure_channel(address) as channel, ThreadPoolExecutor(9) as pool:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        innocent = pool.submit(_stream, stub, text=CODE_PROMPTS[1], max_new_tokens=MAX_NEW)

        def attack(index: int) -> tuple[str, float]:
            started = time.monotonic()
            try:
                if index % 2:
                    stub.Tokenize(gateway_pb2.TokenizeRequest(text=huge), timeout=30)
                else:
                    list(stub.Generate(gateway_pb2.GenerateRequest(text=huge, max_new_tokens=4), timeout=30))
            except grpc.RpcError as refused:
                return refused.code().name, time.monotonic() - started
            return "OK", time.monotonic() - started

        attacks = [pool.submit(attack, i) for i in range(8)]
        for outcome in attacks:
            status, seconds = outcome.result()
            assert status == "INVALID_ARGUMENT" and seconds < 5
        assert innocent.result() == ("OK", auto_reference(CODE_PROMPTS[1], MAX_NEW))
    # eight texts of 3.9 MB and their messages; tokenizing them would have taken gigabytes
    assert _rss_mb() - rss_before < 300
    assert_all_released(engine)
