"""The EAGLE-3 head's decoder layers, their parts named as the published checkpoint keys.

Layer 0 (``midlayer.*``): q/k/v read the 2h-wide (token embedding, feature) concat; the rest is a
Llama layer. Layers 1.. (``layers.{i}.*``, as vLLM and SGLang name them) are plain Llama layers over
the residual stream the layer below leaves: ``input_layernorm`` -> attention -> + stream ->
``post_attention_layernorm`` -> MLP -> + stream. Norms and SiLU x up run the fused kernels when
serving on a GPU (no autograd there) and the reference elsewhere, training included.
"""

from __future__ import annotations

import torch
from torch import nn

from draft_service.eagle3_config import Eagle3Config
from draft_service.serving_weights import Quantization, ServingLinear, ServingProjections
from diffspec_kernels.layer_ops import REFERENCE_OPS, LayerOps, layer_ops_for


def layer_ops(device: torch.device) -> LayerOps:
    """Fused kernels when serving on a GPU; they have no backward, so training keeps the reference."""
    return REFERENCE_OPS if torch.is_grad_enabled() else layer_ops_for(device)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, factory: dict) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size, **factory))  # [size]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return layer_ops(x.device).rms_norm(x, self.weight, self.eps)


class AttentionProjections(nn.Module):
    """q/k/v read ``width`` (2h for layer 0's (embedding, feature) concat, h above it); o writes back h."""

    def __init__(self, c: Eagle3Config, width: int, factory: dict) -> None:
        super().__init__()
        q_out, kv_out = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        self.q_proj = nn.Linear(width, q_out, bias=False, **factory)
        self.k_proj = nn.Linear(width, kv_out, bias=False, **factory)
        self.v_proj = nn.Linear(width, kv_out, bias=False, **factory)
        self.o_proj = nn.Linear(q_out, c.hidden_size, bias=False, **factory)

    def qkv(self, x: torch.Tensor, serving: ServingProjections | None) -> torch.Tensor:
        """x [..., width] -> q|k|v [..., (heads + 2 * kv_heads) * hd]."""
        if serving is None:
            return torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], dim=-1)
        return serving.qkv(x)

    def out(self, attn: torch.Tensor, serving: ServingProjections | None) -> torch.Tensor:
        """attn [..., heads * hd] -> [..., hidden]."""
        return self.o_proj(attn) if serving is None else serving.o(attn)


class MLP(nn.Module):
    def __init__(self, c: Eagle3Config, factory: dict) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False, **factory)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False, **factory)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False, **factory)

    def forward(self, x: torch.Tensor, serving: ServingProjections | None = None) -> torch.Tensor:
        if serving is None:
            gate, up = self.gate_proj(x), self.up_proj(x)
            return self.down_proj(layer_ops(x.device).silu_mul(gate, up))
        gate, up = serving.gate_up(x).chunk(2, dim=-1)
        return serving.down(layer_ops(x.device).silu_mul(gate, up))


class DecoderLayer(nn.Module):
    """A layer above layer 0; attribute names are the published ``layers.{i}.*`` keys."""

    def __init__(self, c: Eagle3Config, factory: dict) -> None:
        super().__init__()
        self._add_parts(c, c.hidden_size, factory)

    def _add_parts(self, c: Eagle3Config, width: int, factory: dict) -> None:
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, factory)
        self.self_attn = AttentionProjections(c, width, factory)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, factory)
        self.mlp = MLP(c, factory)

    def serving_projections(self, quantization: Quantization) -> ServingProjections:
        """This layer's serving matmuls (``serving_weights``; take them once the weights are final)."""
        attn, mlp = self.self_attn, self.mlp
        qkv = ServingLinear.of(torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]), quantization)
        return ServingProjections(
            qkv=qkv,
            q=qkv.rows(0, attn.q_proj.weight.shape[0]),
            kv=qkv.rows(attn.q_proj.weight.shape[0]),
            o=ServingLinear.of(attn.o_proj.weight, quantization),
            gate_up=ServingLinear.of(torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]), quantization),
            down=ServingLinear.of(mlp.down_proj.weight, quantization),
        )


class MidLayer(DecoderLayer):
    """Layer 0; attribute names are the published ``midlayer.*`` keys. ``input_layernorm`` norms the
    token embedding, ``hidden_norm`` the feature."""

    def __init__(self, c: Eagle3Config, factory: dict) -> None:
        nn.Module.__init__(self)
        # first, as before layers above it existed: parameter order is the order of a saved optimizer's state
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps, factory)
        self._add_parts(c, 2 * c.hidden_size, factory)
