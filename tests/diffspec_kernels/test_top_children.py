"""Each row's best children: the one-launch Triton kernel against log-softmax + top-k + the id map (GPU, and
small cases on CPU under the Triton interpreter)."""

from __future__ import annotations

import pytest
import torch

from diffspec_kernels.top_children_ref import top_children_reference
from tests.diffspec_kernels.kernel_cases import kernel_cases

top_children_triton = pytest.importorskip("diffspec_kernels.top_children_triton")

# (dtype, rows, vocab, k): 100 pads its block; 40000 (vocab) and 65 (k) take the reference
CASES = kernel_cases(
    gpu=[(dtype, rows, vocab, k) for dtype in (torch.bfloat16, torch.float32)
         for rows, vocab, k in [(1, 4096, 10), (160, 4096, 16), (7, 32000, 10), (3, 16384, 64), (5, 40000, 8),
                                (4, 4096, 65)]],
    interpreted=[(torch.float32, 3, 100, 5), (torch.float16, 2, 64, 3), (torch.float32, 2, 40000, 2),
                 (torch.float32, 1, 32, 32)]  # k = vocab,
)  # fmt: skip


@pytest.mark.parametrize("dtype, rows, vocab, k", CASES)
def test_top_children_match_log_softmax_top_k(kernel_device, dtype, rows, vocab, k):
    gen = torch.Generator().manual_seed(vocab + k)
    logits = (torch.randn(rows, vocab, generator=gen) * 3).to(dtype).to(kernel_device)
    target_ids = (torch.randperm(vocab * 2, generator=gen)[:vocab]).sort().values.to(kernel_device)
    got_lp, got_ids = top_children_triton.top_children_triton(logits, k, target_ids)
    want_lp, want_ids = top_children_reference(logits, k, target_ids)
    assert got_lp.dtype == torch.float32 and got_ids.dtype == torch.int64 and got_ids.shape == (rows, k)
    torch.testing.assert_close(got_lp, want_lp, rtol=0, atol=2e-6)
    # ids agree wherever the value ranking is strict (ties in a low-precision dtype may order either way)
    strict = torch.ones_like(want_ids, dtype=torch.bool)
    strict[:, 1:] &= want_lp[:, 1:] != want_lp[:, :-1]
    strict[:, :-1] &= want_lp[:, 1:] != want_lp[:, :-1]
    assert torch.equal(got_ids[strict], want_ids[strict])


def test_ties_go_to_the_lower_draft_id_and_leading_dims_are_kept(kernel_device):
    logits = torch.tensor([[0.0, 2.0, 1.0, 2.0, 1.0], [3.0, 3.0, 3.0, -1.0, 0.0]]).to(kernel_device)
    target_ids = torch.tensor([10, 11, 12, 13, 14]).to(kernel_device)
    log_probs, ids = top_children_triton.top_children_triton(logits[None], 3, target_ids)
    assert ids.tolist() == [[[11, 13, 12], [10, 11, 12]]]
    torch.testing.assert_close(log_probs[0], torch.log_softmax(logits, -1)[[[0], [1]], [[1, 3, 2], [0, 1, 2]]])


def test_a_bad_id_map_is_refused(kernel_device):
    logits = torch.zeros(2, 8, device=kernel_device)
    with pytest.raises(ValueError, match="target_ids"):
        top_children_triton.top_children_triton(logits, 2, torch.arange(7, device=kernel_device))
