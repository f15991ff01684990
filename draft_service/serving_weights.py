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

``auto`` keeps int8 where it measured faster: on the H200 with the 8B-shaped head, at 1-10 rows, the
int8 kernel beat cuBLAS on the large matrices (q|k|v 28 against 37 us, gate|up 46 against 72, down 39
against 42) and lost on the 4,096 x 4,096 ones (o and the vocabulary head, 31 against 19), and past
16 rows it lost on all of them (``bench/results/int8_matmuls_8b.json``). So matrices of at least
``AUTO_INT8_MIN_ELEMENTS`` weights keep both copies and multiply in int8 up to ``INT8_MAX_ROWS`` rows
(one session's frontier), in the head's dtype past them (a batch's); the others stay in the head's dtype.
A proposal's rows are fixed per shape, so a captured graph always takes one of the two.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from diffspec.settings import DraftQuantization
from diffspec_kernels.dispatch import triton_kernels_on
from diffspec_kernels.int8_linear_ref import int8_linear_reference, quantize_int8

Quantization = DraftQuantization
AUTO_INT8_MIN_ELEMENTS = 32 * 1024 * 1024  # under it (the 4,096 x 4,096 matrices), cuBLAS on the dtype was faster
INT8_MAX_ROWS = 16  # past it, cuBLAS on the dtype was faster for every matrix


def auto_multiplies_in_int8(weight_elements: int, rows: int) -> bool:
    """``auto``'s rule for one multiplication: int8 for a matrix of ``AUTO_INT8_MIN_ELEMENTS`` weights or more, up
    to ``INT8_MAX_ROWS`` rows; the head's dtype otherwise."""
    return weight_elements >= AUTO_INT8_MIN_ELEMENTS and rows <= INT8_MAX_ROWS


@dataclass(frozen=True)
class ServingLinear:
    """One matmul's weight: in the head's dtype (``scale`` None), or int8 with a per-output-channel scale, and then
    possibly the dtype's copy too, for many rows (``auto``)."""

    weight: torch.Tensor  # [out, in]
    scale: torch.Tensor | None = None  # [out] float32, with an int8 weight
    dense: torch.Tensor | None = None  # [out, in] in the head's dtype beside an int8 weight: past INT8_MAX_ROWS rows

    @staticmethod
    def of(weight: torch.Tensor, quantization: Quantization) -> ServingLinear:
        if quantization == "int8":
            return ServingLinear(*quantize_int8(weight))
        if quantization == "auto" and weight.numel() >= AUTO_INT8_MIN_ELEMENTS:
            return ServingLinear(*quantize_int8(weight), dense=weight)
        return ServingLinear(weight)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., in] -> [..., out] in x's dtype."""
        if self.scale is None:
            return F.linear(x, self.weight)
        if self.dense is not None and not auto_multiplies_in_int8(self.weight.numel(), x.numel() // x.shape[-1]):
            return F.linear(x, self.dense)
        if triton_kernels_on(x.device):
            from diffspec_kernels.int8_linear_triton import int8_linear_triton

            return int8_linear_triton(x, self.weight, self.scale)
        return int8_linear_reference(x, self.weight, self.scale)

    def rows(self, first: int, stop: int | None = None) -> ServingLinear:
        """The multiplication by output rows ``first`` up to ``stop`` alone: views of this one's weights, no copy."""
        scale = self.scale[first:stop] if self.scale is not None else None
        dense = self.dense[first:stop] if self.dense is not None else None
        return ServingLinear(self.weight[first:stop], scale, dense)

    @property
    def nbytes(self) -> int:
        """Bytes one multiplication of a few rows reads of the weight and its scale."""
        scale_bytes = self.scale.numel() * self.scale.element_size() if self.scale is not None else 0
        return self.weight.numel() * self.weight.element_size() + scale_bytes


@dataclass(frozen=True)
class ServingProjections:
    """One decoder layer's serving matmuls."""

    qkv: ServingLinear  # [(heads + 2 * kv_heads) * hd, width]: q|k|v in one matmul
    q: ServingLinear  # [heads * hd, width]: qkv's q rows (views), for rows whose k and v are written already
    kv: ServingLinear  # [2 * kv_heads * hd, width]: qkv's k|v rows (views), for entries whose query nobody reads
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
        # not q or kv: views of qkv's rows
        linears = [self.lm_head, *(m for p in self.layers for m in (p.qkv, p.o, p.gate_up, p.down))]
        return sum(linear.nbytes for linear in linears)
