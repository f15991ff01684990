"""Fused elementwise steps of a decoder layer: one launch each instead of five to eight.

Same functions as ``diffspec_kernels.layer_ops_ref``, rounding at the same points. A decode step of an
8B model runs ~40 kernels per layer, most of them tiny elementwise ones whose fixed cost adds
up to milliseconds even inside a CUDA graph; these cut a layer to ~16.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from diffspec_kernels.layer_ops_ref import apply_rotary, qkv_rope


@triton.jit
def _scaled_rms_norm(x, weight, hidden, eps, dtype: tl.constexpr):
    """weight * x / rms(x) for one row ([BLOCK] fp32, zeros past ``hidden``), in ``dtype``: the normalised row
    is rounded to ``dtype`` before the scale, as the reference's two steps round it."""
    inv_rms = tl.math.rsqrt(tl.sum(x * x, 0) / hidden + eps)
    normed = (x * inv_rms).to(dtype).to(tl.float32)
    return (weight * normed).to(dtype)


@triton.jit
def _rms_norm_kernel(
    x_ptr, delta_ptr,  # [rows, hidden] each (delta read only with HAS_DELTA)
    weight_ptr,  # [hidden]
    sum_ptr,  # [rows, hidden]: x + delta, written with HAS_DELTA
    out_ptr,  # [rows, hidden]
    hidden, eps,
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
    weight = tl.load(weight_ptr + cols, mask=inside, other=0.0).to(tl.float32)
    out = _scaled_rms_norm(x.to(tl.float32), weight, hidden, eps, out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * hidden + cols, out, mask=inside)


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
def _silu_mul_kernel(gate_ptr, up_ptr, out_ptr, n, width, gate_row_stride, up_row_stride, BLOCK: tl.constexpr):
    """out [rows, width] = silu(gate) * up over rows of a given stride (gate and up may be halves of one
    gate|up projection)."""
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = offsets < n
    row, col = offsets // width, offsets % width
    gate = tl.load(gate_ptr + row * gate_row_stride + col, mask=inside, other=0.0).to(tl.float32)
    up = tl.load(up_ptr + row * up_row_stride + col, mask=inside, other=0.0).to(tl.float32)
    silu = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty)  # rounded like F.silu's output
    tl.store(out_ptr + offsets, (silu.to(tl.float32) * up).to(out_ptr.dtype.element_ty), mask=inside)


def silu_mul_triton(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """gate, up [..., width]: rows may be strided (the halves of a gate|up output), the last dim contiguous."""
    width = gate.shape[-1]
    gate, up = (t if t.stride(-1) == 1 else t.contiguous() for t in (gate, up))
    gate_rows, up_rows = gate.reshape(-1, width), up.reshape(-1, width)  # views when the leading dims are regular
    out = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    block = 1024
    _silu_mul_kernel[(triton.cdiv(out.numel(), block),)](
        gate_rows, up_rows, out, out.numel(), width, gate_rows.stride(0), up_rows.stride(0), BLOCK=block, num_warps=4
    )
    return out


@triton.jit
def _rotate_head(x1, x2, cos_ptr, sin_ptr, out_ptr, HALF: tl.constexpr):
    """One head: out = x * cos + rotate_half(x) * sin, each product rounded to out's dtype. x1, x2 [HALF] fp32:
    the head's halves; cos_ptr, sin_ptr: the position's [2 * HALF] angles; out_ptr: the head's [2 * HALF].

    A kernel that calls this is launched with ``enable_fp_fusion=False``: otherwise the NVIDIA backend may
    fuse a product and the sum into one fma (it does in ``_rotate_kernel`` on sm_90), which skips the
    product's rounding."""
    dims = tl.arange(0, HALF)
    dtype = out_ptr.dtype.element_ty
    cos1 = tl.load(cos_ptr + dims).to(tl.float32)
    cos2 = tl.load(cos_ptr + HALF + dims).to(tl.float32)
    sin1 = tl.load(sin_ptr + dims).to(tl.float32)
    sin2 = tl.load(sin_ptr + HALF + dims).to(tl.float32)
    first = (x1 * cos1).to(dtype).to(tl.float32) + (-x2 * sin1).to(dtype).to(tl.float32)
    second = (x2 * cos2).to(dtype).to(tl.float32) + (x1 * sin2).to(dtype).to(tl.float32)
    tl.store(out_ptr + dims, first.to(dtype))
    tl.store(out_ptr + HALF + dims, second.to(dtype))


@triton.jit
def _rotate_kernel(
    x_ptr,  # [tokens, heads, 2 * HALF]
    cos_ptr, sin_ptr,  # [tokens, 2 * HALF]
    out_ptr,  # [tokens, heads, 2 * HALF]
    heads,
    HALF: tl.constexpr,
):  # fmt: skip
    """One (token, head), rotated by ``_rotate_head``."""
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    dims = tl.arange(0, HALF)
    base = (token * heads + head) * (2 * HALF)
    x1 = tl.load(x_ptr + base + dims).to(tl.float32)
    x2 = tl.load(x_ptr + base + HALF + dims).to(tl.float32)
    angles = token * 2 * HALF
    _rotate_head(x1, x2, cos_ptr + angles, sin_ptr + angles, out_ptr + base, HALF)


def apply_rotary_triton(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    head_dim, heads = x.shape[-1], x.shape[-2]
    half = head_dim // 2
    if half & (half - 1):  # the kernel tiles a half head dim as one power-of-two block
        return apply_rotary(x, cos, sin)
    x = x.contiguous()
    out = torch.empty_like(x)
    tokens = x.numel() // (heads * head_dim)
    _rotate_kernel[(tokens, heads)](
        x, cos.contiguous(), sin.contiguous(), out, heads, HALF=half, num_warps=1, enable_fp_fusion=False
    )
    return out


@triton.jit
def _head_input_kernel(
    token_ids_ptr,  # [rows] int64
    embedding_ptr,  # [vocab, hidden]
    hidden_ptr,  # [rows, hidden] (row stride hidden_row_stride)
    token_weight_ptr, hidden_weight_ptr,  # [hidden] each
    out_ptr,  # [rows, 2 * hidden]
    hidden, hidden_row_stride, eps,
    BLOCK: tl.constexpr,
):  # fmt: skip
    """One row: the token's embedding and the hidden row, each normalised by ``_scaled_rms_norm`` (as in
    ``_rms_norm_kernel``), side by side in the output."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    inside = cols < hidden
    dtype = out_ptr.dtype.element_ty
    token = tl.load(token_ids_ptr + row)
    for half in tl.static_range(2):
        if half == 0:
            x = tl.load(embedding_ptr + token * hidden + cols, mask=inside, other=0.0).to(tl.float32)
            weight = tl.load(token_weight_ptr + cols, mask=inside, other=0.0).to(tl.float32)
        else:
            x = tl.load(hidden_ptr + row * hidden_row_stride + cols, mask=inside, other=0.0).to(tl.float32)
            weight = tl.load(hidden_weight_ptr + cols, mask=inside, other=0.0).to(tl.float32)
        out = _scaled_rms_norm(x, weight, hidden, eps, dtype)
        tl.store(out_ptr + row * 2 * hidden + half * hidden + cols, out, mask=inside)


def head_input_triton(
    token_ids: torch.Tensor, embedding: torch.Tensor, hidden: torch.Tensor,
    token_weight: torch.Tensor, hidden_weight: torch.Tensor, eps: float,
) -> torch.Tensor:  # fmt: skip
    size = hidden.shape[-1]
    rows = hidden.reshape(-1, size)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(*hidden.shape[:-1], 2 * size, dtype=hidden.dtype, device=hidden.device)
    block = triton.next_power_of_2(size)
    _head_input_kernel[(rows.shape[0],)](
        token_ids.reshape(-1), embedding, rows, token_weight, hidden_weight, out, size, rows.stride(0), eps,
        BLOCK=block, num_warps=min(16, max(1, block // 256)),
    )  # fmt: skip
    return out


@triton.jit(do_not_specialize=["rows"])  # one compile however many rows an accept or a prompt brings
def _qkv_rope_kernel(
    qkv_ptr,  # [B, R, (heads + 2 * kv_heads) * hd], strides qkv_b, qkv_r
    cos_ptr, sin_ptr,  # [B, R, hd], strides cos_b, cos_r (0 where a position is shared)
    q_ptr,  # [B, R, heads, hd] contiguous, written
    k_ptr, v_ptr,  # [B, R, kv_heads, hd], strides kv_b, kv_r, written
    rows, heads, kv_heads, qkv_b, qkv_r, cos_b, cos_r, k_b, k_r, v_b, v_r,
    HALF: tl.constexpr,
):  # fmt: skip
    """One (row, head slot): slots below ``heads`` are q heads, then k heads (both rotated by
    ``_rotate_head``, as in ``_rotate_kernel``), then v heads (copied)."""
    flat = tl.program_id(0).to(tl.int64)
    slot = tl.program_id(1)
    b, r = flat // rows, flat % rows
    dims = tl.arange(0, HALF)
    source = qkv_ptr + b * qkv_b + r * qkv_r + slot * (2 * HALF)
    x1 = tl.load(source + dims)
    x2 = tl.load(source + HALF + dims)
    if slot >= heads + kv_heads:
        v_out = v_ptr + b * v_b + r * v_r + (slot - heads - kv_heads) * (2 * HALF)
        tl.store(v_out + dims, x1)
        tl.store(v_out + HALF + dims, x2)
    else:
        if slot < heads:
            out = q_ptr + flat * heads * (2 * HALF) + slot * (2 * HALF)
        else:
            out = k_ptr + b * k_b + r * k_r + (slot - heads) * (2 * HALF)
        angles = b * cos_b + r * cos_r
        _rotate_head(x1.to(tl.float32), x2.to(tl.float32), cos_ptr + angles, sin_ptr + angles, out, HALF)


def qkv_rope_triton(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    kv_out: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``diffspec_kernels.layer_ops_ref.qkv_rope`` in one launch, for one or two leading dims. Leading dims may be
    strided (cos/sin broadcast over rows that share a position; ``kv_out`` slices of a cache); each
    row's last dims are contiguous."""
    head_dim = cos.shape[-1]
    half = head_dim // 2
    lead = qkv.shape[:-1]
    if half & (half - 1) or len(lead) > 2:  # the kernel tiles a half head dim as one power-of-two block
        return qkv_rope(qkv, cos, sin, num_heads, num_kv_heads, kv_out)
    kv_shape = (*lead, num_kv_heads, head_dim)
    if kv_out is None:
        kv_out = (qkv.new_empty(kv_shape), qkv.new_empty(kv_shape))
    q = qkv.new_empty(*lead, num_heads, head_dim)
    cos, sin = cos.expand(*lead, head_dim), sin.expand(*lead, head_dim)
    if len(lead) == 1:  # one batch of rows
        qkv, cos, sin = qkv[None], cos[None], sin[None]
        k_out, v_out = kv_out[0][None], kv_out[1][None]
    else:
        k_out, v_out = kv_out
    if cos.stride() != sin.stride() or cos.stride(-1) != 1 or qkv.stride(-1) != 1:
        raise ValueError("cos and sin must share strides, and cos, sin and qkv rows must be contiguous")
    batch, rows = qkv.shape[:2]
    if batch * rows:
        _qkv_rope_kernel[(batch * rows, num_heads + 2 * num_kv_heads)](
            qkv, cos, sin, q, k_out, v_out, rows, num_heads, num_kv_heads, qkv.stride(0), qkv.stride(1),
            cos.stride(0), cos.stride(1), k_out.stride(0), k_out.stride(1), v_out.stride(0), v_out.stride(1),
            HALF=half, num_warps=1, enable_fp_fusion=False,
        )  # fmt: skip
    return q, *kv_out
