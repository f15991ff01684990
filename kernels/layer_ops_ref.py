"""The elementwise steps of a decoder layer in plain PyTorch: the CPU path and the oracle for the fused kernels.

Each function rounds exactly where transformers' Llama does (normalise in float32, scale in the
input dtype; RoPE and SiLU products rounded to the input dtype), so the project's forward keeps
matching transformers' logits.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama RMSNorm of x [..., hidden]."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def add_rms_norm(
    x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual update and the next sublayer's input: (x + delta, rms_norm(x + delta))."""
    x = x + delta
    return x, rms_norm(x, weight, eps)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """The gated MLP's activation: silu(gate) * up."""
    return F.silu(gate) * up


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE of x [..., T, heads, head_dim] with cos/sin [..., T, head_dim] (transformers' rotate_half)."""
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin
