"""The batched working-set selection against the per-session rule it replaced (``reference_selection``): the
same sets, step after step, for rows of different lengths, configs, ties and non-finite scores."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from draft_service.working_set import WorkingSetConfig, WorkingSetSelector, select_working_sets
from tests.draft_service.reference_selection import ReferenceSelector, select_alone

CONFIGS = [
    WorkingSetConfig(chunk_size=8, budget_tokens=64, sink_chunks=1, recent_chunks=2, reselect_every=8),
    WorkingSetConfig(chunk_size=8, budget_tokens=48, sink_chunks=2, recent_chunks=3, reselect_every=2, min_overlap=0.5),
    WorkingSetConfig(chunk_size=8, budget_tokens=32, sink_chunks=0, recent_chunks=0, reselect_every=99, min_overlap=1),
    WorkingSetConfig(chunk_size=8, budget_tokens=24, sink_chunks=3, recent_chunks=4),  # no room beyond the forced
    WorkingSetConfig(chunk_size=8, budget_tokens=96, sink_chunks=1, recent_chunks=1, reselect_every=5, min_overlap=0.5),
]

SCORE = st.one_of(
    st.sampled_from([0.0, 1.0, 2.0, float("nan"), float("inf"), float("-inf")]),  # ties and what is never chosen
    st.floats(-4, 4, allow_nan=False, width=32),
)


def padded(rows: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Rows of different lengths as one [rows, widest] float32 array, -inf past each row, and the lengths."""
    width = max((row.size for row in rows), default=0)
    scores = np.full((len(rows), width), -np.inf, dtype=np.float32)
    for out, row in zip(scores, rows):
        out[: row.size] = row
    return scores, np.array([row.size for row in rows])


@settings(max_examples=150, deadline=None)
@given(
    st.lists(st.sampled_from(range(len(CONFIGS))), min_size=1, max_size=5),
    st.data(),
)
def test_the_batch_selects_what_each_session_alone_selects(config_ids, data):
    """Each row keeps its own config and state; a row's set, and its state after, are the per-session rule's
    at every step, while the rows' contexts grow at their own pace."""
    ours = [WorkingSetSelector(CONFIGS[i]) for i in config_ids]
    theirs = [ReferenceSelector(CONFIGS[i]) for i in config_ids]
    lengths = data.draw(st.lists(st.integers(0, 24), min_size=len(config_ids), max_size=len(config_ids)))
    for _ in range(data.draw(st.integers(1, 6))):
        lengths = [n + data.draw(st.integers(0, 2)) for n in lengths]
        rows = [np.array(data.draw(st.lists(SCORE, min_size=n, max_size=n)), dtype=np.float32) for n in lengths]
        scores, num_chunks = padded(rows)
        got = select_working_sets(ours, scores, num_chunks)
        assert got == [reference.select(row) for reference, row in zip(theirs, rows)]
        assert [s.scored.tolist() for s in ours] == [r.scored for r in theirs]
        assert [s.steps_since for s in ours] == [r.steps_since for r in theirs]


@pytest.mark.parametrize("config", CONFIGS)
def test_one_session_selects_through_the_batch(config):
    """A batch of one, its row as wide as its chunks, chooses the rule's set step after step."""
    generator = torch.Generator().manual_seed(7)
    selector, reference = WorkingSetSelector(config), ReferenceSelector(config)
    for n in (3, 10, 11, 20, 20, 21):
        scores = torch.randn(n, generator=generator).numpy()
        assert select_alone(selector, scores) == reference.select(scores)


def test_an_empty_batch_selects_nothing():
    assert select_working_sets([], np.zeros((0, 0), dtype=np.float32), np.zeros(0, dtype=np.int64)) == []
