"""The head's weights as serving multiplies them: q|k|v and gate|up concatenated, and int8 when asked.

A snapshot taken once the weights are final. Training keeps the separate layers (their gradients,
the published checkpoint keys), so none of this is ever saved.

Quantisation (``int8``): every matmul a draft depth runs (q|k|v, o, gate|up, down of each layer
and the vocabulary head) keeps per-output-channel int8 weights (``diffspec_kernels/int8_linear_ref``)
and multiplies activations in the head's dtype. A depth at batch 1 is bound by the bytes of those
weights, and this halves them for a bf16 head. The draft only proposes: the target verifies every
token, so the output is the same either way; what the rounding costs is acceptance, measured in
``bench/RESULTS.md``. ``fc`` stays in the head's dtype: it reads the target's features once per
accept, not once per depth.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

from diffspec_kernels.dispatch import triton_kernels_on
from diffspec_kernels.int8_linear_ref import int8_linear_reference, quantize_int8

Quantization = Literal["none", "int8"]


@dataclass(frozen=True)
class ServingLinear:
    """One matmul's weight: in the head's dtype (``scale`` None), or int8 with a per-output-channel scale."""

    weight: torch.Tensor  # [out, in]
    scale: torch.Tensor | None = None  # [out] float32, with an int8 weight

    @staticmethod
    def of(weight: torch.Tensor, quantization: Quantization) -> ServingLinear:
        if quantization == "int8":
            return ServingLinear(*quantize_int8(weight))
        return ServingLinear(weight)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., in] -> [..., out] in x's dtype."""
        if self.scale is None:
            return F.linear(x, self.weight)
        if triton_kernels_on(x.device):
            from diffspec_kernels.int8_linear_triton import int8_linear_triton

            return int8_linear_triton(x, self.weight, self.scale)
        return int8_linear_reference(x, self.weight, self.scale)

    @property
    def nbytes(self) -> int:
        """Bytes one multiplication reads of the weight and its scale."""
        scale_bytes = self.scale.numel() * self.scale.element_size() if self.scale is not None else 0
        return self.weight.numel() * self.weight.element_size() + scale_bytes


@dataclass(frozen=True)
class ServingProjections:
    """One decoder layer's serving matmuls."""

    qkv: ServingLinear  # [(heads + 2 * kv_heads) * hd, width]: q|k|v in one matmul
    o: ServingLinear  # [hidden, heads * hd]
    gate_up: ServingLinear  # [2 * intermediate, hidden]: gate|up in one matmul
    down: ServingLinear  # [hidden, intermediate]


@dataclass(frozen=True)
class ServingWeights:
    """Every matmul of a draft depth: each decoder layer's, then the vocabulary head's."""

    layers: list[ServingProjections]
    lm_head: ServingLinear  # [draft_vocab, hidden]
    quantization: Quantization

    @property
    def bytes_per_depth(self) -> int:
        """Weight bytes one head pass reads (what bounds a depth at small batch)."""
        linears = [self.lm_head, *(m for p in self.layers for m in (p.qkv, p.o, p.gate_up, p.down))]
        return sum(linear.nbytes for linear in linears)
