"""Rotary position embeddings (RoPE) shared by the target and the draft, with Llama-3.1's ``llama3`` scaling.

transformers' convention: frequencies repeated over both halves of the head dimension; the
rotation itself (``x * cos + rotate_half(x) * sin``) is ``diffspec_kernels.layer_ops_ref.apply_rotary``.
"""

from __future__ import annotations

import math

import torch

from diffspec.model_config import RopeConfig


def inverse_frequencies(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    """[head_dim // 2] float32 inverse frequencies after any scaling."""
    inv_freq = 1.0 / (rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if rope.kind != "llama3":
        return inv_freq
    # Llama-3.1: long wavelengths are slowed by `factor`, short ones kept, the band between blended.
    low_freq_wavelen = rope.original_max_positions / rope.low_freq_factor
    high_freq_wavelen = rope.original_max_positions / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (rope.original_max_positions / wavelen - rope.low_freq_factor) / (
        rope.high_freq_factor - rope.low_freq_factor
    )
    blended = (1 - smooth) * scaled / rope.factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, blended, scaled)


class RotaryEmbedding:
    """cos/sin for arbitrary position ids, computed from the position itself: tree nodes share
    positions, and there is no table sized by ``max_position_embeddings`` to run off the end of (a
    published EAGLE-3 head declares 2048 and drafts at the target's 128K)."""

    def __init__(self, rope: RopeConfig, head_dim: int, device: torch.device) -> None:
        self.inv_freq = inverse_frequencies(rope, head_dim).to(device)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [..., T] int64 -> cos, sin [..., T, head_dim] in ``dtype``."""
        freqs = positions.float().unsqueeze(-1) * self.inv_freq
        angles = torch.cat([freqs, freqs], dim=-1)
        return angles.cos().to(dtype), angles.sin().to(dtype)
