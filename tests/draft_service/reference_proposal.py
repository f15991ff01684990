"""The host-side tree search the device proposal replaced, kept as its test oracle.

One session at a time, the tree in Python lists: each depth runs the head on the frontier
nodes, adds each node's top children down to the threshold, and keeps the best ``expand`` new
nodes by cumulative log-prob (ties to the earlier node) as the next frontier; at the end the
root plus the best ``total_tokens - 1`` nodes, in creation order.
"""

from __future__ import annotations

import math

import torch

from diffspec.tree import DraftTree
from draft_service.draft_attention import draft_attention
from draft_service.drafter import Drafter, DraftSession, ProposalRequest
from draft_service.tree_search import top_children


@torch.no_grad()
def root_output(drafter: Drafter, session: DraftSession) -> torch.Tensor:
    """[hidden] the draft output of the session's last committed entry over what it attends to: one
    session, eagerly, as the proposal's root pass computes it for a batch."""
    head, c = drafter.head, drafter.head.config
    empty = session.root_query.new_zeros(0, c.num_kv_heads, c.head_dim)
    no_new = torch.zeros(1, 0, dtype=torch.bool, device=empty.device)
    attended = draft_attention(session.root_query[None], *session.context.view(), empty, empty, no_new, head.scale)
    return head.attention_outputs(attended, session.root_hidden[None], drafter.fused)[0]


@torch.no_grad()
def reference_tree(drafter: Drafter, request: ProposalRequest) -> DraftTree:
    head, session, budget = drafter.head, request.session, request.budget
    plan = request.plan[: budget.depth]
    min_log_prob = math.log(budget.threshold) if budget.threshold > 0 else -math.inf
    tokens, parents, log_probs, own_probs = [session.root_token], [-1], [0.0], [1.0]
    ctx_k, ctx_v = session.context.view()
    entry_keys, entry_values, path_of = [], [], {0: []}  # path: the node's ancestors' entries and its own
    root = root_output(drafter, session)
    output_of = {0: root}
    frontier = [0] if plan else []
    for depth, step in enumerate(plan):
        if not frontier:
            break
        if depth > 0:
            hidden = torch.stack([output_of[parents[n]] for n in frontier])
            node_tokens = torch.tensor([tokens[n] for n in frontier], device=hidden.device)
            positions = torch.full_like(node_tokens, session.num_entries - 1 + depth)
            q, k, v = head.attention_inputs(node_tokens, hidden, head.rope(positions), drafter.fused)
            for i, n in enumerate(frontier):
                path_of[n] = [*path_of[parents[n]], len(entry_keys)]
                entry_keys.append(k[i])
                entry_values.append(v[i])
            mask = torch.zeros(len(frontier), len(entry_keys), dtype=torch.bool, device=hidden.device)
            for i, n in enumerate(frontier):
                mask[i, path_of[n]] = True
            attn = draft_attention(
                q, ctx_k, ctx_v, torch.stack(entry_keys), torch.stack(entry_values), mask, head.scale
            )
            outputs = head.attention_outputs(attn, hidden, drafter.fused)
        else:
            outputs = root[None]
        for i, n in enumerate(frontier):
            output_of[n] = outputs[i]
        target_ids = head.to_target_ids(torch.arange(head.config.draft_vocab_size, device=outputs.device))
        top_lp, top_tokens = top_children(head.vocab_logits(outputs), step.children, target_ids)
        first_new = len(tokens)
        for i, n in enumerate(frontier):
            for lp, token in zip(top_lp[i].double().tolist(), top_tokens[i].tolist()):
                if log_probs[n] + lp < min_log_prob:
                    break
                tokens.append(token)
                parents.append(n)
                log_probs.append(log_probs[n] + lp)
                own_probs.append(math.exp(lp))
        if depth + 1 < len(plan):
            new = range(first_new, len(tokens))
            frontier = sorted(new, key=lambda m: -log_probs[m])[: plan[depth + 1].expand]
    ranked = sorted(range(1, len(tokens)), key=lambda m: (-log_probs[m], m))
    kept = sorted([0, *ranked[: budget.total_tokens - 1]])
    new_index = {old: new for new, old in enumerate(kept)}
    return DraftTree(
        tokens=torch.tensor([tokens[m] for m in kept], dtype=torch.long),
        parents=torch.tensor([new_index[parents[m]] if m else -1 for m in kept], dtype=torch.long),
        draft_probs=torch.tensor([own_probs[m] for m in kept], dtype=torch.float32),
    )
