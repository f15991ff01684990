"""Which implementation runs a decoder layer's elementwise steps: fused Triton kernels on a GPU, PyTorch elsewhere."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from diffspec_kernels import layer_ops_ref
from diffspec_kernels.dispatch import triton_kernels_on

Tensor = torch.Tensor


@dataclass(frozen=True)
class LayerOps:
    rms_norm: Callable[[Tensor, Tensor, float], Tensor]
    add_rms_norm: Callable[[Tensor, Tensor, Tensor, float], tuple[Tensor, Tensor]]  # (x + delta, its norm)
    silu_mul: Callable[[Tensor, Tensor], Tensor]
    apply_rotary: Callable[[Tensor, Tensor, Tensor], Tensor]
    qkv_rope: Callable[..., tuple[Tensor, Tensor, Tensor]]  # (qkv, cos, sin, heads, kv_heads, kv_out) -> q, k, v
    head_input: Callable[[Tensor, Tensor, Tensor, Tensor, Tensor, float], Tensor]  # EAGLE-3's (token, feature) input


REFERENCE_OPS = LayerOps(
    rms_norm=layer_ops_ref.rms_norm,
    add_rms_norm=layer_ops_ref.add_rms_norm,
    silu_mul=layer_ops_ref.silu_mul,
    apply_rotary=layer_ops_ref.apply_rotary,
    qkv_rope=layer_ops_ref.qkv_rope,
    head_input=layer_ops_ref.head_input,
)


def layer_ops_for(device: torch.device) -> LayerOps:
    """Fused kernels on CUDA/ROCm, the reference elsewhere."""
    if not triton_kernels_on(device):
        return REFERENCE_OPS
    from diffspec_kernels import layer_ops_triton

    return LayerOps(
        rms_norm=layer_ops_triton.rms_norm_triton,
        add_rms_norm=layer_ops_triton.add_rms_norm_triton,
        silu_mul=layer_ops_triton.silu_mul_triton,
        apply_rotary=layer_ops_triton.apply_rotary_triton,
        qkv_rope=layer_ops_triton.qkv_rope_triton,
        head_input=layer_ops_triton.head_input_triton,
    )
