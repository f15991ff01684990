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

  Each test and each bonus draw takes its own uniform, drawn before the step (``SamplingDraws``:
  one per node for its test, one per node for the bonus should the path end there). Independent
  uniforms, one per decision, give the rule's law whichever decisions are reached, and drawn up
  front they let every decision be computed in tensors at once (``sampling_outcomes``), on the
  device behind the forward; the walk down the tree (``accept_sampling``) then only reads them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from diffspec.devices import upload
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


@dataclass(frozen=True)
class SamplingDraws:
    """The uniforms one sampled verification step may use, drawn from the request's generator before the step."""

    accept: torch.Tensor  # [num_nodes] float64 in [0, 1): node i's draft is accepted when this is under its chance
    bonus: torch.Tensor  # [num_nodes] float64 in [0, 1): draws the bonus token when the accepted path ends at node i

    @staticmethod
    def draw(num_nodes: int, generator: torch.Generator) -> SamplingDraws:
        uniforms = torch.rand(2, num_nodes, generator=generator, dtype=torch.float64)
        return SamplingDraws(uniforms[0], uniforms[1])

    def first(self, num_nodes: int, device: torch.device) -> SamplingDraws:
        """The first ``num_nodes`` nodes' draws, on ``device`` (one upload)."""
        both = upload(torch.stack([self.accept[:num_nodes], self.bonus[:num_nodes]]), device)
        return SamplingDraws(both[0], both[1])


@dataclass(frozen=True)
class SamplingOutcomes:
    """Every decision a sampled step can reach, on the device the probabilities are on."""

    accepted: torch.Tensor  # [num_nodes] bool: node i is the child its parent takes (its test passes, no earlier one's)
    bonus: torch.Tensor  # [num_nodes] int64: the bonus token if the path ends at node i; -1: its row is no distribution


def sampling_outcomes(
    tokens: torch.Tensor, parents: torch.Tensor, probs: torch.Tensor, draws: SamplingDraws
) -> SamplingOutcomes:
    """tokens, parents [num_nodes] int64 (parent -1: the root, or padding); probs [num_nodes, vocab]: the target's
    distribution at each node; ``draws`` on the same device. No value is read back to the host.

    A node is tried after its earlier siblings (lower indices) were rejected, so its chance is its token's
    probability under its parent's distribution with their tokens removed, renormalised (0 for a token one of
    them had). The bonus at a node is drawn from its distribution with every child's token removed (all were
    rejected), by inverting the cumulative sum at its uniform; should rounding leave no mass, from the
    distribution itself."""
    num_nodes, vocab = probs.shape
    index = torch.arange(num_nodes, device=probs.device)
    totals = probs.sum(dim=-1, dtype=torch.float64)  # [num_nodes]
    is_child = parents >= 0
    parent = parents.clamp(min=0)
    earlier_sibling = (parents[:, None] == parents[None, :]) & (index[None, :] < index[:, None]) & is_child[:, None]
    repeated = (earlier_sibling & (tokens[:, None] == tokens[None, :])).any(dim=1)
    p = torch.where(is_child & ~repeated, probs[parent, tokens].double(), 0.0)  # [num_nodes]
    remaining = totals[parent] - (earlier_sibling.double() * p[None, :]).sum(dim=1)
    chance = torch.where(remaining > 0, p / remaining.clamp(min=torch.finfo(torch.float64).tiny), 0.0)
    passes = is_child & (draws.accept < chance)
    accepted = passes & ~(earlier_sibling & passes[None, :]).any(dim=1)  # children are tried in order
    # each child's token removed from its parent's row, in float64; the root and padding write into a spare last row
    residual = torch.cat([probs.double(), probs.new_zeros(1, vocab, dtype=torch.float64)])
    residual.index_put_((torch.where(is_child, parent, num_nodes), tokens), residual.new_zeros(()))
    residual = residual[:-1]
    cumulative = torch.where(residual.sum(dim=-1, keepdim=True) > 0, residual, probs).cumsum(dim=-1)
    reached = cumulative[:, -1:].contiguous()  # [num_nodes, 1]
    drawn = torch.searchsorted(cumulative, draws.bonus.unsqueeze(-1) * reached, right=True)
    last_possible = torch.searchsorted(cumulative, reached)  # where the sum is reached: the last token with mass
    bonus = torch.minimum(drawn, last_possible).squeeze(-1)
    distribution = torch.isfinite(probs).all(dim=-1) & (totals > 0)  # NaN logits give none
    return SamplingOutcomes(accepted, torch.where(distribution, bonus, -1))


def accept_sampling(tree: DraftTree, outcomes: SamplingOutcomes) -> Acceptance:
    """``outcomes``: a step's, on the host, for at least the tree's nodes. From the root, take the child each node
    takes; where it takes none, the bonus is that node's. Raises ValueError where the target's distribution at
    that node is none."""
    accepted, bonus = outcomes.accepted.tolist(), outcomes.bonus.tolist()
    children = tree.children()
    node, path = 0, []
    while True:
        match = next((c for c in children[node] if accepted[c]), None)
        if match is None:
            if bonus[node] < 0:
                raise ValueError("the target's distribution at a verified node is not one (NaN, or no mass)")
            return Acceptance(accepted_nodes=path, bonus_token=bonus[node])
        path.append(match)
        node = match
