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

import torch

from diffspec.tree import DraftTree
from draft_service.draft_attention import draft_attention
from draft_service.draft_context import DraftContext
from draft_service.eagle3_head import Eagle3Head
from draft_service.tree_budget import DepthPlan, TreeBudget
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
    """Nodes of a tree under construction (index 0 = root)."""

    tokens: list[int]
    parents: list[int]
    depths: list[int]
    log_probs: list[float]  # cumulative draft log-probability from the root
    own_probs: list[float]  # draft probability of the node given its parent
    outputs: dict[int, torch.Tensor] = field(default_factory=dict)  # node -> draft output of its entry
    entry_of: dict[int, int] = field(default_factory=dict)  # node -> row in the tree KV
    tree_k: list[torch.Tensor] = field(default_factory=list)  # [1, kv_heads, hd] per expanded node
    tree_v: list[torch.Tensor] = field(default_factory=list)

    def add(self, token: int, parent: int, log_prob: float) -> None:
        self.tokens.append(token)
        self.parents.append(parent)
        self.depths.append(self.depths[parent] + 1)
        self.log_probs.append(self.log_probs[parent] + log_prob)
        self.own_probs.append(math.exp(log_prob))

    def ancestors(self, node: int) -> list[int]:
        chain = []
        while node > 0:
            chain.append(node)
            node = self.parents[node]
        return chain


class Drafter:
    """Stateless over sessions: the head and the rules that use it."""

    def __init__(self, head: Eagle3Head) -> None:
        self.head = head

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
            q, k, v = self.head.attention_inputs(tokens[start:stop], hidden, positions)
            session.context.append(k, v)
            session.num_entries += stop - start
        session.context.refresh(q[-1])
        ctx_k, ctx_v = session.context.view()
        no_new = torch.zeros(1, 0, dtype=torch.bool, device=device)
        attn = draft_attention(q[-1:], ctx_k, ctx_v, k[:0], v[:0], no_new, self.head.scale)
        session.last_output = self.head.attention_outputs(attn, hidden[-1:])[0]
        session.root_token = next_tokens[-1]

    @torch.no_grad()
    def propose_many(self, requests: list[ProposalRequest]) -> list[DraftTree]:
        """Grow one tree per session depth by depth, all sessions' nodes of a depth in one head pass.

        Each tree follows its own plan; at the end each keeps its best ``total_tokens`` nodes.
        """
        growing = [_Growth.start(r) for r in requests]
        depth = 0
        while any(g.frontier for g in growing):
            active = [g for g in growing if g.frontier]
            if depth > 0:
                self._run_entries(active)
            outputs = torch.stack([g.tree.outputs[n] for g in active for n in g.frontier])
            log_probs = torch.log_softmax(self.head.draft_logits(outputs), dim=-1)
            widest = max(g.plan[depth].children for g in active)
            top_lp, top_ids = log_probs.topk(widest, dim=-1)
            top_lp, top_tokens = top_lp.tolist(), self.head.to_target_ids(top_ids).tolist()
            row = 0
            for g in active:
                for parent in g.frontier:
                    g.add_children(parent, top_lp[row], top_tokens[row], g.plan[depth].children)
                    row += 1
                g.advance(depth)
            depth += 1
        return [_select(g.tree, g.request.budget.total_tokens) for g in growing]

    def _run_entries(self, growing: list[_Growth]) -> None:
        """One head pass for every frontier node of every session (one depth), each over its context + ancestors."""
        device = self.head.fc.weight.device
        nodes = [(g, n) for g in growing for n in g.frontier]
        tokens = torch.tensor([g.tree.tokens[n] for g, n in nodes], device=device)
        hidden = torch.stack([g.tree.outputs[g.tree.parents[n]] for g, n in nodes])
        positions = torch.tensor(
            [g.request.session.num_entries - 1 + g.tree.depths[n] for g, n in nodes], device=device
        )
        q, k, v = self.head.attention_inputs(tokens, hidden, positions)
        attn = torch.empty_like(q)
        row = 0
        for g in growing:
            rows = slice(row, row + len(g.frontier))
            attn[rows] = self._attend_tree(g, q[rows], k[rows], v[rows])
            row += len(g.frontier)
        for (g, n), out in zip(nodes, self.head.attention_outputs(attn, hidden)):
            g.tree.outputs[n] = out

    def _attend_tree(self, g: _Growth, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Attention of one session's frontier entries over its context and their ancestors' entries."""
        tree = g.tree
        base = len(tree.tree_k)
        for i, n in enumerate(g.frontier):
            tree.entry_of[n] = base + i
            tree.tree_k.append(k[i : i + 1])
            tree.tree_v.append(v[i : i + 1])
        mask = torch.zeros(len(g.frontier), len(tree.tree_k), dtype=torch.bool)  # built on the host, one copy
        for i, n in enumerate(g.frontier):
            mask[i, [tree.entry_of[a] for a in tree.ancestors(n)]] = True
        mask = mask.to(q.device, non_blocking=True)
        ctx_k, ctx_v = g.request.session.context.view()
        return draft_attention(q, ctx_k, ctx_v, torch.cat(tree.tree_k), torch.cat(tree.tree_v), mask, self.head.scale)


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

    @staticmethod
    def start(request: ProposalRequest) -> _Growth:
        session, budget = request.session, request.budget
        tree = _Expansion([session.root_token], [-1], [0], [0.0], [1.0])
        tree.outputs[0] = session.last_output
        plan = request.plan[: budget.depth]
        min_log_prob = math.log(budget.threshold) if budget.threshold > 0 else -math.inf
        return _Growth(request, tree, plan, [0] if plan else [], min_log_prob)

    def add_children(self, parent: int, log_probs: list[float], tokens: list[int], count: int) -> None:
        for lp, token in zip(log_probs[:count], tokens[:count]):
            if self.tree.log_probs[parent] + lp >= self.min_log_prob:
                self.tree.add(token, parent, lp)

    def advance(self, depth: int) -> None:
        """Pick the next depth's frontier: its best nodes by cumulative log-prob."""
        if depth + 1 >= len(self.plan):
            self.frontier = []
            return
        candidates = [n for n in range(len(self.tree.tokens)) if self.tree.depths[n] == depth + 1]
        self.frontier = sorted(candidates, key=lambda n: -self.tree.log_probs[n])[: self.plan[depth + 1].expand]


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
