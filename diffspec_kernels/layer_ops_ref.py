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


def head_input(
    token_ids: torch.Tensor, embedding: torch.Tensor, hidden: torch.Tensor,
    token_weight: torch.Tensor, hidden_weight: torch.Tensor, eps: float,
) -> torch.Tensor:  # fmt: skip
    """The EAGLE-3 layer's input: token_ids [...], embedding [vocab, h], hidden [..., h]
    -> [..., 2h] = cat(rms_norm(embed(token)), rms_norm(hidden)), each norm with its own weight [h]."""
    token = rms_norm(F.embedding(token_ids, embedding), token_weight, eps)
    return torch.cat([token, rms_norm(hidden, hidden_weight, eps)], dim=-1)


def qkv_rope(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    kv_out: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A fused q|k|v projection's output qkv [..., (heads + 2 * kv_heads) * hd] with cos/sin [..., hd]
    -> roped q [..., heads, hd], roped k and v [..., kv_heads, hd]. ``kv_out``: tensors of k's and v's
    shape that receive them (e.g. a KV cache's slots), returned in their place."""
    head_dim = cos.shape[-1]
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    q = apply_rotary(q.unflatten(-1, (num_heads, head_dim)), cos, sin)
    k = apply_rotary(k.unflatten(-1, (num_kv_heads, head_dim)), cos, sin)
    v = v.unflatten(-1, (num_kv_heads, head_dim))
    if kv_out is None:
        return q, k, v
    kv_out[0].copy_(k)
    kv_out[1].copy_(v)
    return q, *kv_out
