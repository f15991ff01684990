"""``bench.adversarial`` for a few seconds against an in-process gateway over the tiny pair (CPU).

Floods, cancels, mutated requests and slow readers beside an innocent client: nothing ends
INTERNAL, the innocent client's every request succeeds, and afterwards every KV page is free and
no target or draft session is left.
"""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest

from bench.adversarial import Attack, AttackConfig, Gauges
from diffspec.settings import BUNDLED_DRAFT, DiffSpecSettings
from draft_service.inprocess import load_draft_runtime
from gateway.engine import SpeculativeEngine
from gateway.engine_core import EngineLimits
from gateway.quota import QuotaLimits
from target_service.runtime import TargetRuntime
from tests.adversarial.harness import InProcessGateway

QUICK = AttackConfig(
    seconds=2.0, innocent_tokens=8, innocent_baseline=2, flood_streams=4, flood_tokens=64, cancel_threads=2,
    mutate_threads=1, slow_streams=1, call_timeout_s=10.0,
)  # fmt: skip


@pytest.fixture(scope="module")
def attacked(tiny_target_dir, tokenizer) -> Iterator[tuple[SpeculativeEngine, str]]:
    settings = DiffSpecSettings(base_model=tiny_target_dir, num_pages=256, max_new_tokens=16, max_sessions=12)
    target = TargetRuntime(settings)
    draft = load_draft_runtime(DiffSpecSettings(draft_model=BUNDLED_DRAFT), target)
    engine = SpeculativeEngine(target, draft, tokenizer, EngineLimits(12, 256, 64, QuotaLimits(max_requests=3)))
    gateway = InProcessGateway(engine, settings)
    try:
        yield engine, gateway.address
    finally:
        gateway.stop()
        engine.close()


def test_a_short_attack_leaves_no_finding_and_every_page_free(attacked):
    engine, address = attacked
    target, draft = engine.target, engine.draft

    def gauges() -> Gauges:
        pool = target.pool
        sessions = len(target.sessions)
        return Gauges(pool.num_free_pages, pool.num_pages, sessions, len(draft.sessions), engine.core.num_requests)

    with grpc.insecure_channel(address) as channel:
        report = Attack(channel, (), QUICK).run(gauges)
    assert report.findings == [], report.to_dict()
    assert report.outcomes["innocent"]["OK"] == len(report.innocent_alone_s) + len(report.innocent_attacked_s)
    assert report.outcomes["flood"]["RESOURCE_EXHAUSTED"] > 0  # the flood met its client's quota
    assert sum(report.outcomes["cancel"].values()) > 0 and sum(report.outcomes["mutate"].values()) > 0
    assert report.leaks == {}
