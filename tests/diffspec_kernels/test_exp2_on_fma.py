"""The exponentials a tree-attention tile may compute on the FMA units: 2**x within the fit's relative error."""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")
split_kv = pytest.importorskip("diffspec_kernels.split_kv_triton")


@triton.jit
def _exp2_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):  # x, out [n] fp32
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offsets, mask=offsets < n, other=0.0)
    tl.store(out_ptr + offsets, split_kv.exp2_on_fma(x), mask=offsets < n)


def test_two_to_the_x_is_within_the_fit_and_tiny_below_the_clamp(kernel_device: str) -> None:
    x = torch.cat([torch.linspace(-126, 1, 8191), torch.tensor([-0.0, -1e-7, 0.5, -3.75, -140.0, -1e4])])
    x = x.to(kernel_device)
    out = torch.empty_like(x)
    _exp2_kernel[(triton.cdiv(x.numel(), 1024),)](x, out, x.numel(), BLOCK=1024)
    want = torch.exp2(x.double())
    inside = x >= -126
    assert ((out[inside].double() / want[inside] - 1).abs().max()) < 1.05e-4
    assert torch.equal(out[x == 0], torch.ones_like(out[x == 0]))  # the pieces meet at integers: 2**0 is 1
    assert (out[~inside] <= 2.0**-126 * 1.0002).all() and (out[~inside] > 0).all()
