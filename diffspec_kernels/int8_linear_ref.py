"""Weight-only int8 matmuls (W8A16): per-output-channel symmetric int8 weights, activations kept in their dtype.

Why: a draft depth at batch 1 reads every weight of the head once for a few dozen rows, so its
matmuls are bound by the bytes they read. Int8 weights halve the bytes of a bf16 head. The draft
only proposes; the target verifies every token, so the output stays lossless whatever the
rounding costs in acceptance.

Quantisation: ``scale[n] = max_k |w[n, k]| / 127`` and ``q = round(w / scale)``, so each row keeps
its own range. An int8 value is exact in bf16, fp16 and fp32, so ``x @ q.T`` in fp32 is exact
per product and only the sum's order differs between this reference and the Triton kernel.
"""

from __future__ import annotations

import torch

INT8_MAX = 127


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] -> (q [N, K] int8, scale [N] float32) with weight ~ q * scale[:, None].
    An all-zero row gets scale 1 (its q is zero anyway)."""
    if weight.ndim != 2:
        raise ValueError(f"a weight to quantise is [out, in], got {tuple(weight.shape)}")
    w = weight.detach().float()
    peak = w.abs().amax(dim=1)
    scale = torch.where(peak > 0, peak / INT8_MAX, torch.ones_like(peak))
    q = torch.round(w / scale[:, None]).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q.contiguous(), scale.contiguous()


def int8_linear_reference(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [..., K], q [N, K] int8, scale [N] float32 -> (x @ q.T) * scale [..., N] in x's dtype (fp32 sums)."""
    out = torch.nn.functional.linear(x.float(), q.float()) * scale
    return out.to(x.dtype)
