"""Which chunks the draft attends to: sinks, the recent window, and the best-scoring rest.

The working set is the first ``sink_chunks`` chunks (attention sinks), the last
``recent_chunks`` full chunks plus the partial tail (the local window), and as many of the
remaining chunks as the token budget allows, best chunk score first. Scores are cheap
(one bound per chunk), so they are computed every step; the selection changes only every
``reselect_every`` steps or when the fresh top set overlaps the current one by less than
``min_overlap`` (the text has moved on), so the arena is not churned by noise. A batch's
sessions are selected together (``select_working_sets``), one session as a batch of one.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class WorkingSetConfig:
    chunk_size: int = 64  # tokens per chunk
    budget_tokens: int = 2048  # tokens attended at most: selected chunks + the tail since they were chosen
    sink_chunks: int = 1
    recent_chunks: int = 4
    reselect_every: int = 8  # steps between scheduled re-selections
    min_overlap: float = 0.75  # re-select early when the top set drifts below this overlap

    @property
    def max_chunks(self) -> int:
        """Chunks that fit the budget next to the tail: up to one partial chunk, plus the tokens of the accept
        whose scores choose the next set (at most a tree's depth + 1, under a chunk: ``draft_context``)."""
        return max(1, self.budget_tokens // self.chunk_size - 2)


class WorkingSetSelector:
    """Per-session selection state: the chosen scored chunks and when they were chosen (``select_working_sets``
    moves it on)."""

    def __init__(self, config: WorkingSetConfig) -> None:
        self.config = config
        self.scored = np.empty(0, dtype=np.int64)  # [chosen] chunks chosen by score (not sinks or recent)
        self.steps_since = 0


def select_working_sets(
    selectors: list[WorkingSetSelector],
    scores: np.ndarray,  # [len(selectors), width] host scores; row i's first num_chunks[i] are its chunks'
    num_chunks: np.ndarray,  # [len(selectors)] chunks of each row
) -> list[list[int]]:
    """Each selector's working set (all its chunk ids, ascending) for its row of ``scores``; its state moves
    on. The rule runs on the host's arrays for every row at once, each row with its own config: a few passes
    over the whole array, the rest on the rows' chosen chunks (a few dozen each). Every numpy call costs
    microseconds whatever its size, and the accept waits for all of them."""
    rows, width = scores.shape
    configs = [s.config for s in selectors]
    sink, recent, max_chunks, every = np.array(
        [(c.sink_chunks, c.recent_chunks, c.max_chunks, c.reselect_every) for c in configs], dtype=np.int64
    ).reshape(rows, 4).T  # each [rows]
    n = np.asarray(num_chunks, dtype=np.int64)
    # the forced chunks: the sinks [0, sinks_end) and the recent ones [recent_start, n), which may overlap
    sinks_end, recent_start = np.minimum(sink, n), np.maximum(0, n - recent)
    room = np.maximum(0, max_chunks - sinks_end - (n - recent_start) + np.maximum(0, sinks_end - recent_start))
    # the candidates: finite scores of chunks past the sinks and before the recent ones (so within the row)
    chunks = np.arange(width)
    eligible = (chunks >= sinks_end[:, None]) & (chunks < recent_start[:, None]) & np.isfinite(scores)
    num_fresh = np.minimum(room, eligible.sum(1))
    is_fresh = _largest(np.where(eligible, scores, -np.inf), num_fresh)  # [rows, width]
    held = np.full((rows, max((s.scored.size for s in selectors), default=0)), -1, dtype=np.int64)  # [rows, held]
    for row, selector in zip(held, selectors):
        row[: selector.scored.size] = selector.scored
    forced_held = (held < n[:, None]) & ((held < sink[:, None]) | (held >= recent_start[:, None]))
    kept = (held >= 0) & ~forced_held
    kept &= np.cumsum(kept, axis=1) <= room[:, None]  # the first ``room`` chunks still scored-only
    looked_up = kept & (held < width)
    kept_fresh = np.zeros_like(kept)
    kept_fresh[looked_up] = is_fresh[np.nonzero(looked_up)[0], held[looked_up]]
    steps = np.array([s.steps_since for s in selectors], dtype=np.int64) + 1
    min_overlap = np.array([c.min_overlap for c in configs], dtype=np.float64)
    overlap = kept_fresh.sum(1) / np.maximum(1, num_fresh)
    again = (steps >= every) | (overlap < min_overlap) | (kept.sum(1) < num_fresh)
    fresh = (np.flatnonzero(is_fresh[again]) % max(width, 1)).tolist()  # the again rows' fresh chunks, row by row
    taken, selections = 0, []
    for i, selector in enumerate(selectors):  # ascending ids: a set kept in part stays in order
        if again[i]:
            scored = fresh[taken : taken + int(num_fresh[i])]  # num_fresh[i] of them: ``_largest`` chose that many
            taken += len(scored)
            selector.steps_since = 0
        else:
            scored = held[i, kept[i]].tolist()
            selector.steps_since = int(steps[i])
        selector.scored = np.array(scored, dtype=np.int64)
        first, last, stop = int(sinks_end[i]), max(int(sinks_end[i]), int(recent_start[i])), int(n[i])
        selections.append(sorted([*range(first), *scored, *range(last, stop)]))  # disjoint: scored are not forced
    return selections


def _largest(values: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """[rows, width] whether each of ``values`` [rows, width] is among the counts[i] [rows] largest of its row,
    ties to the earlier entry (as a stable sort takes them): one partition of the array, not a sort of each row.
    A tie at a row's last place is rare, so only the rows that have one count their ties."""
    most = int(counts.max(initial=0))
    if most == 0:
        return np.zeros(values.shape, dtype=bool)
    places = np.maximum(counts - 1, 0)
    nth = -np.partition(-values, sorted(set(places.tolist())), axis=1)[np.arange(len(values)), places]
    last = np.where(counts > 0, nth, np.inf)[:, None]  # [rows, 1] the counts[i]-th largest
    chosen = values >= last
    tied_past = np.flatnonzero(chosen.sum(1) > counts)  # rows whose ties at the last place run past counts[i]
    if tied_past.size:
        values, last, counts = values[tied_past], last[tied_past], counts[tied_past]
        above, tied = values > last, values == last
        chosen[tied_past] = above | (tied & (np.cumsum(tied, axis=1) <= (counts - above.sum(1))[:, None]))
    return chosen
