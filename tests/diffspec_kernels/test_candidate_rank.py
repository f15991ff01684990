"""The working set's candidate ranking: the Triton kernel against its PyTorch reference, which must agree entry
for entry, the order past a row's eligible chunks included (GPU, and small cases on CPU under the Triton
interpreter); and the reference against the order the rule asks for."""

from __future__ import annotations

import pytest
import torch

from diffspec_kernels.candidate_rank_ref import RANKED_AT, rank_candidates_reference
from tests.diffspec_kernels.kernel_cases import kernel_cases

NAN, INF = float("nan"), float("inf")

# (rows, width, max_ranked, seed)
CASES = kernel_cases(
    gpu=[(16, 1024, 28, 1), (16, 2048, 30, 2), (1, 40, 64, 3), (64, 300, 28, 4), (3, 0, 28, 5)],
    interpreted=[(3, 20, 6, 6), (2, 70, 80, 7), (4, 9, 4, 8), (2, 0, 5, 9), (1, 1, 3, 10)],
)


def _rows(rows: int, width: int, seed: int, device: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Scores drawn from a few values (ties are common) with -0.0, NaN and infinities among them; rows of
    different lengths, finite scores past some rows' chunks (never theirs to choose); sinks and recent windows
    from none to past the row's end."""
    gen = torch.Generator().manual_seed(seed)
    levels = torch.tensor([0.0, -0.0, 1.0, 2.0, -1.5, NAN, INF, -INF, 0.5])
    scores = levels[torch.randint(len(levels), (rows, width), generator=gen)]
    num_chunks = torch.randint(0, width + 1, (rows,), generator=gen)
    forced = torch.randint(0, 5, (2 * rows,), generator=gen)
    return scores.to(device), num_chunks.to(device), forced.to(device)


@pytest.mark.parametrize("rows, width, max_ranked, seed", CASES)
def test_kernel_equals_reference(kernel_device, rows, width, max_ranked, seed):
    from diffspec_kernels.candidate_rank_triton import rank_candidates_triton

    scores, num_chunks, forced = _rows(rows, width, seed, kernel_device)
    got = rank_candidates_triton(scores, num_chunks, forced, max_ranked)
    want = rank_candidates_reference(scores, num_chunks, forced, max_ranked)
    assert got.shape == (rows, RANKED_AT + min(max_ranked, width))
    assert torch.equal(got.cpu(), want.cpu())


@pytest.mark.parametrize(
    ("scores", "num_chunks", "sinks", "recent", "max_ranked", "row"),
    [
        ([9, 1, 3, 1, 3, 9, 9], 7, 1, 2, 4, [1, 5, 4, 2, 4, 1, 3]),  # ties to the lower id, then the rest by id
        ([9, 0.0, -0.0, 0.0, 5, 9], 6, 1, 1, 3, [1, 5, 4, 4, 1, 2]),  # -0.0 ties 0.0
        ([9, NAN, INF, -INF, 2, 9], 6, 1, 1, 6, [1, 5, 1, 4, 0, 1, 2, 3, 5]),  # non-finite: not eligible
        ([4, 3, 2, 1], 2, 0, 0, 2, [0, 2, 2, 0, 1]),  # scores past the row's chunks are never eligible
        ([4, 3], 2, 3, 3, 5, [2, 0, 0, 0, 1]),  # every chunk forced
    ],
)
def test_the_reference_ranks_as_the_rule_asks(scores, num_chunks, sinks, recent, max_ranked, row):
    got = rank_candidates_reference(
        torch.tensor([scores], dtype=torch.float32), torch.tensor([num_chunks]), torch.tensor([sinks, recent]),
        max_ranked,
    )  # fmt: skip
    assert got.tolist() == [row]


def test_bad_inputs_are_refused():
    scores, num_chunks, forced = torch.zeros(2, 4), torch.zeros(2, dtype=torch.int64), torch.zeros(4, dtype=torch.int64)
    with pytest.raises(ValueError, match="float32"):
        rank_candidates_reference(scores.double(), num_chunks, forced, 3)
    with pytest.raises(ValueError, match="forced"):
        rank_candidates_reference(scores, num_chunks, forced[:3], 3)
    with pytest.raises(ValueError, match="int64"):
        rank_candidates_reference(scores, num_chunks.int(), forced, 3)
