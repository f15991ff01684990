"""Decoder-layer elementwise steps: the reference's conventions (CPU), the fused kernels against it (GPU, and
small cases on CPU under the Triton interpreter)."""

from __future__ import annotations

import pytest
import torch

from diffspec_kernels.dispatch import triton_kernels_on
from diffspec_kernels.layer_ops import REFERENCE_OPS, LayerOps, layer_ops_for
from diffspec_kernels.layer_ops_ref import apply_rotary, rms_norm
from diffspec.model_config import RopeConfig
from diffspec.rope import RotaryEmbedding
from tests.diffspec_kernels.kernel_cases import kernel_cases


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


# -- Fused kernels against the reference: the full set on a GPU, small cases interpreted on CPU -------

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# The Triton 3.6 interpreter truncates fp32 -> bf16 casts (a GPU rounds to nearest even), so the kernels'
# bf16 rounding is checked on a GPU only.
INTERPRETED_DTYPES = [torch.float32, torch.float16]


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    """Equal up to one rounding step of the dtype (the fused sum of squares runs in another order)."""
    if want.dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    else:
        torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2)


def fused_ops(device: str) -> LayerOps:
    """The fused kernels; on a GPU checked to be what the runtime's ``layer_ops_for`` serves there."""
    layer_ops_triton = pytest.importorskip("diffspec_kernels.layer_ops_triton")
    ops = LayerOps(
        rms_norm=layer_ops_triton.rms_norm_triton,
        add_rms_norm=layer_ops_triton.add_rms_norm_triton,
        silu_mul=layer_ops_triton.silu_mul_triton,
        apply_rotary=layer_ops_triton.apply_rotary_triton,
        qkv_rope=layer_ops_triton.qkv_rope_triton,
        head_input=layer_ops_triton.head_input_triton,
    )
    if triton_kernels_on(torch.device(device)):
        assert layer_ops_for(torch.device(device)) == ops
    return ops


NORM_CASES = kernel_cases(
    gpu=[(dtype, 37, hidden) for hidden in [64, 3072, 4096, 5000] for dtype in DTYPES],
    interpreted=[(dtype, 5, hidden) for hidden in [48, 100] for dtype in INTERPRETED_DTYPES],  # 100: a padded block
)


@pytest.mark.parametrize("dtype, rows, hidden", NORM_CASES)
def test_fused_norms_match_reference(kernel_device, dtype, rows, hidden):
    ops = fused_ops(kernel_device)
    gen = torch.Generator(device=kernel_device).manual_seed(hidden)
    x = torch.randn(rows, hidden, device=kernel_device, dtype=dtype, generator=gen) * 3
    delta = torch.randn(rows, hidden, device=kernel_device, dtype=dtype, generator=gen)
    weight = torch.randn(hidden, device=kernel_device, dtype=dtype, generator=gen)
    _close(ops.rms_norm(x, weight, 1e-5), rms_norm(x, weight, 1e-5))
    summed, normed = ops.add_rms_norm(x, delta, weight, 1e-5)
    want_sum, want_norm = REFERENCE_OPS.add_rms_norm(x, delta, weight, 1e-5)
    assert torch.equal(summed, want_sum)
    _close(normed, want_norm)


# (dtype, tokens, intermediate size, (heads, head_dim) of each rotation); head_dim 96 and 24: a half that is
# not a power of two takes the reference
SILU_ROTATION_CASES = kernel_cases(
    gpu=[(dtype, 33, 14336, ((32, 128), (8, 64), (3, 128), (4, 96))) for dtype in DTYPES],
    interpreted=[(dtype, 3, 1500, ((2, 16), (3, 32), (2, 24))) for dtype in INTERPRETED_DTYPES],
)


@pytest.mark.parametrize("dtype, tokens, intermediate, rotations", SILU_ROTATION_CASES)
def test_fused_silu_mul_and_rotation_match_reference(kernel_device, dtype, tokens, intermediate, rotations):
    ops = fused_ops(kernel_device)
    gen = torch.Generator(device=kernel_device).manual_seed(7)
    gate = torch.randn(tokens, intermediate, device=kernel_device, dtype=dtype, generator=gen) * 4
    up = torch.randn(tokens, intermediate, device=kernel_device, dtype=dtype, generator=gen)
    _close(ops.silu_mul(gate, up), REFERENCE_OPS.silu_mul(gate, up))
    gate_up = torch.cat([gate, up], dim=-1)  # the halves of one gate|up projection: strided rows
    assert torch.equal(ops.silu_mul(*gate_up.chunk(2, dim=-1)), ops.silu_mul(gate, up))
    for heads, head_dim in rotations:
        q = torch.randn(tokens, heads, head_dim, device=kernel_device, dtype=dtype, generator=gen)
        rope = RotaryEmbedding(RopeConfig(theta=500000.0), head_dim, torch.device(kernel_device))
        positions = torch.randint(0, 131072, (tokens,), device=kernel_device, generator=gen)
        cos, sin = rope.cos_sin(positions, dtype)
        # each product rounded, then the sum: bit for bit (a fused multiply-add would skip a rounding)
        assert torch.equal(ops.apply_rotary(q, cos, sin), apply_rotary(q, cos, sin))


# (dtype, heads, kv_heads, head_dim); head_dim 96: a half that is not a power of two takes the reference
QKV_ROPE_CASES = kernel_cases(
    gpu=[(dtype, 32, 8, 128) for dtype in DTYPES] + [(torch.bfloat16, 4, 2, 96)],
    interpreted=[(dtype, 4, 2, 16) for dtype in INTERPRETED_DTYPES] + [(torch.float32, 2, 1, 24)],
)


@pytest.mark.parametrize("dtype, heads, kv_heads, head_dim", QKV_ROPE_CASES)
def test_fused_rope_of_k_and_v_alone_matches_reference(kernel_device, dtype, heads, kv_heads, head_dim):
    """A k|v projection without q (a prompt's rows whose queries nobody reads): no q heads, k rotated, v copied."""
    ops = fused_ops(kernel_device)
    gen = torch.Generator(device=kernel_device).manual_seed(head_dim + 1)
    kv = torch.randn(7, 2 * kv_heads * head_dim, device=kernel_device, dtype=dtype, generator=gen)
    rope = RotaryEmbedding(RopeConfig(theta=500000.0), head_dim, torch.device(kernel_device))
    cos, sin = rope.cos_sin(torch.randint(0, 131072, (7,), device=kernel_device, generator=gen), dtype)
    q, k, v = ops.qkv_rope(kv, cos, sin, 0, kv_heads)
    want_q, want_k, want_v = REFERENCE_OPS.qkv_rope(kv, cos, sin, 0, kv_heads)
    assert q.numel() == 0 and torch.equal(k, want_k) and torch.equal(v, want_v)
    assert torch.equal(v, kv[:, kv_heads * head_dim :].unflatten(-1, (kv_heads, head_dim)))


@pytest.mark.parametrize("dtype, heads, kv_heads, head_dim", QKV_ROPE_CASES)
def test_fused_rope_of_q_alone_matches_reference(kernel_device, dtype, heads, kv_heads, head_dim):
    """A q projection without k|v (a prompt's last rows, whose keys and values are written already): q rotated,
    no k or v heads."""
    ops = fused_ops(kernel_device)
    gen = torch.Generator(device=kernel_device).manual_seed(head_dim + 2)
    q_rows = torch.randn(5, heads * head_dim, device=kernel_device, dtype=dtype, generator=gen)
    rope = RotaryEmbedding(RopeConfig(theta=500000.0), head_dim, torch.device(kernel_device))
    cos, sin = rope.cos_sin(torch.randint(0, 131072, (5,), device=kernel_device, generator=gen), dtype)
    q, k, v = ops.qkv_rope(q_rows, cos, sin, heads, 0)
    want_q = REFERENCE_OPS.qkv_rope(q_rows, cos, sin, heads, 0)[0]
    assert torch.equal(q, want_q) and k.numel() == 0 and v.numel() == 0
    assert not torch.equal(q, q_rows.unflatten(-1, (heads, head_dim)))  # rotated


@pytest.mark.parametrize("dtype, heads, kv_heads, head_dim", QKV_ROPE_CASES)
def test_fused_qkv_rope_matches_reference_with_shared_positions_and_cache_slots(
    kernel_device, dtype, heads, kv_heads, head_dim
):
    """Rows of a batch of trees: one position per (session, depth), broadcast over the rows; k and v land in a
    slice of a larger cache. One leading dim (an accept's rows) gives the same rows."""
    ops = fused_ops(kernel_device)
    gen = torch.Generator(device=kernel_device).manual_seed(head_dim)
    batch, rows, entries, start = 3, 5, 9, 2
    width = (heads + 2 * kv_heads) * head_dim
    qkv = torch.randn(batch, rows, width, device=kernel_device, dtype=dtype, generator=gen)
    rope = RotaryEmbedding(RopeConfig(theta=500000.0), head_dim, torch.device(kernel_device))
    positions = torch.randint(0, 131072, (batch, 1), device=kernel_device, generator=gen)
    cos, sin = (t.expand(batch, rows, head_dim) for t in rope.cos_sin(positions, dtype))  # stride 0 over rows
    cache = [torch.zeros(batch, entries, kv_heads, head_dim, device=kernel_device, dtype=dtype) for _ in range(2)]
    slots = tuple(c[:, start : start + rows] for c in cache)
    q, k, v = ops.qkv_rope(qkv, cos, sin, heads, kv_heads, slots)
    want_q, want_k, want_v = REFERENCE_OPS.qkv_rope(qkv, cos, sin, heads, kv_heads)
    assert torch.equal(q, want_q) and torch.equal(cache[0][:, start : start + rows], want_k)
    assert torch.equal(cache[1][:, start : start + rows], want_v)
    assert k.data_ptr() == slots[0].data_ptr() and v.data_ptr() == slots[1].data_ptr()
    untouched = torch.cat([cache[0][:, :start], cache[0][:, start + rows :], cache[1][:, :start]], dim=1)
    assert not untouched.any()
    flat_q, flat_k, flat_v = ops.qkv_rope(qkv[1], cos[1], sin[1], heads, kv_heads)  # one leading dim
    assert torch.equal(flat_q, q[1]) and torch.equal(flat_k, k[1]) and torch.equal(flat_v, v[1])
    # q and k rotate with the same rounding as the fused rotation of each alone
    q_in, k_in, _ = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    assert torch.equal(q, ops.apply_rotary(q_in.unflatten(-1, (heads, head_dim)), cos, sin))
    assert torch.equal(k, ops.apply_rotary(k_in.unflatten(-1, (kv_heads, head_dim)), cos, sin))


HEAD_INPUT_CASES = kernel_cases(
    gpu=[(dtype, hidden) for hidden in [256, 4096, 5000] for dtype in DTYPES],
    interpreted=[(dtype, hidden) for hidden in [48, 100] for dtype in INTERPRETED_DTYPES],
)


@pytest.mark.parametrize("dtype, hidden", HEAD_INPUT_CASES)
def test_fused_head_input_matches_two_norms_side_by_side(kernel_device, dtype, hidden):
    ops = fused_ops(kernel_device)
    gen = torch.Generator(device=kernel_device).manual_seed(hidden)
    embedding = torch.randn(50, hidden, device=kernel_device, dtype=dtype, generator=gen)
    tokens = torch.randint(0, 50, (2, 3), device=kernel_device, generator=gen)
    hidden_rows = torch.randn(2, 3, hidden, device=kernel_device, dtype=dtype, generator=gen) * 5
    weights = [torch.randn(hidden, device=kernel_device, dtype=dtype, generator=gen) for _ in range(2)]
    got = ops.head_input(tokens, embedding, hidden_rows, *weights, 1e-5)
    assert got.shape == (2, 3, 2 * hidden)
    _close(got, REFERENCE_OPS.head_input(tokens, embedding, hidden_rows, *weights, 1e-5))
    # the same rounding as the fused norm on each half
    assert torch.equal(got[..., :hidden], ops.rms_norm(embedding[tokens], weights[0], 1e-5))
    assert torch.equal(got[..., hidden:], ops.rms_norm(hidden_rows, weights[1], 1e-5))
