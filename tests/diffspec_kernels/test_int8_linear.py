"""Weight-only int8 matmul: the quantiser's rounding, and the Triton kernel against the PyTorch reference
(GPU, and small cases on CPU under the Triton interpreter)."""

from __future__ import annotations

import pytest
import torch

from diffspec_kernels.int8_linear_ref import INT8_MAX, int8_linear_reference, quantize_int8
from tests.diffspec_kernels.kernel_cases import kernel_cases

int8_linear_triton = pytest.importorskip("diffspec_kernels.int8_linear_triton")

# (dtype, rows, out, in): the draft depths of one and sixteen sessions on the 8B shape, a prompt chunk, and
# edges that fill no tile (rows past BLOCK_M, out past BLOCK_N, in past BLOCK_K)
CASES = kernel_cases(
    gpu=[(dtype, rows, n, k) for dtype in (torch.bfloat16, torch.float16, torch.float32)
         for rows, n, k in [(1, 6144, 8192), (10, 28672, 4096), (10, 4096, 14336), (160, 4096, 4096),
                            (64, 32000, 4096), (1000, 4096, 4096), (3, 100, 300)]],
    interpreted=[(torch.float32, 3, 40, 300), (torch.float16, 17, 33, 64), (torch.float32, 70, 65, 70),
                 (torch.float16, 1, 32, 256)],  # the interpreter has no bf16
)  # fmt: skip


@pytest.mark.parametrize("dtype, rows, n, k", CASES)
def test_kernel_matches_the_reference(kernel_device, dtype, rows, n, k):
    gen = torch.Generator().manual_seed(rows * n + k)
    q, scale = quantize_int8(torch.randn(n, k, generator=gen) * 0.02)
    x = torch.randn(2, rows, k, generator=gen).to(dtype)  # leading dims are kept
    q, scale, x = q.to(kernel_device), scale.to(kernel_device), x.to(kernel_device)
    got = int8_linear_triton.int8_linear_triton(x, q, scale)
    want = int8_linear_reference(x, q, scale)
    assert got.shape == (2, rows, n) and got.dtype == dtype
    tolerance = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]  # one rounding of the output
    torch.testing.assert_close(got.float(), want.float(), rtol=tolerance, atol=tolerance * want.abs().max().item())


# (dtype, split_k, block_k) over K = 300: an even cut, a short last split, and more splits asked than K has steps
SPLITS = kernel_cases(
    gpu=[(torch.bfloat16, 2, 64), (torch.bfloat16, 3, 64), (torch.bfloat16, 8, 32)],
    interpreted=[(torch.float32, 2, 64), (torch.float16, 3, 64), (torch.float32, 8, 32)],
)


@pytest.mark.parametrize("dtype, split_k, block_k", SPLITS)
def test_a_split_k_range_adds_up_to_the_reference(kernel_device, dtype, split_k, block_k):
    """K cut among programs (their fp32 partial sums added in split order by a second launch, then scaled)."""
    gen = torch.Generator().manual_seed(split_k)
    q, scale = quantize_int8(torch.randn(40, 300, generator=gen) * 0.02)
    x = torch.randn(3, 300, generator=gen).to(dtype)
    q, scale, x = q.to(kernel_device), scale.to(kernel_device), x.to(kernel_device)
    plan = int8_linear_triton.Int8LinearPlan(16, 16, block_k, num_warps=4, num_stages=2, split_k=split_k)
    got = int8_linear_triton.int8_linear_triton(x, q, scale, plan)
    want = int8_linear_reference(x, q, scale)
    tolerance = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]
    torch.testing.assert_close(got.float(), want.float(), rtol=tolerance, atol=tolerance * want.abs().max().item())
    unsplit = int8_linear_triton.Int8LinearPlan(16, 16, block_k, num_warps=4, num_stages=2)
    torch.testing.assert_close(got, int8_linear_triton.int8_linear_triton(x, q, scale, unsplit), rtol=tolerance, atol=0)


@pytest.mark.parametrize(
    "rows, out_features, in_features, num_sms, split_k",
    [
        (1, 4096, 4096, 132, 3),  # the 8B head's o and vocabulary head: 128 strips, about two programs an SM
        (10, 6144, 8192, 132, 2),  # q|k|v: 192 strips
        (10, 28672, 4096, 132, 1),  # gate|up: 896 strips fill the GPU already
        (16, 4096, 14336, 132, 3),  # down
        (1, 4096, 4096, 0, 1),  # no SMs to fill: nothing split
        (1, 4096, 300, 132, 1),  # K of one step: nothing to split
        (1, 32, 8192, 132, 8),  # one strip: split as far as MAX_SPLIT_K
    ],
)
def test_the_default_plan_splits_k_where_the_strips_leave_sms_idle(rows, out_features, in_features, num_sms, split_k):
    plan = int8_linear_triton.int8_linear_plan(rows, out_features, in_features, num_sms)
    assert (plan.block_m, plan.block_n, plan.block_k, plan.split_k) == (16, 32, 256, split_k)
    assert int8_linear_triton.int8_linear_plan(1024, out_features, in_features, num_sms).split_k == 1  # an ingest


def test_a_strided_view_is_read_as_its_rows(kernel_device):
    """x as a column slice of a wider buffer (row stride past K), the way a split projection hands it on."""
    gen = torch.Generator().manual_seed(5)
    q, scale = quantize_int8(torch.randn(24, 32, generator=gen))
    wide = torch.randn(5, 48, generator=gen).to(kernel_device)
    x = wide[:, 8:40]
    got = int8_linear_triton.int8_linear_triton(x, q.to(kernel_device), scale.to(kernel_device))
    torch.testing.assert_close(got, int8_linear_reference(x, q.to(kernel_device), scale.to(kernel_device)))


def test_bad_operands_are_refused(kernel_device):
    q, scale = quantize_int8(torch.randn(8, 16))
    q, scale = q.to(kernel_device), scale.to(kernel_device)
    x = torch.randn(2, 16, device=kernel_device)
    with pytest.raises(ValueError, match="int8"):
        int8_linear_triton.int8_linear_triton(x, q.float(), scale)
    with pytest.raises(ValueError, match="scale"):
        int8_linear_triton.int8_linear_triton(x, q, scale[:4])
    with pytest.raises(ValueError, match="x must be"):
        int8_linear_triton.int8_linear_triton(x[:, :8], q, scale)


def test_quantisation_keeps_each_row_within_half_a_step():
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(6, 50, generator=gen) * torch.tensor([1e-3, 1e-2, 0.1, 1.0, 10.0, 0.0])[:, None]
    q, scale = quantize_int8(weight)
    assert q.dtype == torch.int8 and scale.dtype == torch.float32
    error = (q.float() * scale[:, None] - weight).abs()
    assert bool((error <= scale[:, None] / 2 + 1e-12).all())  # round to nearest, per row's own step
    assert q[:5].abs().amax(dim=1).tolist() == [INT8_MAX] * 5  # each row's peak uses the whole range
    assert q[5].abs().sum().item() == 0 and scale[5].item() == 1.0  # an all-zero row stays zero, scale 1
    with pytest.raises(ValueError, match="out, in"):
        quantize_int8(torch.zeros(3))
