"""Fused elementwise steps of a decoder layer: one launch each instead of five to eight.

Same functions as ``kernels.layer_ops_ref``, rounding at the same points. A decode step of an
8B model runs ~40 kernels per layer, most of them tiny elementwise ones whose fixed cost adds
up to milliseconds even inside a CUDA graph; these cut a layer to ~16.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.layer_ops_ref import apply_rotary


@triton.jit
def _rms_norm_kernel(
    x_ptr, delta_ptr, weight_ptr, sum_ptr, out_ptr, hidden, eps,
    HAS_DELTA: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """One row: optionally x + delta (stored to sum_ptr), then normalise in fp32 and scale."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    inside = cols < hidden
    x = tl.load(x_ptr + row * hidden + cols, mask=inside, other=0.0)
    if HAS_DELTA:
        x = (x.to(tl.float32) + tl.load(delta_ptr + row * hidden + cols, mask=inside, other=0.0).to(tl.float32))
        x = x.to(sum_ptr.dtype.element_ty)
        tl.store(sum_ptr + row * hidden + cols, x, mask=inside)
    x32 = x.to(tl.float32)
    inv_rms = tl.math.rsqrt(tl.sum(x32 * x32, 0) / hidden + eps)
    normed = (x32 * inv_rms).to(out_ptr.dtype.element_ty)
    weight = tl.load(weight_ptr + cols, mask=inside, other=0.0)
    out = weight.to(tl.float32) * normed.to(tl.float32)
    tl.store(out_ptr + row * hidden + cols, out.to(out_ptr.dtype.element_ty), mask=inside)


def _norm(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float):
    hidden = x.shape[-1]
    rows = x.numel() // hidden
    x = x.contiguous()
    out = torch.empty_like(x)
    summed = torch.empty_like(x) if delta is not None else out
    block = triton.next_power_of_2(hidden)
    _rms_norm_kernel[(rows,)](
        x, delta.contiguous() if delta is not None else x, weight, summed, out, hidden, eps,
        HAS_DELTA=delta is not None, BLOCK=block, num_warps=min(16, max(1, block // 256)),
    )  # fmt: skip
    return summed, out


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _norm(x, None, weight, eps)[1]


def add_rms_norm_triton(
    x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    return _norm(x, delta, weight, eps)


@triton.jit
def _silu_mul_kernel(gate_ptr, up_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = offsets < n
    gate = tl.load(gate_ptr + offsets, mask=inside, other=0.0).to(tl.float32)
    up = tl.load(up_ptr + offsets, mask=inside, other=0.0).to(tl.float32)
    silu = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty)  # rounded like F.silu's output
    tl.store(out_ptr + offsets, (silu.to(tl.float32) * up).to(out_ptr.dtype.element_ty), mask=inside)


def silu_mul_triton(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    gate, up = gate.contiguous(), up.contiguous()
    out = torch.empty_like(gate)
    block = 1024
    _silu_mul_kernel[(triton.cdiv(gate.numel(), block),)](gate, up, out, gate.numel(), BLOCK=block, num_warps=4)
    return out


@triton.jit
def _rotate_kernel(x_ptr, cos_ptr, sin_ptr, out_ptr, heads, HALF: tl.constexpr):
    """One (token, head): out = x * cos + rotate_half(x) * sin, each product rounded to the dtype."""
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    dims = tl.arange(0, HALF)
    base = (token * heads + head) * (2 * HALF)
    dtype = out_ptr.dtype.element_ty
    x1 = tl.load(x_ptr + base + dims).to(tl.float32)
    x2 = tl.load(x_ptr + base + HALF + dims).to(tl.float32)
    cos1 = tl.load(cos_ptr + token * 2 * HALF + dims).to(tl.float32)
    cos2 = tl.load(cos_ptr + token * 2 * HALF + HALF + dims).to(tl.float32)
    sin1 = tl.load(sin_ptr + token * 2 * HALF + dims).to(tl.float32)
    sin2 = tl.load(sin_ptr + token * 2 * HALF + HALF + dims).to(tl.float32)
    first = (x1 * cos1).to(dtype).to(tl.float32) + (-x2 * sin1).to(dtype).to(tl.float32)
    second = (x2 * cos2).to(dtype).to(tl.float32) + (x1 * sin2).to(dtype).to(tl.float32)
    tl.store(out_ptr + base + dims, first.to(dtype))
    tl.store(out_ptr + base + HALF + dims, second.to(dtype))


def apply_rotary_triton(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    head_dim, heads = x.shape[-1], x.shape[-2]
    half = head_dim // 2
    if half & (half - 1):  # the kernel tiles a half head dim as one power-of-two block
        return apply_rotary(x, cos, sin)
    x = x.contiguous()
    out = torch.empty_like(x)
    tokens = x.numel() // (heads * head_dim)
    _rotate_kernel[(tokens, heads)](x, cos.contiguous(), sin.contiguous(), out, heads, HALF=half, num_warps=1)
    return out
