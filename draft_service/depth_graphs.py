"""A whole tree depth of one session's proposal as one CUDA graph: head, attention and top-k.

``HeadGraphs`` records the head's dense halves but leaves the attention between them eager,
because every session brings its own context and tree. A single session's proposal (the
latency case) can record the attention too, once its inputs sit in static buffers this class
owns: the context, copied in once per proposal and padded to a power-of-two capacity (keys at
or past its length are masked), and the tree's own entries (keys, values and ancestor paths for
the plan's capacity). A depth then copies one small tensor of per-node facts in, replays, and
reads the top-k back: one launch and one host round trip per depth.

Padding: rows past the real frontier write their entry into a scratch row that no mask shows,
and read the root's path. Paths hold entry ids, the scratch id where a depth is not reached.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from diffspec.cuda_graphs import record_graph
from draft_service.draft_attention import draft_attention
from draft_service.eagle3_head import Eagle3Head, FusedProjections
from draft_service.head_graphs import ROW_BUCKETS, row_bucket, top_candidates

NODE_FACTS = 5  # per node: token, parent's output row, position, parent's entry, own entry
MIN_CONTEXT_CAPACITY = 1024  # smaller contexts share one set of buffers and graphs


@dataclass
class _Recorded:
    nodes: torch.Tensor  # [NODE_FACTS, rows] int64, static input
    top: torch.Tensor  # [2, rows, top_k] float64, static output
    graph: torch.cuda.CUDAGraph | None


class _Buffers:
    """Static context, tree entries and outputs shared by every depth of one capacity."""

    def __init__(self, head: Eagle3Head, context_capacity: int, entry_capacity: int, max_depth: int) -> None:
        c, weight = head.config, head.fc.weight
        kv = (c.num_kv_heads, c.head_dim)
        factory = {"dtype": weight.dtype, "device": weight.device}
        self.ctx_k = torch.zeros(context_capacity, *kv, **factory)
        self.ctx_v = torch.zeros(context_capacity, *kv, **factory)
        self.ctx_len = torch.zeros((), dtype=torch.int64, device=weight.device)
        self.scratch = entry_capacity  # the entry row padded nodes write into
        self.root = entry_capacity + 1  # the path row of the root (no entry of its own)
        self.tree_k = torch.zeros(entry_capacity + 1, *kv, **factory)
        self.tree_v = torch.zeros(entry_capacity + 1, *kv, **factory)
        self.paths = torch.full((entry_capacity + 2, max_depth), self.scratch, dtype=torch.int64, device=weight.device)
        self.outputs = torch.zeros(ROW_BUCKETS[-1], c.hidden_size, **factory)  # the last depth's head outputs
        self.depth = torch.zeros((), dtype=torch.int64, device=weight.device)  # 0-based depth of the entries


class DepthGraphs:
    def __init__(self, head: Eagle3Head, fused: FusedProjections, capture: bool) -> None:
        self.head, self.fused, self.capture = head, fused, capture
        self._buffers: dict[tuple[int, int, int], _Buffers] = {}
        self._recorded: dict[tuple[tuple[int, int, int], int, int], _Recorded] = {}
        self._active: tuple[int, int, int] | None = None
        self._pool = torch.cuda.graph_pool_handle() if capture else None

    def begin(self, context: tuple[torch.Tensor, torch.Tensor], root_output: torch.Tensor,
              entry_capacity: int, max_depth: int) -> None:  # fmt: skip
        """Stage a proposal: its context, an empty tree, the root's output as the depth-0 outputs."""
        length = context[0].shape[0]
        key = (max(MIN_CONTEXT_CAPACITY, 1 << (length - 1).bit_length()), entry_capacity, max_depth)
        if key not in self._buffers:
            self._buffers[key] = _Buffers(self.head, *key)
        buffers = self._buffers[key]
        buffers.ctx_k[:length].copy_(context[0])
        buffers.ctx_v[:length].copy_(context[1])
        buffers.ctx_len.fill_(length)
        buffers.paths.fill_(buffers.scratch)
        buffers.outputs[0].copy_(root_output)
        self._active = key

    @property
    def root_entry(self) -> int:
        """The entry id to give as the parent entry of depth-1 nodes."""
        assert self._active is not None
        return self._buffers[self._active].root

    def step(self, nodes: list[tuple[int, int, int, int, int]], depth: int, top_k: int) -> torch.Tensor:
        """Run depth ``depth`` (>= 1) for ``nodes`` (the NODE_FACTS of each) -> [2, len(nodes), top_k] float64."""
        assert self._active is not None, "begin() a proposal first"
        buffers = self._buffers[self._active]
        rows = row_bucket(len(nodes))
        key = (self._active, rows, top_k)
        padding = (0, 0, 0, buffers.root, buffers.scratch)
        facts = torch.tensor([*nodes, *[padding] * (rows - len(nodes))], dtype=torch.int64).T
        buffers.depth.fill_(depth - 1)
        if key not in self._recorded:
            static_nodes = torch.empty(facts.shape, dtype=torch.int64, device=buffers.outputs.device)
            self._recorded[key] = _Recorded(static_nodes, torch.empty(0), None)
        recorded = self._recorded[key]
        recorded.nodes.copy_(facts)
        if not self.capture:
            return self._body(buffers, recorded.nodes, top_k)[:, : len(nodes)]
        if recorded.graph is None:
            self._record(buffers, recorded, top_k)
        assert recorded.graph is not None
        recorded.graph.replay()
        return recorded.top[:, : len(nodes)]

    def _body(self, buffers: _Buffers, nodes: torch.Tensor, top_k: int) -> torch.Tensor:
        tokens, parent_rows, positions, parent_entries, entries = nodes
        hidden = buffers.outputs[parent_rows]
        q, k, v = self.head.attention_inputs(tokens, hidden, positions, self.fused)
        buffers.tree_k.index_copy_(0, entries, k)
        buffers.tree_v.index_copy_(0, entries, v)
        paths = buffers.paths[parent_entries]  # [rows, max_depth]: the parents' paths ...
        paths.scatter_(1, buffers.depth.expand(entries.shape[0], 1), entries[:, None])  # ... plus the node itself
        buffers.paths.index_copy_(0, entries, paths)
        sees = torch.zeros(entries.shape[0], buffers.tree_k.shape[0], dtype=torch.bool, device=entries.device)
        sees.scatter_(1, paths, True)
        sees[:, buffers.scratch] = False
        ctx_valid = torch.arange(buffers.ctx_k.shape[0], device=entries.device) < buffers.ctx_len
        attn = draft_attention(
            q, buffers.ctx_k, buffers.ctx_v, buffers.tree_k, buffers.tree_v, sees, self.head.scale, ctx_valid
        )
        outputs = self.head.attention_outputs(attn, hidden, self.fused)
        buffers.outputs[: outputs.shape[0]].copy_(outputs)
        return top_candidates(self.head, outputs, top_k)

    def _record(self, buffers: _Buffers, recorded: _Recorded, top_k: int) -> None:
        """The warm-up writes this depth's entries and paths exactly as the replay will, but it also
        overwrites the previous depth's outputs, which the replay reads: those are put back."""
        previous = buffers.outputs.clone()
        recorded.graph, recorded.top = record_graph(
            lambda: self._body(buffers, recorded.nodes, top_k),
            self._pool,
            buffers.outputs.device,
            after_warm_up=lambda: buffers.outputs.copy_(previous),
        )
