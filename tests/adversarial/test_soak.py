"""``bench.soak`` against ``diffspec serve all`` for 30 s (CI's soak): every kind of client, valid and invalid,
from threads of its own, then every page free, no session left, memory flat over the second half.

30 s is enough for each attacker to finish calls of its own (the slow readers' first ones end at their 20 s
deadline), and the second half, after the allocator's pools filled, is sampled every half second.
``python -m bench.soak --seconds 600`` is the long run."""

from __future__ import annotations

import json

import grpc
import pytest

from bench.adversarial import AttackConfig, scraped_gauges, spawned
from bench.soak import plot, soak

SOAK = AttackConfig(seconds=30.0, innocent_tokens=16, innocent_baseline=3, flood_streams=6, flood_tokens=128)
SAMPLE_EVERY_S = 0.5
CLIENTS = {"innocent", "flood", "cancel", "mutate", "slow", "oversize"}  # bench.adversarial.Attack's clients
RSS_DRIFT_MB = 150  # over the second half; the first fills the allocator's pools


@pytest.mark.slow
def test_a_30_second_soak_of_every_client_ends_with_the_pool_full_and_no_session(tmp_path):
    with spawned("all", tmp_path) as deployment, grpc.insecure_channel(deployment.gateway) as channel:
        summary = soak(channel, (), SOAK, scraped_gauges(deployment.metrics), deployment.pids, SAMPLE_EVERY_S)
    assert summary["findings"] == [], json.dumps({k: v for k, v in summary.items() if k != "timeline"})
    assert summary["pool_full_at_end"] and summary["sessions_at_end"] == {"target": 0, "draft": 0}
    outcomes = summary["outcomes"]
    assert set(outcomes) == CLIENTS and all(sum(calls.values()) > 0 for calls in outcomes.values()), outcomes
    innocent = summary["innocent_alone"]["requests"] + summary["innocent_attacked"]["requests"]
    assert outcomes["innocent"] == {"OK": innocent}
    assert outcomes["mutate"]["INVALID_ARGUMENT"] > 0 and outcomes["oversize"]["INVALID_ARGUMENT"] > 0
    assert outcomes["flood"]["RESOURCE_EXHAUSTED"] > 0 and outcomes["cancel"]["CANCELLED"] > 0
    assert len(summary["timeline"]) >= 0.75 * SOAK.seconds / SAMPLE_EVERY_S
    assert abs(summary["rss_mb"]["drift_second_half"]) < RSS_DRIFT_MB, summary["rss_mb"]
    plot(summary, tmp_path / "soak.png")
    assert (tmp_path / "soak.png").stat().st_size > 10_000
