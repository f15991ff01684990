"""The working set's candidates, ranked where the chunk scores are (PyTorch reference; the CPU path and the
Triton oracle).

Each row of chunk scores belongs to one draft session. Its first ``sink_chunks`` chunks (the attention sinks)
and its last ``recent_chunks`` (the local window) are always in the working set; the chunks between them are
eligible when their score is finite, and the session chooses among them by score. This ranks every row's
chunks so the host copies back only a few dozen ids a row, never the scores (``draft_service/working_set.py``
keeps or replaces each set on them).
"""

from __future__ import annotations

import torch

RANKED_AT = 3  # column of a row's first ranked chunk: sinks_end, recent_start and its eligible count come first


def check_candidate_inputs(scores: torch.Tensor, num_chunks: torch.Tensor, forced: torch.Tensor) -> None:
    rows = scores.shape[0]
    if scores.ndim != 2 or scores.dtype != torch.float32:
        raise ValueError(f"scores must be [rows, width] float32, got {tuple(scores.shape)} {scores.dtype}")
    if tuple(num_chunks.shape) != (rows,) or tuple(forced.shape) != (2 * rows,):
        raise ValueError(f"num_chunks must be [{rows}] and forced [{2 * rows}], got {tuple(num_chunks.shape)} "
                         f"and {tuple(forced.shape)}")  # fmt: skip
    if num_chunks.dtype != torch.int64 or forced.dtype != torch.int64:
        raise ValueError("num_chunks and forced must be int64")


def rank_candidates_reference(
    scores: torch.Tensor,  # [rows, width] float32; row i's first num_chunks[i] score its chunks
    num_chunks: torch.Tensor,  # [rows] int64
    forced: torch.Tensor,  # [2 * rows] int64: each row's sink_chunks, then each row's recent_chunks
    max_ranked: int,  # chunks a row may choose by score at most
) -> torch.Tensor:  # [rows, RANKED_AT + min(max_ranked, width)] int64
    """Per row: where its sinks end (sinks_end = min(sink_chunks, n)) and its recent chunks start (recent_start =
    max(0, n - recent_chunks)), how many chunks are eligible (a finite score, sinks_end <= chunk < recent_start),
    then its chunks best first: the eligible ones ahead, ties to the lower id (a stable sort; -0.0 ties 0.0), the
    rest after them by id. So its first k eligible are its k best. A constant number of launches, no sync."""
    check_candidate_inputs(scores, num_chunks, forced)
    sink, recent = forced.view(2, scores.shape[0], 1)  # each [rows, 1]
    n = num_chunks.view(-1, 1)
    sinks_end, recent_start = torch.minimum(sink, n), (n - recent).clamp(min=0)
    chunks = torch.arange(scores.shape[1], device=scores.device)
    finite = scores.abs() < float("inf")  # NaN compares false; two launches where isfinite takes four
    eligible = (chunks >= sinks_end) & (chunks < recent_start) & finite  # [rows, width]
    # x + 0.0 turns -0.0 into +0.0 and leaves the rest: the rule ties them, and a radix sort need not
    ranked = torch.where(eligible, scores + 0.0, float("-inf")).sort(dim=1, descending=True, stable=True).indices
    return torch.cat([sinks_end, recent_start, eligible.sum(1, keepdim=True), ranked[:, :max_ranked]], dim=1)
