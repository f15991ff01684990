"""Which drafted tree nodes the target accepts, and the bonus token after them.

Terms: the *accepted* nodes form one root-to-node path whose tokens the target agrees with;
the *bonus* token is the target's own next token after that path (always emitted, so every
verification step yields at least one token).

- Greedy: walk from the root; at each node take the child whose token equals the target's
  argmax there; stop when none does. The bonus is the argmax at the last node.
- Sampling (multi-draft recursive rejection, as in SpecInfer/EAGLE): at each node, try its
  children in order. The drafts are deterministic top-k candidates, so each has q(x) = 1 and
  is accepted with probability p(x) under the current residual p; on rejection p(x) is set to
  0 and p renormalised. If every child is rejected, the bonus is drawn from the residual.
  The emitted token is then distributed exactly as p, whatever the draft proposed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from diffspec.sampling import sample
from diffspec.tree import DraftTree


@dataclass(frozen=True)
class Acceptance:
    accepted_nodes: list[int]  # tree node indices of the accepted path, root excluded, in depth order
    bonus_token: int  # target token emitted after the accepted path


def accept_greedy(tree: DraftTree, argmax: list[int]) -> Acceptance:
    """argmax[i] = target argmax token at node i."""
    tokens = tree.token_list()
    children = tree.children()
    node, path = 0, []
    while True:
        match = next((c for c in children[node] if tokens[c] == argmax[node]), None)
        if match is None:
            return Acceptance(accepted_nodes=path, bonus_token=argmax[node])
        path.append(match)
        node = match


def accept_sampling(tree: DraftTree, probs: torch.Tensor, generator: torch.Generator) -> Acceptance:
    """probs [num_nodes, vocab]: the target distribution at each node (after temperature/top-p)."""
    tokens = tree.token_list()
    children = tree.children()
    node, path = 0, []
    while True:
        residual = probs[node].detach().to("cpu", torch.float64).clone()
        accepted = None
        for child in children[node]:
            token = tokens[child]
            total = residual.sum()
            p = residual[token] / total if total > 0 else 0.0
            if torch.rand((), generator=generator, dtype=torch.float64) < p:
                accepted = child
                break
            residual[token] = 0.0
        if accepted is None:
            if residual.sum() <= 0:  # rounding left no mass: p itself is the right fallback
                residual = probs[node].detach().to("cpu", torch.float64)
            return Acceptance(accepted_nodes=path, bonus_token=sample(residual / residual.sum(), generator))
        path.append(accepted)
        node = accepted
