"""A session's acceptance computed on the device equals the host's rule, rows and tokens alike: a greedy one's
from the argmax, a sampled one's from its step's outcomes."""

from __future__ import annotations

import functools

import pytest
import torch

from diffspec.acceptance import Acceptance, accept_greedy, accept_sampling, sampling_outcomes
from diffspec.device_accept import DeviceAccept
from diffspec.tree import DraftTree, PendingTree
from target_service.device_acceptance import greedy_device_accept, sampled_device_accept
from target_service.llama import PagedForwardOutput
from tests.host_reads import host_reads
from tests.target_service.trees import pending_tree

HIDDEN, LAYERS = 3, (1, 4)


def _tree(num_nodes: int, generator: torch.Generator) -> DraftTree:
    """A random tree whose siblings differ, as a drafter's top-k children do (tokens unique here)."""
    shape = DraftTree.random(num_nodes, generator)
    tokens = torch.randperm(1000, generator=generator)[:num_nodes] + 10
    return DraftTree(tokens, shape.parents, torch.ones(num_nodes))


def _argmax(tree: DraftTree, generator: torch.Generator, follow: float) -> list[int]:
    """The target's token after each node: one of its children's with probability ``follow``, else another."""
    children, tokens = tree.children(), tree.token_list()
    choices = []
    for node in range(tree.num_nodes):
        if children[node] and float(torch.rand((), generator=generator)) < follow:
            pick = children[node][int(torch.randint(len(children[node]), (), generator=generator))]
            choices.append(tokens[pick])
        else:
            choices.append(int(torch.randint(0, 10, (), generator=generator)))  # no node has a token under 10
    return choices


def _forward(rows: int) -> PagedForwardOutput:
    features = torch.arange(rows * len(LAYERS) * HIDDEN, dtype=torch.float32).view(rows, -1)
    empty = torch.zeros(1, rows, 1, HIDDEN)
    return PagedForwardOutput(torch.zeros(rows, HIDDEN), features, empty, empty, LAYERS)


@pytest.mark.parametrize("seed", range(40))
def test_the_device_path_is_the_host_acceptance(seed):
    generator = torch.Generator().manual_seed(seed)
    num_nodes = [1, 2, 5, 17, 40][seed % 5]
    tree = _tree(num_nodes, generator)
    choices = _argmax(tree, generator, follow=[0.0, 0.5, 0.9, 1.0][seed % 4])
    first_row, capacity = 3 + seed % 7, num_nodes + seed % 4  # other sessions' rows first; a padded device copy
    pending = pending_tree(tree, capacity, depth_bound=tree.max_depth + seed % 3)
    argmax = torch.zeros(first_row + capacity + 5, dtype=torch.int64)
    argmax[first_row : first_row + num_nodes] = torch.tensor(choices)
    forward = _forward(argmax.numel())

    tree_bounds = pending.num_nodes, pending.max_depth
    got = greedy_device_accept(pending.on_device, *tree_bounds, argmax, first_row, forward, LAYERS)
    assert_entries_are(got, accept_greedy(tree, choices), pending, first_row, forward)


def assert_entries_are(
    got: DeviceAccept, want: Acceptance, pending: PendingTree, first_row: int, forward: PagedForwardOutput
) -> None:
    """The device's entries are the host acceptance's path: its rows' features and the tokens after them."""
    tree = pending.tree()
    count = 1 + len(want.accepted_nodes)
    assert got.max_entries == pending.max_depth + 1 and int(got.num_entries) == count
    path = [0, *want.accepted_nodes]
    emitted = [*[tree.token_list()[n] for n in want.accepted_nodes], want.bonus_token]
    padding = got.max_entries - count
    assert got.next_tokens.tolist() == emitted + [want.bonus_token] * padding
    rows = [first_row + node for node in path + [path[-1]] * padding]
    assert torch.equal(got.features, forward.features_of(rows, LAYERS))


def _probs(pending: PendingTree, generator: torch.Generator, follow: float, vocab: int = 1024) -> torch.Tensor:
    """[capacity, vocab]: each node's distribution, ``follow`` of its mass on its children's tokens (if any)."""
    tree, capacity = pending.tree(), pending.num_nodes
    probs = torch.softmax(torch.randn(capacity, vocab, generator=generator), dim=-1)
    for node, children in enumerate(tree.children()):
        if children:
            probs[node] *= 1 - follow
        for child in children:
            probs[node, tree.token_list()[child]] += follow / len(children)
    return probs


@pytest.mark.parametrize("seed", range(40))
def test_the_sampled_device_path_is_the_host_acceptance(seed):
    """Random trees (a quarter with repeated sibling tokens, as a foreign tree may have), distributions and
    draws: the device's entries are those of the host's walk over the same outcomes."""
    generator = torch.Generator().manual_seed(seed)
    num_nodes = [1, 2, 5, 17, 40][seed % 5]
    tree = _tree(num_nodes, generator)
    if seed % 4 == 3:
        tree = DraftTree(tree.tokens % 13 + 10, tree.parents, tree.draft_probs)
    first_row, capacity = 3 + seed % 7, num_nodes + seed % 4
    pending = pending_tree(tree, capacity, depth_bound=tree.max_depth + seed % 3)
    probs = _probs(pending, generator, follow=[0.0, 0.5, 0.9, 1.0][seed % 4])
    on_device = pending.on_device
    uniforms = torch.rand(pending.max_depth + 1, generator=generator, dtype=torch.float64)
    outcomes = sampling_outcomes(on_device.tokens, on_device.parents, probs, uniforms[on_device.depths])
    forward = _forward(first_row + capacity + 5)

    got = sampled_device_accept(on_device, pending.max_depth, outcomes, first_row, forward, LAYERS)
    assert_entries_are(got, accept_sampling(tree, outcomes), pending, first_row, forward)


def test_a_subset_of_the_layers_is_picked_in_the_session_s_order():
    tree = DraftTree.chain([10, 11, 12])
    pending = pending_tree(tree, 4, depth_bound=2)
    argmax = torch.tensor([11, 7, 0, 0, 0])
    forward = _forward(5)
    got = greedy_device_accept(pending.on_device, 4, 2, argmax, 0, forward, (4,))
    assert int(got.num_entries) == 2 and got.next_tokens.tolist() == [11, 7, 7]
    assert torch.equal(got.features, forward.features_of([0, 1, 1], (4,)))


def test_the_device_path_reads_nothing_back():
    """It runs behind the forward: a value read on the host (a 0-dim index, an ``item``) would wait for it."""
    generator = torch.Generator().manual_seed(3)
    tree = _tree(17, generator)
    depth_bound = tree.max_depth + 1
    pending = pending_tree(tree, 20, depth_bound)
    argmax = torch.tensor(_argmax(tree, generator, follow=0.9) + [0] * 3)
    forward = _forward(argmax.numel())
    for layers in (LAYERS, (4,)):  # every layer the forward computed, and a subset
        accept = functools.partial(greedy_device_accept, pending.on_device, 20, depth_bound, argmax, 0, forward, layers)
        assert host_reads(accept) == [], layers


def test_the_sampled_device_path_reads_nothing_back():
    generator = torch.Generator().manual_seed(5)
    tree = _tree(17, generator)
    pending = pending_tree(tree, 20, tree.max_depth + 1)
    on_device, probs, forward = pending.on_device, _probs(pending, generator, follow=0.8), _forward(20)
    uniforms = torch.rand(pending.max_depth + 1, generator=generator, dtype=torch.float64)

    def accept() -> DeviceAccept:
        outcomes = sampling_outcomes(on_device.tokens, on_device.parents, probs, uniforms[on_device.depths])
        return sampled_device_accept(on_device, pending.max_depth, outcomes, 0, forward, LAYERS)

    assert host_reads(accept) == []
