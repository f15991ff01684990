"""EAGLE-3 drafting for one session: the draft KV over committed tokens, and tree expansion.

Entries. The draft's KV entry at position t pairs the target's feature at t with the token at
t + 1; its output predicts the token at t + 2. After the prompt, entries 0..n-1 exist (the last
one pairs f[n-1] with the first generated token, the tree's root at position n).

Trees. A depth-d node's entry sits at position n - 1 + d and pairs its parent's draft output
(the draft's stand-in for the target feature it has not seen) with the node's token; it sees
every committed entry plus its ancestors' entries. Each depth runs the head once for all
nodes it expands.

Accept. Verification commits the root and the accepted nodes; their target features pair with
the emitted tokens (accepted drafts then the bonus) as the next committed entries.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from itertools import takewhile

import torch

from diffspec.tree import DraftTree
from draft_service.draft_attention import draft_attention
from draft_service.draft_context import DraftContext
from draft_service.eagle3_head import Eagle3Head
from draft_service.depth_graphs import DepthGraphs
from draft_service.head_graphs import ROW_BUCKETS, HeadGraphs, top_candidates
from draft_service.tree_budget import DepthPlan, TreeBudget
from draft_service.tree_kv import TreeKV
from draft_service.working_set import WorkingSetConfig

EXTEND_CHUNK = 4096  # committed entries per projection when ingesting a long prompt


@dataclass
class DraftSession:
    context: DraftContext  # committed draft KV and what of it the draft attends to
    last_output: torch.Tensor  # [hidden] draft output of the last committed entry
    num_entries: int  # committed entries = position of the root token
    root_token: int  # last emitted token (target id)


@dataclass
class _Expansion:
    """Nodes of a tree under construction (index 0 = root), kept on the host."""

    tokens: list[int]
    parents: list[int]
    log_probs: list[float]  # cumulative draft log-probability from the root
    own_probs: list[float]  # draft probability of the node given its parent

    def add_children(self, parent: int, log_probs: list[float], tokens: list[float], min_log_prob: float) -> None:
        """The parent's top children (log_probs descending, so the ones above the threshold are a prefix)."""
        base = self.log_probs[parent]
        kept = list(takewhile(lambda lp: base + lp >= min_log_prob, log_probs))
        self.tokens.extend(int(token) for token in tokens[: len(kept)])
        self.parents.extend([parent] * len(kept))
        self.log_probs.extend(base + lp for lp in kept)
        self.own_probs.extend(math.exp(lp) for lp in kept)


class Drafter:
    """Stateless over sessions: the head and the rules that use it."""

    def __init__(self, head: Eagle3Head, cuda_graphs: bool = True) -> None:
        """``cuda_graphs``: on a GPU, replay the head from CUDA graphs (ignored elsewhere)."""
        self.head = head
        self.fused = head.fused_projections()  # a serving head's weights are final
        graphed = cuda_graphs and head.fc.weight.device.type == "cuda"
        self.graphs = HeadGraphs(head, self.fused, capture=True) if graphed else None  # batched sessions
        self.depth_graphs = DepthGraphs(head, self.fused, capture=True) if graphed else None  # one session

    @torch.no_grad()
    def start(
        self,
        prompt_ids: list[int],
        features: torch.Tensor,
        first_token: int,
        salience: WorkingSetConfig | None = None,
    ) -> DraftSession:
        """Build the draft KV over the prompt: entries pair f[t] with token t + 1."""
        c, weight = self.head.config, self.head.fc.weight
        context = DraftContext(c.num_kv_heads, c.head_dim, weight.dtype, weight.device, salience)
        session = DraftSession(context=context, last_output=torch.empty(0), num_entries=0, root_token=first_token)
        self.extend(session, features, [*prompt_ids[1:], first_token])
        return session

    @torch.no_grad()
    def extend(self, session: DraftSession, features: torch.Tensor, next_tokens: list[int]) -> None:
        """Commit entries (features[i], next_tokens[i]) at the next positions.

        A one-layer draft's keys and values do not depend on its attention, so only the last
        entry attends (its output predicts the next tree): ingesting a prompt is O(length).
        """
        device, dtype = self.head.fc.weight.device, self.head.fc.weight.dtype
        features = features.to(device=device, dtype=dtype)
        tokens = torch.tensor(next_tokens, device=device)
        for start in range(0, len(next_tokens), EXTEND_CHUNK):
            stop = min(start + EXTEND_CHUNK, len(next_tokens))
            hidden = self.head.fuse(features[start:stop])
            positions = torch.arange(session.num_entries, session.num_entries + stop - start, device=device)
            q, k, v = self.head.attention_inputs(tokens[start:stop], hidden, positions, self.fused)
            session.context.append(k, v)
            session.num_entries += stop - start
        session.context.refresh(q[-1])
        ctx_k, ctx_v = session.context.view()
        no_new = torch.zeros(1, 0, dtype=torch.bool, device=device)
        attn = draft_attention(q[-1:], ctx_k, ctx_v, k[:0], v[:0], no_new, self.head.scale)
        session.last_output = self.head.attention_outputs(attn, hidden[-1:], self.fused)[0]
        session.root_token = next_tokens[-1]

    @torch.no_grad()
    def propose_many(self, requests: list[ProposalRequest]) -> list[DraftTree]:
        """Grow one tree per session depth by depth, all sessions' nodes of a depth in one head pass.

        Each tree follows its own plan; at the end each keeps its best ``total_tokens`` nodes. On a
        GPU a lone session replays whole depths from graphs; a batch replays the head's halves.
        """
        if len(requests) == 1 and self.depth_graphs is not None and _max_frontier(requests[0]) <= ROW_BUCKETS[-1]:
            return [self._propose_graphed(requests[0], self.depth_graphs)]
        growing = [_Growth.start(r, self.head) for r in requests]
        active = [g for g in growing if g.frontier]
        depth = 0
        while active:
            widest = max(g.plan[depth].children for g in active)
            if depth == 0:
                outputs = torch.stack([g.request.session.last_output for g in active])
                top = top_candidates(self.head, outputs, widest)
            else:
                outputs, top = self._run_entries(active, outputs, depth, widest)
            top_lp, top_tokens = top.tolist()  # the one device -> host copy of a depth
            row = 0
            for g in active:
                stop = row + len(g.frontier)
                g.grow(depth, row, top_lp[row:stop], top_tokens[row:stop])
                row = stop
            active = [g for g in active if g.frontier]
            depth += 1
        return [_select(g.tree, g.request.budget.total_tokens) for g in growing]

    def _propose_graphed(self, request: ProposalRequest, graphs: DepthGraphs) -> DraftTree:
        """One session's tree, each depth one replay of a recorded graph (see ``depth_graphs``)."""
        g = _Growth.start(request, self.head, own_kv=False)
        session = request.session
        graphs.begin(g.context, session.last_output, _max_entries(g.plan), len(g.plan))
        g.entry_of[0] = graphs.root_entry
        depth = 0
        while g.frontier:
            widest = g.plan[depth].children
            if depth == 0:
                top = top_candidates(self.head, session.last_output[None], widest)
            else:
                top = graphs.step(g.enter_frontier(depth), depth, widest)
            top_lp, top_tokens = top.tolist()  # the one device -> host copy of a depth
            g.grow(depth, 0, top_lp, top_tokens)
            depth += 1
        return _select(g.tree, request.budget.total_tokens)

    def _run_entries(
        self, growing: list[_Growth], outputs: torch.Tensor, depth: int, top_k: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One head pass for every frontier node of every session at ``depth`` > 0, each over its context and
        ancestors; ``outputs`` [rows, hidden] are the previous depth's -> this depth's, one row per frontier
        node, and their ``top_candidates``. The dense halves replay from graphs when the rows fit a bucket."""
        per_node = [facts for g in growing for facts in g.enter_frontier(depth)]
        columns = torch.tensor(list(zip(*per_node)), device=outputs.device)  # one host -> device copy
        tokens, parent_rows, positions, parent_entries, _ = columns.unbind()  # own entries: TreeKV numbers alike
        hidden = outputs[parent_rows]
        graphs = self.graphs if self.graphs is not None and self.graphs.fits(tokens.shape[0]) else None
        if graphs is not None:
            q, k, v = graphs.attention_inputs(tokens, hidden, positions)
        else:
            q, k, v = self.head.attention_inputs(tokens, hidden, positions, self.fused)
        attn, row = [], 0
        for g in growing:
            rows = slice(row, row + len(g.frontier))
            kv = g.kv
            assert kv is not None  # batched proposals keep their entries in a TreeKV
            mask = kv.append(k[rows], v[rows], parent_entries[rows], depth)
            attn.append(draft_attention(q[rows], *g.context, *kv.view(), mask, self.head.scale))
            row = rows.stop
        if graphs is not None:
            return graphs.outputs_and_top(torch.cat(attn), hidden, top_k)
        outputs = self.head.attention_outputs(torch.cat(attn), hidden, self.fused)
        return outputs, top_candidates(self.head, outputs, top_k)


@dataclass(frozen=True)
class ProposalRequest:
    session: DraftSession
    plan: list[DepthPlan]  # per depth: frontier nodes expanded, children each
    budget: TreeBudget


@dataclass
class _Growth:
    """One session's tree while it grows."""

    request: ProposalRequest
    tree: _Expansion
    plan: list[DepthPlan]  # the request's plan cut to the budget's depth
    frontier: list[int]  # nodes to expand at the current depth
    min_log_prob: float
    context: tuple[torch.Tensor, torch.Tensor]  # committed keys, values the tree attends to (fixed while it grows)
    kv: TreeKV | None  # the tree's own entries (None: a DepthGraphs proposal keeps them)
    entry_of: dict[int, int]  # expanded node -> its entry in kv (the root: kv.root)
    row_of: dict[int, int] = field(default_factory=dict)  # frontier node -> its row in the depth's head outputs
    num_entries: int = 0  # entries given out so far: the next one's id

    @staticmethod
    def start(request: ProposalRequest, head: Eagle3Head, own_kv: bool = True) -> _Growth:
        session, budget = request.session, request.budget
        tree = _Expansion([session.root_token], [-1], [0.0], [1.0])
        plan = request.plan[: budget.depth]
        min_log_prob = math.log(budget.threshold) if budget.threshold > 0 else -math.inf
        c, weight = head.config, head.fc.weight
        kv = None
        if own_kv:
            kv = TreeKV(_max_entries(plan), len(plan), c.num_kv_heads, c.head_dim, weight.dtype, weight.device)
        entry_of = {0: kv.root} if kv is not None else {}
        return _Growth(request, tree, plan, [0] if plan else [], min_log_prob, session.context.view(), kv, entry_of)

    def enter_frontier(self, depth: int) -> list[tuple[int, int, int, int, int]]:
        """Give each frontier node the next entry id -> per node (token, parent's output row, position,
        parent's entry, own entry): what a head pass at ``depth`` needs of it."""
        position = self.request.session.num_entries - 1 + depth
        facts = []
        for n in self.frontier:
            parent = self.tree.parents[n]
            self.entry_of[n] = self.num_entries
            facts.append((self.tree.tokens[n], self.row_of[parent], position, self.entry_of[parent], self.num_entries))
            self.num_entries += 1
        return facts

    def grow(self, depth: int, first_row: int, log_probs: list[list[float]], tokens: list[list[float]]) -> None:
        """Add each frontier node's top children (one row of log_probs and tokens each; its head output is
        row ``first_row + i`` of the depth's outputs), then pick the next frontier: the best new nodes."""
        first_new, children = len(self.tree.tokens), self.plan[depth].children
        for row, (parent, node_lp, node_tokens) in enumerate(zip(self.frontier, log_probs, tokens), start=first_row):
            self.row_of[parent] = row
            self.tree.add_children(parent, node_lp[:children], node_tokens[:children], self.min_log_prob)
        if depth + 1 >= len(self.plan):
            self.frontier = []
            return
        new = range(first_new, len(self.tree.tokens))
        self.frontier = sorted(new, key=lambda n: -self.tree.log_probs[n])[: self.plan[depth + 1].expand]


def _frontier_sizes(plan: list[DepthPlan]) -> list[int]:
    """Most nodes each depth from 1 on can expand under ``plan`` (each becomes one entry, one head row)."""
    sizes, frontier = [], 1
    for before, step in zip(plan, plan[1:]):
        frontier = min(step.expand, frontier * before.children)
        sizes.append(frontier)
    return sizes


def _max_frontier(request: ProposalRequest) -> int:
    return max(_frontier_sizes(request.plan[: request.budget.depth]), default=1)


def _max_entries(plan: list[DepthPlan]) -> int:
    return sum(_frontier_sizes(plan))


def _select(tree: _Expansion, total_tokens: int) -> DraftTree:
    """The root plus the best ``total_tokens - 1`` nodes by cumulative log-prob, in creation order.

    A child's cumulative log-prob never exceeds its parent's, and ties go to the earlier node,
    so the kept set always contains every kept node's parent.
    """
    ranked = sorted(range(1, len(tree.tokens)), key=lambda n: (-tree.log_probs[n], n))
    kept = sorted([0, *ranked[: total_tokens - 1]])
    new_index = {old: new for new, old in enumerate(kept)}
    return DraftTree(
        tokens=torch.tensor([tree.tokens[n] for n in kept], dtype=torch.long),
        parents=torch.tensor([new_index[tree.parents[n]] if n else -1 for n in kept], dtype=torch.long),
        draft_probs=torch.tensor([tree.own_probs[n] for n in kept], dtype=torch.float32),
    )
