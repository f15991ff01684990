"""The host-side tree search the device proposal replaced, kept as its test oracle.

One session at a time, the tree in Python lists: each depth runs the head on the frontier
nodes, adds each node's top children down to the threshold, and keeps the best ``expand`` new
nodes by cumulative log-prob (ties to the earlier node) as the next frontier; at the end the
root plus the best ``total_tokens - 1`` nodes, in creation order.

A node's output comes from one of two oracles. ``reference_tree`` runs the drafter's own pieces,
layer after layer, over what the session attends to (its working set too) plus the node's
ancestors' entries. ``dense_reference_tree`` recomputes the whole committed sequence plus the
node's path with ``Eagle3Head.forward_dense``: no draft KV at all (full context only).
"""

from __future__ import annotations

import math
from typing import Callable

import torch

from diffspec.tree import DraftTree
from draft_service.draft_attention import draft_attention
from draft_service.drafter import Drafter, DraftSession, ProposalRequest
from draft_service.eagle3_head import Eagle3Head
from draft_service.serving_weights import ServingLinear
from draft_service.tree_search import top_children

# (depth, frontier nodes, every node's token, every node's parent, outputs so far) -> [frontier, hidden]
NodeOutputs = Callable[[int, list[int], list[int], list[int], dict[int, torch.Tensor]], torch.Tensor]


@torch.no_grad()
def root_output(drafter: Drafter, session: DraftSession) -> torch.Tensor:
    """[hidden] the draft output of the session's last committed entry over what it attends to: one
    session, eagerly, as the proposal's root pass computes it for a batch (in the last layer)."""
    head, c = drafter.head, drafter.head.config
    last = c.num_layers - 1
    empty = session.root_query.new_zeros(0, c.num_kv_heads, c.head_dim)
    no_new = torch.zeros(1, 0, dtype=torch.bool, device=empty.device)
    context = session.context.view(last)
    attended = draft_attention(session.root_query[None], *context, empty, empty, no_new, head.scale)
    return head.attention_outputs(attended, session.root_hidden[None], drafter.weights.layers[last], last)[0]


@torch.no_grad()
def reference_tree(drafter: Drafter, request: ProposalRequest) -> DraftTree:
    """The tree from the drafter's pieces: each layer over the session's attended context of that layer."""
    session, layers = request.session, drafter.head.config.num_layers
    entry_keys: list[list[torch.Tensor]] = [[] for _ in range(layers)]  # per layer, the tree's entries so far
    entry_values: list[list[torch.Tensor]] = [[] for _ in range(layers)]
    path_of: dict[int, list[int]] = {0: []}  # node -> its ancestors' entries and its own

    def outputs(depth, frontier, tokens, parents, output_of):  # noqa: ANN001, ANN202 - a NodeOutputs
        head = drafter.head
        hidden = torch.stack([output_of[parents[n]] for n in frontier])
        node_tokens = torch.tensor([tokens[n] for n in frontier], device=hidden.device)
        rope = head.rope(torch.full_like(node_tokens, session.num_entries - 1 + depth))
        for i, n in enumerate(frontier):
            path_of[n] = [*path_of[parents[n]], len(entry_keys[0]) + i]
        mask = torch.zeros(len(frontier), len(entry_keys[0]) + len(frontier), dtype=torch.bool, device=hidden.device)
        for i, n in enumerate(frontier):
            mask[i, path_of[n]] = True
        for layer in range(layers):
            q, k, v = head.attention_inputs(node_tokens, hidden, rope, drafter.weights.layers[layer], layer=layer)
            entry_keys[layer] += list(k)
            entry_values[layer] += list(v)
            new_k, new_v = torch.stack(entry_keys[layer]), torch.stack(entry_values[layer])
            attn = draft_attention(q, *session.context.view(layer), new_k, new_v, mask, head.scale)
            hidden = head.attention_outputs(attn, hidden, drafter.weights.layers[layer], layer)
        return hidden

    return _search(drafter.head, request, root_output(drafter, session), outputs, drafter.weights.lm_head)


@torch.no_grad()
def dense_reference_tree(
    head: Eagle3Head, request: ProposalRequest, tokens: list[int], features: torch.Tensor
) -> DraftTree:
    """The tree from full causal recomputation: ``tokens`` [N] and ``features`` [N, 3 * target_hidden] are the
    session's committed entries (entry t pairs features[t] with tokens[t]); a node's output is the last row of
    ``forward_dense`` over them plus its path, each path entry pairing its token with its parent's output."""
    committed = head.fuse(features.to(head.fc.weight))  # [N, hidden]

    def dense_output(path_tokens: list[int], path_hidden: list[torch.Tensor]) -> torch.Tensor:
        ids = torch.tensor([tokens + path_tokens], device=committed.device)
        hidden = torch.cat([committed, *[h[None] for h in path_hidden]])[None]
        positions = torch.arange(ids.shape[1], device=committed.device)[None]
        return head.forward_dense(ids, hidden, positions)[0, -1]

    def outputs(depth, frontier, node_tokens, parents, output_of):  # noqa: ANN001, ANN202 - a NodeOutputs
        rows = []
        for node in frontier:
            path = [node]
            while parents[path[0]] > 0:
                path.insert(0, parents[path[0]])
            assert len(path) == depth
            rows.append(dense_output([node_tokens[m] for m in path], [output_of[parents[m]] for m in path]))
        return torch.stack(rows)

    return _search(head, request, dense_output([], []), outputs)


def _search(
    head: Eagle3Head,
    request: ProposalRequest,
    root: torch.Tensor,
    node_outputs: NodeOutputs,
    lm_head: ServingLinear | None = None,
) -> DraftTree:
    session, budget = request.session, request.budget
    plan = request.plan[: budget.depth]
    min_log_prob = math.log(budget.threshold) if budget.threshold > 0 else -math.inf
    tokens, parents, log_probs, own_probs = [session.root_token], [-1], [0.0], [1.0]
    output_of = {0: root}
    frontier = [0] if plan else []
    target_ids = head.to_target_ids(torch.arange(head.config.draft_vocab_size, device=root.device))
    for depth, step in enumerate(plan):
        if not frontier:
            break
        outputs = node_outputs(depth, frontier, tokens, parents, output_of) if depth > 0 else root[None]
        for i, n in enumerate(frontier):
            output_of[n] = outputs[i]
        top_lp, top_tokens = top_children(head.vocab_logits(outputs, lm_head), step.children, target_ids)
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
