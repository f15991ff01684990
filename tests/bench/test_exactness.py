"""Where two generations part (the near-tie rule itself: tests/bench/test_exactness_rule.py)."""

from __future__ import annotations

import pytest

from bench.reproduce.exactness import ENDED, Divergence, first_divergence


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

