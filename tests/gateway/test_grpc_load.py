"""``diffspec serve`` under a short headless Locust run, then its Prometheus metrics."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
import time

import grpc

from diffspec.settings import REPO_ROOT
from diffspec.v1 import gateway_pb2_grpc
from tests.gateway.conftest import generate

PROMPTS = [
    "import os\nimport sys\n\n\ndef main(argv):",
    "class Stack:\n    def __init__(self):\n        self.items = []",
    "def fibonacci(n):",
]


def test_headless_locust_run_has_no_failures_and_per_call_clients_stay_cold(embedded_server, tmp_path):
    """Three prompts of several 64-entry blocks, at least four calls: prompts repeat, yet with a client per
    call no lookup finds another call's blocks."""
    prompts = tmp_path / "prompts.jsonl"
    long_texts = ["\n".join(PROMPTS[i:] + PROMPTS[:i]) * 8 for i in range(len(PROMPTS))]
    prompts.write_text("".join(json.dumps({"text": text}) + "\n" for text in long_texts))
    env = {
        **os.environ,
        "DIFFSPEC_LOCUST_PROMPTS": str(prompts),
        "DIFFSPEC_LOCUST_MAX_NEW_TOKENS": "24",
        "DIFFSPEC_LOCUST_PROMPT_CHARS": "2000",
        "DIFFSPEC_LOCUST_POLICY": "full",
        "DIFFSPEC_LOCUST_CLIENTS": "per-call",
    }
    before = scrape_when_idle(embedded_server)
    command = [
        sys.executable,
        "-m",
        "locust",
        "-f",
        str(REPO_ROOT / "bench" / "locustfile.py"),
        "--headless",
        "-u",
        "2",
        "-r",
        "2",
        "-t",
        "15s",
        "--host",
        embedded_server.address,
        "--csv",
        str(tmp_path / "load"),
        "--exit-code-on-error",
        "1",
        "--only-summary",
    ]
    run = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=90)
    assert run.returncode == 0, run.stderr[-3000:]
    with open(tmp_path / "load_stats.csv") as stats:
        rows = {row["Name"]: row for row in csv.DictReader(stats)}
    assert int(rows["Generate"]["Request Count"]) >= 4
    assert all(int(row["Failure Count"]) == 0 for row in rows.values())
    for name in ("time_to_first_token", "inter_token_latency", "tokens_per_second"):
        assert float(rows[name]["Average Response Time"]) > 0
    after = scrape_when_idle(embedded_server)
    looked_up = 'diffspec_draft_prefix_cache_entries_total{result="looked_up"}'
    hit = 'diffspec_draft_prefix_cache_entries_total{result="hit"}'
    assert after[looked_up] - before[looked_up] >= 4 * 64
    assert after[hit] == before[hit]


def scrape_when_idle(server, timeout: float = 10.0) -> dict[str, float]:  # noqa: ANN001
    """The server's metrics once every page is free: a stream's last chunk goes out before the engine's
    next iteration releases its pages, and other tests' cancelled streams release theirs the same way."""
    deadline = time.monotonic() + timeout
    samples = server.scrape()
    while samples['diffspec_kv_pages{state="free"}'] < samples['diffspec_kv_pages{state="total"}'] and time.monotonic() < deadline:
        time.sleep(0.05)
        samples = server.scrape()
    return samples


def test_prometheus_metrics_cover_requests_tokens_tau_and_the_kv_pool(embedded_server):
    with grpc.insecure_channel(embedded_server.address) as channel:
        generate(gateway_pb2_grpc.GatewayStub(channel), text=PROMPTS[2], max_new_tokens=24, policy="full")
    samples = scrape_when_idle(embedded_server)
    assert samples['diffspec_kv_pages{state="total"}'] == 1024
    assert samples['diffspec_kv_pages{state="free"}'] == 1024  # nothing in flight
    assert samples['diffspec_sessions{service="target"}'] == samples['diffspec_sessions{service="draft"}'] == 0
    assert samples["diffspec_active_generations"] == 0
    assert samples['diffspec_requests_total{code="OK",method="/diffspec.v1.Gateway/Generate"}'] >= 1
    assert samples["diffspec_generated_tokens_total"] >= 24
    assert samples["diffspec_mean_accepted_length_count"] >= 1
    assert samples["diffspec_stop_depth_count"] >= 1
    assert samples["diffspec_step_seconds_count"] >= 1 and samples["diffspec_prefill_seconds_count"] >= 1


def test_the_draft_s_prefix_cache_counts_what_a_repeated_prompt_finds(embedded_server):
    """A prompt sent twice by one client: the second lookup finds the first's blocks (the cached entries' metric
    counts them), and the text is the same."""
    long_text = "\n".join(PROMPTS) * 8  # a few hundred tokens: several 64-entry blocks
    before = scrape_when_idle(embedded_server)
    with grpc.insecure_channel(embedded_server.address) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        first, again = (generate(stub, text=long_text, max_new_tokens=8, policy="full")[0] for _ in range(2))
    after = scrape_when_idle(embedded_server)
    assert first == again
    hit = 'diffspec_draft_prefix_cache_entries_total{result="hit"}'
    looked_up = 'diffspec_draft_prefix_cache_entries_total{result="looked_up"}'
    assert after[looked_up] - before[looked_up] >= 2 * 64 and after[hit] - before[hit] >= 64
    assert after["diffspec_draft_prefix_cache_cached_entries"] >= 64
