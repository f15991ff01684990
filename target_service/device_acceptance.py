"""A session's accepted path, computed on the device from the verify's outputs without reading them back.

Why: the host reads a verify's results once per step, and a draft in the same process then commits the
accepted entries, a few dozen launches of host time during which the GPU would idle. Computed here
instead, behind the forward, the draft queues that commit while the forward still runs, and the host's
read of the results waits for the forward only.

The rules are ``diffspec.acceptance``'s, in tensors (``diffspec_kernels/accepted_path_ref.py``; on a GPU one
launch, ``accepted_path_triton``). Greedy: a node matches when its token is the target's argmax at its parent,
and the bonus is the argmax at the path's end. Sampled: a node matches when the step's outcomes have its
parent take it, and the bonus is the sample at the path's end; the host walks the same outcomes. The host's
acceptance, computed afterwards from the same values, is what the results carry; a draft that committed from
this one checks that they agree.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from diffspec.acceptance import SamplingOutcomes
from diffspec.device_accept import DeviceAccept
from diffspec.tree import DeviceTree
from diffspec_kernels.accepted_path_ref import accepted_path_reference
from diffspec_kernels.dispatch import triton_kernels_on
from target_service.llama import PagedForwardOutput

AcceptedPath = Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


def greedy_device_accept(
    tree: DeviceTree,
    nodes: int,
    max_depth: int,
    argmax: torch.Tensor,
    first_row: int,
    forward: PagedForwardOutput,
    layers: tuple[int, ...],
) -> DeviceAccept:
    """tree: the device copy of a tree whose first ``nodes`` nodes the forward verified, from row ``first_row``
    of ``argmax`` [rows] int64; ``max_depth``: its depth bound. Nothing is read back to the host."""
    # the target's token after each node; fewer rows where an eager forward computed the real nodes alone
    choices = argmax[first_row : first_row + nodes]
    return _entries(tree, choices.numel(), max_depth, first_row, forward, layers, choices=choices)


def sampled_device_accept(
    tree: DeviceTree,
    max_depth: int,
    outcomes: SamplingOutcomes,
    first_row: int,
    forward: PagedForwardOutput,
    layers: tuple[int, ...],
) -> DeviceAccept:
    """As ``greedy_device_accept``, from the step's ``outcomes``, which cover the tree's first nodes: the rows the
    forward computed for it."""
    nodes = outcomes.accepted.numel()
    accepted, bonus = outcomes.accepted, outcomes.bonus
    return _entries(tree, nodes, max_depth, first_row, forward, layers, accepted=accepted, bonus=bonus)


def _entries(
    tree: DeviceTree,
    nodes: int,
    max_depth: int,
    first_row: int,
    forward: PagedForwardOutput,
    layers: tuple[int, ...],
    **rule: torch.Tensor,
) -> DeviceAccept:
    """The accepted path as entries (``diffspec_kernels.accepted_path_ref``), with each row's features."""
    rows, next_tokens, num_entries = _accepted_path_for(tree.tokens.device)(
        tree.tokens, tree.parents, tree.depths, tree.ancestor_mask, tree.num_nodes, nodes, max_depth + 1, first_row,
        **rule,
    )
    return DeviceAccept(forward.features_of(rows, layers), next_tokens, num_entries, max_depth + 1, rows)


def _accepted_path_for(device: torch.device) -> AcceptedPath:
    if not triton_kernels_on(device):
        return accepted_path_reference
    from diffspec_kernels.accepted_path_triton import accepted_path_triton

    return accepted_path_triton


def compile_accepted_paths(device: torch.device, max_nodes: int) -> int:
    """Run the accepted path once per kernel it compiles on ``device``: each power-of-two node block up to
    ``max_nodes``'s, greedy and sampled, over a chain of that many nodes. A server does this before traffic, so
    the first tree of a new size (an ``online`` session's probe, a larger bound) compiles nothing inside a
    request. Returns the launches: 0 where the PyTorch reference serves the device (nothing to compile)."""
    if not triton_kernels_on(device):
        return 0
    path = _accepted_path_for(device)
    launches = 0
    for block in (1 << k for k in range(max(max_nodes - 1, 0).bit_length() + 1)):
        parents = torch.arange(-1, block - 1, device=device)
        tokens, depths = torch.zeros(block, dtype=torch.int64, device=device), parents + 1
        mask = torch.ones(block, block, dtype=torch.bool, device=device).tril()
        num_nodes = torch.tensor(block, device=device)
        chain = (tokens, parents, depths, mask, num_nodes, block, block, 0)
        path(*chain, choices=tokens)
        path(*chain, accepted=tokens != 0, bonus=tokens)
        launches += 2
    return launches
