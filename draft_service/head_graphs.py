"""The draft head's dense halves as CUDA graphs, one per (rows, top-k) bucket.

A tree depth runs the head on its frontier rows: projections, norms and RoPE before the
attention, and o_proj, the MLP, the final norm, the draft logits and the top-k after it. Run
eagerly that is ~80 small launches, and the host, not the GPU, sets the pace. Each half is
recorded once per bucket over static buffers; a depth copies its rows in, replays, and reads
its rows back. The attention in between stays eager: its context and tree sizes change every
depth. Rows past the real ones carry stale values and are never read: every op in both halves
is row-wise.

Without ``capture`` the padded buffers run eagerly (the CPU path of the bucketing, which the
tests compare with the unpadded head).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from diffspec.cuda_graphs import record_graph
from draft_service.eagle3_head import Eagle3Head, FusedProjections

ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)


@dataclass
class _Half:
    """One recorded half: its static inputs, outputs and graph."""

    inputs: tuple[torch.Tensor, ...]
    outputs: tuple[torch.Tensor, ...] = ()
    graph: torch.cuda.CUDAGraph | None = None


class HeadGraphs:
    """The two halves per bucket; a batch of several sessions' frontier rows uses them."""

    def __init__(self, head: Eagle3Head, fused: FusedProjections, capture: bool) -> None:
        self.head, self.fused, self.capture = head, fused, capture
        self._pre: dict[int, _Half] = {}
        self._post: dict[tuple[int, int], _Half] = {}
        self._pool = torch.cuda.graph_pool_handle() if capture else None

    def fits(self, rows: int) -> bool:
        return rows <= ROW_BUCKETS[-1]

    def attention_inputs(
        self, tokens: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Eagle3Head.attention_inputs for ``rows`` <= the largest bucket."""
        rows = tokens.shape[0]
        bucket = row_bucket(rows)
        if bucket not in self._pre:
            self._pre[bucket] = _Half((tokens.new_zeros(bucket), hidden.new_zeros(bucket, hidden.shape[1]),
                                       positions.new_zeros(bucket)))  # fmt: skip
        half = self._pre[bucket]
        q, k, v = self._run(half, (tokens, hidden, positions), self._pre_body)
        return q[:rows], k[:rows], v[:rows]

    def outputs_and_top(
        self, attn: torch.Tensor, hidden: torch.Tensor, top_k: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """-> draft outputs [rows, hidden] and [2, rows, top_k] float64: top log-probs and their target ids."""
        rows = attn.shape[0]
        key = (row_bucket(rows), top_k)
        if key not in self._post:
            self._post[key] = _Half((attn.new_zeros(key[0], *attn.shape[1:]), hidden.new_zeros(key[0], hidden.shape[1])))
        half = self._post[key]
        out, top = self._run(half, (attn, hidden), lambda a, h: self._post_body(a, h, top_k))
        return out[:rows], top[:, :rows]

    def _pre_body(self, tokens: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.head.attention_inputs(tokens, hidden, positions, self.fused)

    def _post_body(self, attn: torch.Tensor, hidden: torch.Tensor, top_k: int) -> tuple[torch.Tensor, ...]:
        outputs = self.head.attention_outputs(attn, hidden, self.fused)
        return outputs, top_candidates(self.head, outputs, top_k)

    def _run(self, half: _Half, values: tuple[torch.Tensor, ...], body) -> tuple[torch.Tensor, ...]:
        for static, value in zip(half.inputs, values):
            static[: value.shape[0]].copy_(value)
        if not self.capture:
            return body(*half.inputs)
        if half.graph is None:
            self._record(half, body)
        assert half.graph is not None
        half.graph.replay()
        return half.outputs

    def _record(self, half: _Half, body) -> None:
        half.graph, half.outputs = record_graph(lambda: body(*half.inputs), self._pool, half.inputs[0].device)


def top_candidates(head: Eagle3Head, outputs: torch.Tensor, top_k: int) -> torch.Tensor:
    """[2, rows, top_k] float64: each row's best draft log-probs and their target ids.

    float64 holds the float32 log-probs and the token ids exactly, so one host copy reads both.
    """
    log_probs = torch.log_softmax(head.draft_logits(outputs), dim=-1)
    top_lp, top_ids = log_probs.topk(top_k, dim=-1)
    return torch.stack([top_lp.double(), head.to_target_ids(top_ids).double()])


def row_bucket(rows: int) -> int:
    """The smallest row bucket holding ``rows`` (at most the largest bucket)."""
    return next(b for b in ROW_BUCKETS if b >= rows)
