"""The final rerank and ancestor mask: the Triton kernel against the PyTorch reference it replaces, which must
agree bit for bit on every field, ties, invalid slots and padding included (GPU, and small cases on CPU under
the Triton interpreter)."""

from __future__ import annotations

import math

import pytest
import torch

from draft_service.tree_search import Candidates, best_frontier, expand, rerank, root_frontier
from diffspec_kernels.dispatch import triton_kernels_on
from diffspec_kernels.tree_rerank_ref import rerank_reference
from tests.diffspec_kernels.kernel_cases import kernel_cases

tree_rerank_triton = pytest.importorskip("diffspec_kernels.tree_rerank_triton")

FIELDS = ("tokens", "parents", "draft_probs", "depths", "ancestor_mask", "num_nodes", "host_rows")

# (batch, widths: (frontier rows, children) per depth, nodes, total_tokens per session, seed). Session 0 of a
# batch grows nothing (a padded session: every slot invalid); totals of 0 and 1 keep no candidate; a total of ``nodes``
# exceeds most sessions' valid count. 150 slots take two slot blocks; 100 nodes, four blocks of mask rows.
CASES = kernel_cases(
    gpu=[
        (32, ((1, 10), (10, 10), (10, 10), (10, 10)), 64, (0, 64, 1, 2, 33, 60, 64, 17), 1),
        (128, ((1, 16), (16, 16), (16, 16)), 128, (0, 128, 50, 100, 1, 7), 2),
        (8, ((1, 64), (64, 8), (64, 7)), 256, (0, 256, 255, 100, 2), 3),  # MAX_SLOTS
        (2, ((1, 32), (32, 16)), 512, (0, 512), 4),  # MAX_NODES
        (1, ((1, 1), (1, 1), (1, 1), (1, 1), (1, 1), (1, 1)), 7, (7,), 5),  # a chain
        (4, ((1, 64), (64, 16)), 96, (0, 96, 40, 12), 6),  # 1088 slots: past MAX_SLOTS, the reference
        (2, ((1, 32), (32, 32)), 600, (0, 600), 7),  # past MAX_NODES, the reference
    ],
    interpreted=[
        (3, ((1, 4), (4, 3)), 17, (0, 5, 17), 8),
        (4, ((1, 6), (4, 4), (6, 2)), 12, (0, 12, 3, 1), 9),
        (2, ((1, 10), (10, 10), (10, 4)), 100, (0, 100), 10),
        (3, ((1, 10), (10, 10), (10, 4)), 40, (0, 25, 40), 11),
        (1, ((1, 3), (3, 2)), 5, (5,), 12),  # batch 1
    ],
)


def _candidates(batch: int, widths: tuple[tuple[int, int], ...], seed: int) -> Candidates:
    """A proposal's candidates on CPU, grown by the search's own steps from head log-probs drawn from a few
    values, so that cumulative log-probs tie often; children of probability 0 (-inf) are valid where a session
    has no threshold; session 0 has no plan when there are others."""
    gen = torch.Generator().manual_seed(seed)
    levels = torch.cat([torch.tensor([-0.25, -0.5, -1.0, -3.0, -math.inf]), -torch.rand(3, generator=gen) * 2])
    grows = (torch.arange(batch) > 0) | (batch == 1)
    frontier = root_frontier(torch.randint(1000, (batch,), generator=gen), grows)
    min_log_prob = torch.tensor([-2.5 if b % 2 else -math.inf for b in range(batch)], dtype=torch.float64)
    slabs, first_slot = [], 0
    for depth, (rows, k) in enumerate(widths):
        top = levels[torch.randint(len(levels), (batch, rows, k), generator=gen)].sort(dim=-1, descending=True).values
        children = torch.randint(1, k + 1, (batch,), generator=gen)
        slab = expand(frontier, top, torch.randint(1000, (batch, rows, k), generator=gen), children, min_log_prob, depth)
        slabs.append(slab)
        if depth + 1 < len(widths):
            next_rows = widths[depth + 1][0]
            expand_rows = torch.randint(0, next_rows + 1, (batch,), generator=gen)
            frontier = best_frontier(slab, next_rows, k, expand_rows, first_slot)
        first_slot += rows * k
    return Candidates.cat(slabs)


def _fields(candidates: Candidates, device: str) -> list[torch.Tensor]:
    c = candidates
    return [t.to(device) for t in (c.tokens, c.log_probs, c.own_log_probs, c.valid, c.parent_slots, c.depths)]


def _session_columns(root_tokens: torch.Tensor, totals: torch.Tensor, device: str) -> tuple[torch.Tensor, ...]:
    """root tokens and totals as strided columns of one int64 table, as the proposal's facts hold them."""
    facts = torch.stack([root_tokens, torch.full_like(totals, -5), totals], 1).to(device)  # [B, 3]
    return facts[:, 0], facts[:, 2]


def _assert_same(got: tuple[torch.Tensor, ...], want: tuple[torch.Tensor, ...]) -> None:
    for name, g, w in zip(FIELDS, got, want, strict=True):
        assert g.dtype == w.dtype and g.shape == w.shape, name
        assert torch.equal(g, w), name


@pytest.mark.parametrize("batch, widths, nodes, totals, seed", CASES)
def test_kernel_equals_reference(kernel_device, batch, widths, nodes, totals, seed):
    candidates = _candidates(batch, widths, seed)
    gen = torch.Generator().manual_seed(seed)
    root_tokens = torch.randint(1000, (batch,), generator=gen)
    total_tokens = torch.tensor([totals[b % len(totals)] for b in range(batch)])
    fields = _fields(candidates, kernel_device)
    columns = _session_columns(root_tokens, total_tokens, kernel_device)
    max_depth = len(widths)
    got = tree_rerank_triton.rerank_triton(*fields, *columns, nodes, max_depth)
    want = rerank_reference(*fields, *columns, nodes, max_depth)
    _assert_same(got, want)
    num_nodes = want[5].cpu()
    assert batch == 1 or num_nodes[0] == 1  # the padded session keeps its root alone
    valid_count = candidates.valid.sum(1)
    assert torch.equal(num_nodes, 1 + torch.minimum(valid_count, (total_tokens - 1).clamp(min=0)))


def _slab(log_probs: list[float], valid: list[bool], parents: list[int], depth: int, first_token: int) -> Candidates:
    lp = torch.tensor([log_probs], dtype=torch.float64)
    tokens = first_token + torch.arange(lp.shape[1])[None]
    return Candidates(tokens, lp, lp.float(), torch.tensor([valid]), torch.tensor([parents]), torch.full(lp.shape, depth))


@pytest.mark.interpreted
def test_ties_go_to_the_earlier_slot_and_invalid_slots_come_last(kernel_device):
    """Root children a, b, c at -0.5, -0.5, -0.5 (c invalid), d at -inf (valid: probability 0); a's children
    e, f at -1.0 and b's child g at -1.0. Keeping 4 of them: a, b (the tie, in slot order), then of e, f, g at
    -1.0 the earlier two, e and f; g, d and the invalid c are dropped."""
    first = _slab([-0.5, -0.5, -0.5, -math.inf], [True, True, False, True], [-1] * 4, depth=1, first_token=10)
    second = _slab([-1.0, -1.0, -1.0], [True, True, True], [0, 0, 1], depth=2, first_token=20)
    candidates = Candidates.cat([first, second])
    fields = _fields(candidates, kernel_device)
    root, total = (torch.tensor([v], device=kernel_device) for v in (7, 5))
    got = tree_rerank_triton.rerank_triton(*fields, root, total, 6, 2)
    _assert_same(got, rerank_reference(*fields, root, total, 6, 2))
    tokens, parents, draft_probs, depths, mask, num_nodes, host_rows = (t.cpu() for t in got)
    assert tokens.tolist() == [[7, 10, 11, 20, 21, 0]]
    assert parents.tolist() == [[-1, 0, 0, 1, 1, -1]]
    assert depths.tolist() == [[0, 1, 1, 2, 2, 0]]
    assert num_nodes.tolist() == [5]
    assert draft_probs[0, 5] == 0.0 and draft_probs[0, 0] == 1.0
    assert mask[0].int().tolist() == [
        [1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0],
        [1, 0, 1, 0, 0, 0],
        [1, 1, 0, 1, 0, 0],
        [1, 1, 0, 0, 1, 0],
        [0, 0, 0, 0, 0, 1],  # padding sees itself
    ]
    assert host_rows[0, -1] == 5 and host_rows[0, 6:12].tolist() == [-1, 0, 0, 1, 1, -1]


@pytest.mark.interpreted
def test_a_valid_child_of_probability_zero_is_kept_ahead_of_invalid_slots(kernel_device):
    """Keeping 3 of: a (-1.0, invalid), b (-inf, valid), c (-2.0): c, then b; a is never kept."""
    candidates = _slab([-1.0, -math.inf, -2.0], [False, True, True], [-1] * 3, depth=1, first_token=30)
    fields = _fields(candidates, kernel_device)
    root, total = (torch.tensor([v], device=kernel_device) for v in (1, 4))
    got = tree_rerank_triton.rerank_triton(*fields, root, total, 4, 1)
    _assert_same(got, rerank_reference(*fields, root, total, 4, 1))
    assert got[0].tolist() == [[1, 31, 32, 0]] and got[2][0, 1] == 0.0  # exp(-inf)


def test_bad_shapes_and_dtypes_are_refused():
    fields = _fields(_slab([-1.0], [True], [-1], depth=1, first_token=0), "cpu")
    root, total = torch.tensor([1]), torch.tensor([2])
    with pytest.raises(ValueError, match="log_probs"):
        tree_rerank_triton.rerank_triton(fields[0], fields[1].float(), *fields[2:], root, total, 2, 1)
    with pytest.raises(ValueError, match="total_tokens"):
        tree_rerank_triton.rerank_triton(*fields, root, total.int(), 2, 1)
    with pytest.raises(ValueError, match="root_tokens"):
        tree_rerank_triton.rerank_triton(*fields, torch.tensor([1, 2]), total, 2, 1)


@pytest.mark.gpu
def test_search_rerank_runs_the_kernel_on_a_gpu_and_replays_in_a_graph():
    """``tree_search.rerank`` on a GPU equals the reference, also replayed in a CUDA graph on new inputs."""
    from diffspec.cuda_graphs import record_graph

    device = torch.device("cuda")
    assert triton_kernels_on(device)
    widths, nodes = ((1, 10), (10, 10), (10, 10)), 48
    inputs = [_candidates(16, widths, seed) for seed in (20, 21)]
    static = Candidates(*_fields(inputs[0], "cuda"))
    facts = torch.tensor([[b, 48 - 2 * b] for b in range(16)], device=device)  # root, total columns
    facts[0, 1] = 0

    def run():
        return rerank(static, facts[:, 0], facts[:, 1], nodes, len(widths))

    graph, outputs = record_graph(run, None, device)
    for candidates in inputs:
        for field, value in zip(vars(static).values(), _fields(candidates, "cuda")):
            field.copy_(value)
        graph.replay()
        want = rerank_reference(*_fields(candidates, "cuda"), facts[:, 0], facts[:, 1], nodes, len(widths))
        _assert_same(tuple(vars(outputs).values()), want)
