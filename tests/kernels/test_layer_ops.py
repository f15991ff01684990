"""Decoder-layer elementwise steps: the reference's conventions (CPU), the fused kernels against it (GPU)."""

from __future__ import annotations

import pytest
import torch

from kernels.layer_ops import REFERENCE_OPS, layer_ops_for
from kernels.layer_ops_ref import apply_rotary, rms_norm
from target_service.checkpoint import RopeConfig
from target_service.rope import RotaryEmbedding


def test_rotation_is_a_complex_rotation_of_paired_halves():
    """Dimension i and i + D/2 form one complex number, turned by angle position * inv_freq[i]."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, 3, 16, generator=gen, dtype=torch.float64)
    positions = torch.tensor([0, 1, 7, 100, 4095])
    rope = RotaryEmbedding(RopeConfig(theta=10000.0), 16, torch.device("cpu"))
    cos, sin = rope.cos_sin(positions, torch.float64)
    got = apply_rotary(x, cos, sin)
    angle = (positions[:, None].float() * rope.inv_freq).double()  # [5, 8], rounded as cos_sin rounds it
    z = torch.complex(x[..., :8], x[..., 8:]) * torch.polar(torch.ones_like(angle), angle)[:, None, :]
    torch.testing.assert_close(got, torch.cat([z.real, z.imag], dim=-1))


def test_rms_norm_gives_unit_rms_before_the_weight():
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(1)) * 7
    out = rms_norm(x, torch.ones(64), 1e-6)
    torch.testing.assert_close(out.pow(2).mean(-1), torch.ones(4), rtol=1e-4, atol=1e-4)


def test_cpu_uses_the_reference():
    assert layer_ops_for(torch.device("cpu")) is REFERENCE_OPS


# -- GPU: fused kernels against the reference ---------------------------------------------------------

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    """Equal up to one rounding step of the dtype (the fused sum of squares runs in another order)."""
    if want.dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    else:
        torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [64, 3072, 4096, 5000])
def test_fused_norms_match_reference(dtype, hidden):
    ops = layer_ops_for(torch.device("cuda"))
    gen = torch.Generator(device="cuda").manual_seed(hidden)
    x = torch.randn(37, hidden, device="cuda", dtype=dtype, generator=gen) * 3
    delta = torch.randn(37, hidden, device="cuda", dtype=dtype, generator=gen)
    weight = torch.randn(hidden, device="cuda", dtype=dtype, generator=gen)
    _close(ops.rms_norm(x, weight, 1e-5), rms_norm(x, weight, 1e-5))
    summed, normed = ops.add_rms_norm(x, delta, weight, 1e-5)
    want_sum, want_norm = REFERENCE_OPS.add_rms_norm(x, delta, weight, 1e-5)
    assert torch.equal(summed, want_sum)
    _close(normed, want_norm)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_silu_mul_and_rotation_match_reference(dtype):
    ops = layer_ops_for(torch.device("cuda"))
    gen = torch.Generator(device="cuda").manual_seed(7)
    gate = torch.randn(33, 14336, device="cuda", dtype=dtype, generator=gen) * 4
    up = torch.randn(33, 14336, device="cuda", dtype=dtype, generator=gen)
    _close(ops.silu_mul(gate, up), REFERENCE_OPS.silu_mul(gate, up))
    for heads, head_dim in [(32, 128), (8, 64), (3, 128), (4, 96)]:  # 96: half 48 takes the reference
        q = torch.randn(33, heads, head_dim, device="cuda", dtype=dtype, generator=gen)
        rope = RotaryEmbedding(RopeConfig(theta=500000.0), head_dim, torch.device("cuda"))
        cos, sin = rope.cos_sin(torch.randint(0, 131072, (33,), device="cuda", generator=gen), dtype)
        _close(ops.apply_rotary(q, cos, sin), apply_rotary(q, cos, sin))
