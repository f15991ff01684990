"""A tree's accepted path: the Triton kernel against the PyTorch reference (GPU, and small trees on CPU under the
Triton interpreter), greedy and sampled, padded device copies and short forwards alike; and the reference's
refusal of inputs that do not fit together. The reference against the host's acceptance rule is
tests/target_service/test_device_acceptance.py's."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from diffspec.tree import DraftTree
from diffspec_kernels.accepted_path_ref import accepted_path_reference
from tests.diffspec_kernels.kernel_cases import kernel_cases
from tests.target_service.trees import pending_tree


@dataclass(frozen=True)
class PathCase:
    num_nodes: int  # the tree's real nodes
    padding: int  # device copy's capacity past them
    follow: float  # how often the target takes one of a node's children
    greedy: bool
    first_row: int
    short_forward: bool = False  # the forward computed the real nodes alone (an eager step)

    def __str__(self) -> str:
        rule = "greedy" if self.greedy else "sampled"
        short = "_short" if self.short_forward else ""
        return f"{rule}_n{self.num_nodes}+{self.padding}_follow{self.follow}_row{self.first_row}{short}"


TRITON_CASES = kernel_cases(
    gpu=[
        PathCase(num_nodes, padding, follow, greedy, first_row)
        for num_nodes, padding in [(1, 0), (8, 8), (31, 1), (64, 0), (200, 56)]
        for follow in (0.0, 0.7, 1.0)
        for greedy in (True, False)
        for first_row in (0, 96)
    ],
    interpreted=[
        PathCase(1, 0, 1.0, True, 0),
        PathCase(6, 2, 1.0, True, 5),
        PathCase(13, 3, 1.0, False, 0),
        PathCase(9, 7, 0.6, True, 2, short_forward=True),
        PathCase(20, 0, 0.9, False, 40),
    ],
)


def _tree(num_nodes: int, generator: torch.Generator) -> DraftTree:
    """A random tree whose siblings differ, as a drafter's top-k children do."""
    shape = DraftTree.random(num_nodes, generator)
    return DraftTree(torch.randperm(1000, generator=generator)[:num_nodes] + 10, shape.parents, torch.ones(num_nodes))


def _choices(tree: DraftTree, generator: torch.Generator, follow: float) -> torch.Tensor:
    """[num_nodes] int64: after each node one of its children's tokens with probability ``follow``, else a token
    no node has."""
    children, tokens = tree.children(), tree.token_list()
    picks = []
    for node in range(tree.num_nodes):
        if children[node] and float(torch.rand((), generator=generator)) < follow:
            picks.append(tokens[children[node][int(torch.randint(len(children[node]), (), generator=generator))]])
        else:
            picks.append(int(torch.randint(0, 10, (), generator=generator)))
    return torch.tensor(picks, dtype=torch.int64)


def _inputs(case: PathCase, device: str) -> tuple[tuple, dict]:
    """The positional inputs (tree, nodes, max_entries, first_row) and the rule's keyword inputs."""
    generator = torch.Generator().manual_seed(case.num_nodes * 31 + case.padding)
    tree = _tree(case.num_nodes, generator)
    capacity = case.num_nodes + case.padding
    on_device = pending_tree(tree, capacity, depth_bound=tree.max_depth + 1, device=torch.device(device)).on_device
    nodes = case.num_nodes if case.short_forward else capacity
    tail = torch.randint(0, 10, (nodes - case.num_nodes,), generator=generator)
    choices = torch.cat([_choices(tree, generator, case.follow), tail]).to(device)
    if case.greedy:
        rule = {"choices": choices}
    else:
        parents = on_device.parents[:nodes].clamp(min=0)
        kept = (torch.rand(nodes, generator=generator) < 0.9).to(device)  # a sampled parent may take another child
        accepted = (on_device.tokens[:nodes] == choices[parents]) & kept
        bonus = torch.where(torch.rand(nodes, generator=generator) < 0.1, -1, choices.cpu()).to(device)
        rule = {"accepted": accepted, "bonus": bonus}
    tensors = (on_device.tokens, on_device.parents, on_device.depths, on_device.ancestor_mask, on_device.num_nodes)
    return (*tensors, nodes, tree.max_depth + 2, case.first_row), rule


@pytest.mark.parametrize("case", TRITON_CASES)
def test_triton_matches_reference(kernel_device: str, case: PathCase) -> None:
    triton_path = pytest.importorskip("diffspec_kernels.accepted_path_triton")
    args, rule = _inputs(case, kernel_device)
    want = accepted_path_reference(*args, **rule)
    got = triton_path.accepted_path_triton(*args, **rule)
    for expected, value in zip(want, got):
        assert value.dtype == torch.int64 and value.shape == expected.shape
        assert torch.equal(value, expected)
    if case.follow == 1.0 and case.greedy and case.num_nodes > 1 and not case.short_forward:
        assert int(got[2]) > 1  # some path was accepted, so the entries past the root were compared


def test_the_reference_refuses_inputs_that_do_not_fit() -> None:
    args, rule = _inputs(PathCase(6, 2, 0.8, True, 0), "cpu")
    tokens, parents, depths, mask, num_nodes, nodes, max_entries, first_row = args
    with pytest.raises(ValueError, match="choices"):
        accepted_path_reference(tokens, parents, depths, mask, num_nodes, nodes, max_entries, first_row)
    with pytest.raises(ValueError, match="choices must be"):
        accepted_path_reference(*args, choices=rule["choices"][:3])
    with pytest.raises(ValueError, match="nodes"):
        accepted_path_reference(tokens, parents, depths, mask, num_nodes, nodes + 1, max_entries, first_row, **rule)
    with pytest.raises(ValueError, match="ancestor mask"):
        accepted_path_reference(tokens, parents, depths, mask[:4], num_nodes, nodes, max_entries, first_row, **rule)


@pytest.mark.parametrize(
    ("block", "max_entries", "entries"),
    [(1, 1, 64), (1, 33, 64), (32, 11, 64), (128, 33, 128), (256, 2, 256), (8, 65, 128)],
)
def test_one_entry_block_serves_every_depth_bound_a_draft_budget_allows(block, max_entries, entries) -> None:
    from draft_service.tree_budget import MAX_DEPTH

    triton_path = pytest.importorskip("diffspec_kernels.accepted_path_triton")
    assert triton_path.entries_block(block, max_entries) == entries
    assert triton_path.ENTRY_ROWS >= MAX_DEPTH + 1  # a budget's deepest tree: its entries and the root's


def test_the_warm_up_runs_the_kernel_once_per_node_block_and_rule(monkeypatch) -> None:
    """On CPU under the Triton interpreter: the warm-up's chains are valid inputs for every block it names."""
    pytest.importorskip("diffspec_kernels.accepted_path_triton")
    from target_service import device_acceptance

    monkeypatch.setattr(device_acceptance, "triton_kernels_on", lambda device: True)
    assert device_acceptance.compile_accepted_paths(torch.device("cpu"), 9) == 2 * 5  # blocks 1, 2, 4, 8, 16
    monkeypatch.undo()
    assert device_acceptance.compile_accepted_paths(torch.device("cpu"), 9) == 0  # the reference: nothing compiles


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the kernel compiles on a GPU only")
def test_after_the_warm_up_no_tree_compiles_the_kernel() -> None:
    """Trees of every size up to the verify's limit, any depth bound, row and rule, with the argmax slice at an odd
    offset as a batched step hands it: no compile past the warm-up's."""
    from bench.warmup import triton_compiles
    from diffspec_kernels.accepted_path_triton import accepted_path_triton
    from target_service.device_acceptance import compile_accepted_paths
    from target_service.session import MAX_TREE_NODES

    compile_accepted_paths(torch.device("cuda"), MAX_TREE_NODES)
    before = triton_compiles()["_accepted_path_kernel"]
    for num_nodes, padding in [(1, 0), (5, 3), (17, 15), (33, 0), (48, 16), (100, 28), (200, 56)]:
        for greedy, first_row in [(True, 0), (True, 7), (False, 33)]:
            args, rule = _inputs(PathCase(num_nodes, padding, 0.7, greedy, first_row), "cuda")
            if greedy:  # a slice of a step's argmax: 8 bytes past a 16-byte boundary
                rule = {"choices": torch.cat([rule["choices"][:1], rule["choices"]])[1:]}
            want = accepted_path_reference(*args, **rule)
            got = accepted_path_triton(*args, **rule)
            assert all(torch.equal(g, w) for g, w in zip(got, want))
    assert triton_compiles()["_accepted_path_kernel"] == before
