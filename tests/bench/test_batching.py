"""bench.batching's rows on the bundled pair (CPU): the online bounds proposed within, each bound's audit and
its progress line, each row counting its own run alone."""

from __future__ import annotations

from typing import Iterator

import pytest

from bench.batching import measure
from bench.bound_audits import audit_lines
from diffspec.sampling_params import SamplingParams
from diffspec.settings import DiffSpecSettings
from gateway.assembly import build_engine
from gateway.engine import SpeculativeEngine
from tests.conftest import CODE_PROMPTS

NEW_TOKENS = 24


@pytest.fixture(scope="module")
def engine() -> Iterator[SpeculativeEngine]:
    built = build_engine(DiffSpecSettings(num_pages=256))
    yield built
    built.close()


def streams(engine: SpeculativeEngine, count: int) -> list[list[list[int]]]:
    """``count`` streams of one request each, a code prompt apiece."""
    return [[engine.tokenizer(prompt)["input_ids"]] for prompt in CODE_PROMPTS[:count]]


def test_an_online_row_audits_each_bound_it_proposed_within(engine):
    measure(engine, "diffspec", streams(engine, 2), NEW_TOKENS)  # the runtime's first bound: another run's
    proposed_before = sum(engine.draft.bounds_proposed.values())
    row = measure(engine, "diffspec", streams(engine, 2), NEW_TOKENS)
    audit = row["online_bound_audit"]
    assert sum(row["online_bounds"].values()) == sum(engine.draft.bounds_proposed.values()) - proposed_before > 0
    assert row["online_bounds"] == {key: bound["proposals"] for key, bound in audit.items()}
    for key, bound in audit.items():  # the bounds a run meets hang on measured costs: each may be short
        realised, depth = bound["realised_tokens_per_step"], int(key.split(":")[1])
        assert realised is None or 1 <= realised <= depth + 1
        assert bound["measured_steps"] <= bound["proposals"]
        for ms in filter(None, [bound["predicted_ms"], bound["measured_ms"]]):  # each part rounded to 1 us
            assert ms["step"] == pytest.approx(ms["overhead"] + ms["draft"] + ms["verify"], abs=2e-3)
    assert any(bound["realised_tokens_per_step"] for bound in audit.values())
    lines = audit_lines("diffspec x2", audit)
    assert len(lines) == len(audit)
    assert all(line.startswith(f"  diffspec x2 bound {key}: ") for line, key in zip(lines, audit))
    assert row["tokens"] == 2 * NEW_TOKENS and 1.0 <= row["tau"] <= 9.0  # a speculative step emits 1 to depth + 1
    assert row["decode_tokens_per_s_per_stream"] > 0
    cost = row["draft_cost_ms"]  # two streams: batch bucket 2 (the bit length of 2) was measured
    measured = [points for key, points in cost.items() if key.startswith("bucket 2, attended ")]
    assert measured and all(points and all(ms > 0 for ms in points.values()) for points in measured)
    priced = list(cost["priced"].values())
    assert len(priced) == 10 and priced == sorted(priced)  # a deeper proposal never priced lower


def test_an_auto_row_has_no_bounds(engine):
    row = measure(engine, "auto", streams(engine, 1), NEW_TOKENS)
    assert row["online_bounds"] == row["online_bound_audit"] == {}
    assert row["tau"] == 1.0  # one token a target step
    assert row["tokens"] == NEW_TOKENS and row["decode_tokens_per_s_per_stream"] > 0
    assert audit_lines("auto x1", row["online_bound_audit"]) == []


def test_a_sampled_row_runs_every_stream_through_the_sampled_step(engine):
    """Two sampled streams verified together: their outcomes are computed side by side in each step."""
    row = measure(engine, "diffspec", streams(engine, 2), NEW_TOKENS, SamplingParams(temperature=0.8, seed=0))
    assert row["tokens"] == 2 * NEW_TOKENS and 1.0 <= row["tau"] <= 9.0
    assert row["mean_requests_per_verify"] > 1  # the two streams shared verifies
