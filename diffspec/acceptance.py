"""Which drafted tree nodes the target accepts, and the bonus token after them.

Terms: the *accepted* nodes form one root-to-node path whose tokens the target agrees with;
the *bonus* token is the target's own next token after that path (always emitted, so every
verification step yields at least one token).

- Greedy: walk from the root; at each node take the child whose token equals the target's
  argmax there; stop when none does. The bonus is the argmax at the last node.
- Sampling (coupled to the token's index): the token a request emits at index k of its output is
  the inverse CDF of the target's distribution there at the uniform u_k, the k-th draw of the
  request's generator (``TokenUniforms``), whichever step decides it: an Auto step, or a tree node
  at depth d of a step whose first token is index k - d. So a verified node's *sample* is the token
  Auto would emit after that node's path; a child is accepted when its token is its parent's sample
  (the first such sibling), and the bonus is the sample where the path ends. Every emitted token is
  the one a seeded Auto run emits at its index: the same law (u_k is independent of all before
  index k) and the same tokens, whatever the trees. A deterministic top-k child is accepted with
  probability p(x), as in SpecInfer/EAGLE's recursive rejection, so acceptance is no lower.

  Drawn up front, the uniforms let every decision be computed in tensors at once
  (``sampling_outcomes``), on the device behind the forward; the walk down the tree
  (``accept_sampling``) then only reads them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from diffspec.sampling import inverse_cdf, is_distribution
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


class TokenUniforms:
    """A sampled request's uniforms, one per index of its output, drawn from its generator in index order (any
    window sizes give the same stream), so the k-th token's is the same in every run with the seed."""

    def __init__(self, generator: torch.Generator) -> None:
        self._generator = generator
        self._next = torch.empty(0, dtype=torch.float64)  # the uniforms of the next indices drawn so far

    def window(self, count: int) -> torch.Tensor:
        """[count] float64 in [0, 1): the uniforms of the next ``count`` indices (drawn now where not yet)."""
        missing = count - len(self._next)
        if missing > 0:
            drawn = torch.rand(missing, generator=self._generator, dtype=torch.float64)
            self._next = torch.cat([self._next, drawn])
        return self._next[:count]

    def advance(self, emitted: int) -> None:
        """``emitted`` tokens were emitted: their uniforms are spent."""
        self.window(emitted)
        self._next = self._next[emitted:]


@dataclass(frozen=True)
class SamplingOutcomes:
    """Every decision a sampled step can reach, on the device the probabilities are on."""

    accepted: torch.Tensor  # [num_nodes] bool: node i is the child its parent takes (its token is the parent's sample)
    bonus: torch.Tensor  # [num_nodes] int64: node i's sample, the bonus if the path ends there; -1: no distribution


def sampling_outcomes(
    tokens: torch.Tensor, parents: torch.Tensor, probs: torch.Tensor, uniforms: torch.Tensor
) -> SamplingOutcomes:
    """tokens, parents [num_nodes] int64 (parent -1: a root, or padding); probs [num_nodes, vocab]: the target's
    distribution at each node; uniforms [num_nodes] float64: each node's token index's uniform (its depth's,
    counted from its step's root), on the same device. Several sessions' trees may lie side by side, each
    node's parent an index into the whole. No value is read back to the host.

    A node's sample is its row's inverse CDF at its uniform. A child is taken when its token is its parent's
    sample and no earlier sibling (lower index) has it; none is taken below a row that is no distribution (NaN
    logits, no mass), whose bonus is -1."""
    num_nodes = probs.shape[0]
    index = torch.arange(num_nodes, device=probs.device)
    samples = inverse_cdf(probs, uniforms)
    distribution = is_distribution(probs)
    parent = parents.clamp(min=0)
    matches = (parents >= 0) & distribution[parent] & (tokens == samples[parent])
    # each parent's first matching child: the lowest index among its matching children (num_nodes: none)
    candidates = torch.where(matches, index, num_nodes)
    first_match = torch.full_like(index, num_nodes).scatter_reduce(0, parent, candidates, "amin")
    accepted = matches & (first_match[parent] == index)
    return SamplingOutcomes(accepted, torch.where(distribution, samples, -1))


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
