"""Exactness verdicts: where generations part, and when a divergence is a near-tie."""

from __future__ import annotations

import pytest

from bench.reproduce.exactness import ENDED, Divergence, TieEvidence, classify, first_divergence


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


AT = Divergence(position=3, auto_token=10, arm_token=20)


@pytest.mark.parametrize(
    ("divergence", "evidence", "verdict", "reason"),
    [
        (AT, TieEvidence(10, 20, fp32_margin=0.01, spread=0.05), "near-tie", "below the decode/verify spread"),
        (AT, TieEvidence(10, 20, fp32_margin=0.05, spread=0.05), "mismatch", "is not below"),
        (AT, TieEvidence(10, 20, fp32_margin=2.0, spread=0.05), "mismatch", "is not below"),
        (AT, TieEvidence(20, 10, fp32_margin=0.01, spread=0.05), "mismatch", "does not pick Auto's token"),
        (AT, TieEvidence(10, 30, fp32_margin=0.01, spread=0.05), "mismatch", "not the fp32 runner-up"),
        (Divergence(3, 10, ENDED), TieEvidence(10, 20, 0.01, 0.05), "mismatch", "ended"),
    ],
)
def test_classify(divergence, evidence, verdict, reason):
    result = classify(divergence, evidence)
    assert result.verdict == verdict
    assert reason in result.reason
    assert result.divergence == divergence and result.evidence == evidence
