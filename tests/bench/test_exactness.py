"""Where two generations part, and a verdict's record (the near-tie rule itself: test_exactness_rule.py)."""

from __future__ import annotations

import json

import pytest

from bench.reproduce.exactness import (
    ENDED,
    Divergence,
    ExactnessResult,
    SampledTieEvidence,
    TieEvidence,
    first_divergence,
)


@pytest.mark.parametrize(
    ("auto", "arm", "expected"),
    [
        ([5, 6, 7], [5, 6, 7], None),
        ([5, 6, 7], [5, 9, 7], Divergence(1, 6, 9)),
        ([5, 6, 7], [4, 6, 7], Divergence(0, 5, 4)),
        ([5, 6, 7], [5, 6], Divergence(2, 7, ENDED)),
        ([5, 6], [5, 6, 7], Divergence(2, ENDED, 7)),
    ],
)
def test_first_divergence(auto, arm, expected):
    assert first_divergence(auto, arm) == expected



def test_the_sampled_boundaries_are_the_lower_token_and_the_one_below_the_higher_in_either_order():
    assert Divergence(3, 10, 20).cdf_boundaries == Divergence(3, 20, 10).cdf_boundaries == [10, 19]


def test_a_verdict_round_trips_through_json_and_records_without_sampled_evidence_load():
    """verdicts.jsonl holds ``to_dict`` as JSON; records written before sampled verdicts lack the field."""
    divergence = Divergence(3, 10, 20)
    sampled = ExactnessResult("near-tie", "u within", divergence, fp32_run_diverges=False,
                              sampled_evidence=SampledTieEvidence(0.5, 0.505, 0.497, 0.01))
    assert ExactnessResult.from_dict(json.loads(json.dumps(sampled.to_dict()))) == sampled
    greedy = ExactnessResult("near-tie", "gap", divergence, TieEvidence(10, 20, 0.01, 0.05, {10: 0.0, 20: 0.01}), False)
    older = {name: value for name, value in greedy.to_dict().items() if name != "sampled_evidence"}
    assert ExactnessResult.from_dict(json.loads(json.dumps(older))) == greedy
