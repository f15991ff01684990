"""The batched working-set selection against the per-session rule it replaced (``reference_selection``): the
same sets, step after step, for rows of different lengths, configs, ties and non-finite scores; and its device
part's ranking against the rule's, on CPU tensors."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from draft_service.working_set import RANKED_AT, WorkingSetConfig, WorkingSetSelector, select_working_sets
from tests.draft_service.reference_selection import ReferenceSelector, candidates_on_cpu, select_alone, select_batch

CONFIGS = [
    WorkingSetConfig(chunk_size=8, budget_tokens=64, sink_chunks=1, recent_chunks=2, reselect_every=8),
    WorkingSetConfig(chunk_size=8, budget_tokens=48, sink_chunks=2, recent_chunks=3, reselect_every=2, min_overlap=0.5),
    WorkingSetConfig(chunk_size=8, budget_tokens=32, sink_chunks=0, recent_chunks=0, reselect_every=99, min_overlap=1),
    WorkingSetConfig(chunk_size=8, budget_tokens=24, sink_chunks=3, recent_chunks=4),  # no room beyond the forced
    WorkingSetConfig(chunk_size=8, budget_tokens=96, sink_chunks=1, recent_chunks=1, reselect_every=5, min_overlap=0.5),
]

SCORE = st.one_of(
    st.sampled_from([0.0, -0.0, 1.0, 2.0, float("nan"), float("inf"), float("-inf")]),  # ties, what is never chosen
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
        got = select_batch(ours, scores, num_chunks)
        assert got == [reference.select(row) for reference, row in zip(theirs, rows)]
        assert [s.scored for s in ours] == [r.scored for r in theirs]
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
    assert select_working_sets([], np.zeros((0, RANKED_AT), dtype=np.int64), np.zeros(0, dtype=np.int64)) == []


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.tuples(st.sampled_from(range(len(CONFIGS))), st.lists(SCORE, max_size=12)), min_size=1, max_size=4),
    st.lists(SCORE, min_size=3, max_size=3),
)
def test_the_device_ranks_each_row_as_the_rule_does(rows, past):
    """``choose_candidates`` on CPU tensors: each row's forced spans, its eligible count and its eligible chunks
    in the rule's order (best first, ties to the lower id; -0.0 ties 0.0), for tiny rows beside the sinks and
    the recent window, ties, non-finite scores and finite scores past a row's chunks (never eligible)."""
    references = [ReferenceSelector(CONFIGS[i]) for i, _ in rows]
    values = [np.array(row, dtype=np.float32) for _, row in rows]
    scores, num_chunks = padded(values)
    scores = np.pad(scores, ((0, 0), (0, len(past))), constant_values=-np.inf)
    for i, n in enumerate(num_chunks):
        scores[i, n : n + len(past)] = past  # finite or not, what lies past a row's chunks is never its to choose
    got = candidates_on_cpu([r.config for r in references], scores, num_chunks)
    for reference, row, n, value in zip(references, got.tolist(), num_chunks.tolist(), values):
        c, best = reference.config, reference.best_first(value)
        assert row[:RANKED_AT] == [min(c.sink_chunks, n), max(0, n - c.recent_chunks), len(best)]
        ranked = row[RANKED_AT:]
        assert ranked[: len(best)] == best[: len(ranked)] and len(ranked) >= min(reference.room(n), len(best))


NAN, INF = float("nan"), float("inf")
ROOM_3 = WorkingSetConfig(chunk_size=8, budget_tokens=64, sink_chunks=1, recent_chunks=2)  # 6 chunks: 3 by score


@pytest.mark.parametrize(
    ("config", "scores", "fresh"),
    [
        (ROOM_3, [9, 1, 1, 1, 1, 1, 9, 9], [1, 2, 3]),  # a tie past room: the lower ids
        (ROOM_3, [9, 0, -0.0, 0, 5, -0.0, 9, 9], [1, 2, 4]),  # -0.0 ties 0.0
        (ROOM_3, [9, NAN, INF, -INF, 3, 2, 9, 9], [4, 5]),  # non-finite never eligible: fewer than room
        (ROOM_3, [1, 2], []),  # every chunk forced
        (ROOM_3, [], []),
        (CONFIGS[3], [1, 2, 3, 4, 5, 6, 7, 8], []),  # room 0: the forced fill the budget
        (CONFIGS[2], [3, 1, 3, 2], [0, 2]),  # no sinks, no recent: 2 by score
    ],
)
def test_a_batch_of_one_chooses_the_best_by_score(config, scores, fresh):
    """Exact fresh sets (the selector's state after its first step) for ties, -0.0, non-finite scores, rows all
    forced or empty, and room 0."""
    selector = WorkingSetSelector(config)
    select_alone(selector, np.array(scores, dtype=np.float32))
    assert selector.scored == fresh
