"""One depth of the tree search: the Triton kernel against the tensor ops it replaces (``expand`` then
``best_frontier``), which must agree bit for bit, ties and invalid slots included (GPU, and small cases on
CPU under the Triton interpreter)."""

from __future__ import annotations

import pytest
import torch

from draft_service.tree_search import Frontier, best_frontier, expand
from tests.diffspec_kernels.kernel_cases import kernel_cases

# (batch, rows, k, next_rows, seed)
CASES = kernel_cases(
    gpu=[(16, 10, 10, 10, 1), (32, 16, 16, 48, 2), (1, 1, 64, 16, 3), (8, 64, 4, 256, 4), (4, 24, 10, 0, 5)],
    interpreted=[(3, 4, 3, 4, 6), (2, 1, 5, 3, 7), (4, 6, 2, 0, 8), (2, 3, 48, 100, 9)],
)


def _random_depth(batch: int, rows: int, k: int, device: str, seed: int):
    """A frontier and its children's top log-probs drawn from a few values, so that ties are common; some
    -inf children (probability 0), an all-invalid (padded) session, thresholds that cut some slots."""
    gen = torch.Generator().manual_seed(seed)
    levels = torch.tensor([-0.25, -0.5, -1.0, -3.0, float("-inf")])
    top = levels[torch.randint(len(levels), (batch, rows, k), generator=gen)].sort(dim=-1, descending=True).values
    frontier_log_probs = -torch.randint(0, 3, (batch, rows), generator=gen).double() * 0.5
    frontier_valid = torch.rand(batch, rows, generator=gen) < 0.8
    frontier_valid[0] = False  # a padded session: no plan
    frontier = Frontier(
        tokens=torch.randint(100, (batch, rows), generator=gen),
        parent_rows=torch.randint(rows, (batch, rows), generator=gen),
        log_probs=frontier_log_probs,
        valid=frontier_valid,
        slots=torch.randint(-1, 50, (batch, rows), generator=gen),
    )
    facts = torch.stack(
        [torch.randint(0, k + 1, (batch,), generator=gen), torch.randint(0, rows * k + 1, (batch,), generator=gen)], 1
    )  # [B, 2]: children, expand rows as strided columns, as the proposal's facts hold them
    min_log_prob = torch.tensor([-2.0 if b % 2 else float("-inf") for b in range(batch)], dtype=torch.float64)
    if batch > 1:  # session 1 keeps every child, those of probability 0 too: valid slots at -inf
        min_log_prob[1], facts[1, 0] = float("-inf"), k
        top[1, :, -1] = float("-inf")
    tokens = torch.randint(1000, (batch, rows, k), generator=gen)
    moved = lambda t: t.to(device)  # noqa: E731
    frontier = Frontier(*map(moved, (frontier.tokens, frontier.parent_rows, frontier.log_probs, frontier.valid, frontier.slots)))
    return frontier, moved(top), moved(tokens), moved(facts), moved(min_log_prob)


@pytest.mark.parametrize("batch, rows, k, next_rows, seed", CASES)
def test_kernel_equals_expand_then_best_frontier(kernel_device, batch, rows, k, next_rows, seed):
    from diffspec_kernels.tree_frontier_triton import frontier_step_triton

    frontier, top, tokens, facts, min_log_prob = _random_depth(batch, rows, k, kernel_device, seed)
    children, expand_rows = facts[:, 0], facts[:, 1]
    first_slot = 7
    got = frontier_step_triton(
        frontier.log_probs, frontier.valid, frontier.slots, top, tokens, children, min_log_prob, expand_rows,
        next_rows, first_slot,
    )  # fmt: skip
    slab = expand(frontier, top, tokens, children, min_log_prob, depth=2)
    assert torch.equal(got[0], slab.log_probs)
    assert torch.equal(got[1], slab.valid)
    assert torch.equal(got[2], slab.parent_slots)
    if next_rows:
        want = best_frontier(slab, next_rows, k, expand_rows, first_slot)
        for got_field, want_field in zip(got[3:], (want.tokens, want.parent_rows, want.log_probs, want.valid, want.slots)):
            assert torch.equal(got_field, want_field)
    else:
        assert all(t.shape == (batch, 0) for t in got[3:])


def test_a_slab_too_wide_for_the_kernel_is_refused():
    from diffspec_kernels.tree_frontier_triton import MAX_SLOTS, frontier_step_triton

    rows, k = 2, MAX_SLOTS  # 2 x MAX_SLOTS slots
    zeros = torch.zeros(1, rows)
    with pytest.raises(ValueError, match="beyond this kernel"):
        frontier_step_triton(
            zeros.double(), zeros.bool(), zeros.long(), torch.zeros(1, rows, k), torch.zeros(1, rows, k).long(),
            torch.ones(1).long(), torch.zeros(1).double(), torch.ones(1).long(), 1, 0,
        )  # fmt: skip


def test_a_valid_child_of_probability_zero_ranks_ahead_of_every_invalid_slot(kernel_device):
    """Slots 0, 1 hang from an invalid row; 3 is valid at -inf: the next frontier is 2, 3, then 0, 1."""
    from diffspec_kernels.tree_frontier_triton import frontier_step_triton

    device = kernel_device
    top = torch.tensor([[[-1.0, float("-inf")], [-1.0, float("-inf")]]], device=device)
    out = frontier_step_triton(
        torch.zeros(1, 2, dtype=torch.float64, device=device), torch.tensor([[False, True]], device=device),
        torch.tensor([[4, 5]], device=device), top, torch.arange(4, device=device).view(1, 2, 2),
        torch.tensor([2], device=device), torch.tensor([float("-inf")], dtype=torch.float64, device=device),
        torch.tensor([4], device=device), 4, 0,
    )  # fmt: skip
    next_tokens, next_valid = out[3], out[6]
    assert next_tokens.tolist() == [[2, 3, 0, 1]]
    assert next_valid.tolist() == [[True, True, False, False]]
