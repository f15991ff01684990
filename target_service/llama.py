"""The project's own Llama forward (no transformers modeling code at run time).

One decoder-layer body serves two attention paths: the paged path (new tokens attend to their
sequence's committed KV pages plus each other under a mask: prefill chunks, trees, decode) and
the dense causal path (batched full sequences, for the EAGLE-3 trainer and tests). Both can
return the EAGLE-3 features: the residual-stream inputs of the chosen decoder layers. The
elementwise steps (norms with the residual add folded in, RoPE, SiLU x up) come from
``diffspec_kernels.layer_ops``: fused Triton kernels on a GPU, PyTorch elsewhere.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Protocol

import torch
import torch.nn.functional as F

from diffspec.checkpoint import load_state_dict, safetensors_files
from diffspec.devices import upload
from diffspec.errors import CheckpointError
from diffspec.model_config import LlamaConfig, load_llama_config
from diffspec.rope import RotaryEmbedding
from diffspec_kernels.attention_metadata import AttentionMetadata
from diffspec_kernels.layer_ops import layer_ops_for

# attend(layer, q, k, v) -> attention output shaped like q; k/v are the new tokens' keys/values.
AttendFn = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class AttentionBackend(Protocol):
    """Tree attention over paged KV; ``diffspec_kernels.tree_attention_ref`` defines the semantics."""

    def __call__(
        self,
        q: torch.Tensor,  # [total_q, num_heads, head_dim]
        k_new: torch.Tensor,  # [total_q, num_kv_heads, head_dim]
        v_new: torch.Tensor,  # [total_q, num_kv_heads, head_dim]
        k_pages: torch.Tensor,  # [num_pages, page_size, num_kv_heads, head_dim]
        v_pages: torch.Tensor,  # [num_pages, page_size, num_kv_heads, head_dim]
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor: ...


@dataclass
class LayerWeights:
    input_norm: torch.Tensor  # [hidden]
    q_proj: torch.Tensor  # [heads * head_dim, hidden]
    k_proj: torch.Tensor  # [kv_heads * head_dim, hidden]
    v_proj: torch.Tensor  # [kv_heads * head_dim, hidden]
    o_proj: torch.Tensor  # [hidden, heads * head_dim]
    post_norm: torch.Tensor  # [hidden]
    gate_proj: torch.Tensor  # [intermediate, hidden]
    up_proj: torch.Tensor  # [intermediate, hidden]
    down_proj: torch.Tensor  # [hidden, intermediate]
    biases: dict[str, torch.Tensor]  # optional "q_proj"... biases (attention_bias / mlp_bias checkpoints)


@dataclass
class PagedForwardOutput:
    hidden: torch.Tensor  # [total_q, hidden] after the final norm
    features: torch.Tensor | None  # [total_q, 3 * hidden] EAGLE-3 features, if asked for
    new_k: torch.Tensor  # [num_layers, total_q, num_kv_heads, head_dim] keys of the new tokens
    new_v: torch.Tensor  # [num_layers, total_q, num_kv_heads, head_dim]
    feature_layers: tuple[int, ...] = ()  # the layer of each hidden-wide column block of features, in order

    def features_of(self, rows: torch.Tensor | list[int] | slice, layers: tuple[int, ...]) -> torch.Tensor:
        """[len(rows), len(layers) * hidden]: ``rows`` of the features of ``layers`` (each one computed)."""
        assert self.features is not None
        if isinstance(rows, list):  # a list index would go up through pageable memory: a wait for the GPU
            rows = upload(torch.tensor(rows, dtype=torch.int64), self.features.device)
        picked = self.features[rows]
        if layers == self.feature_layers:
            return picked
        blocks = picked.unflatten(-1, (len(self.feature_layers), -1))
        positions = torch.tensor([self.feature_layers.index(layer) for layer in layers], dtype=torch.int64)
        return blocks.index_select(1, upload(positions, blocks.device)).flatten(-2)


def _linear(x: torch.Tensor, weight: torch.Tensor, layer: LayerWeights, name: str) -> torch.Tensor:
    return F.linear(x, weight, layer.biases.get(name))


class LlamaModel:
    """Weights plus the forward; holds no per-request state."""

    def __init__(self, config: LlamaConfig, state: dict[str, torch.Tensor], device: torch.device) -> None:
        self.config = config
        self.device = device
        self.rotary = RotaryEmbedding(config.rope, config.head_dim, device)
        self.scale = config.head_dim**-0.5
        self.ops = layer_ops_for(device)
        take = _WeightTaker(state)
        self.embed_tokens = take("model.embed_tokens.weight", (config.vocab_size, config.hidden_size))
        self.layers = [self._layer_weights(take, i) for i in range(config.num_layers)]
        self.norm = take("model.norm.weight", (config.hidden_size,))
        if config.tie_word_embeddings or "lm_head.weight" not in state:
            self.lm_head = self.embed_tokens
        else:
            self.lm_head = take("lm_head.weight", (config.vocab_size, config.hidden_size))
        self.dtype = self.embed_tokens.dtype

    @classmethod
    def from_pretrained(cls, model_dir: Path, device: torch.device, dtype: torch.dtype) -> LlamaModel:
        config = load_llama_config(model_dir)
        return cls(config, load_state_dict(safetensors_files(model_dir), device, dtype), device)

    def _layer_weights(self, take: _WeightTaker, i: int) -> LayerWeights:
        c = self.config
        p = f"model.layers.{i}."
        q_out, kv_out = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        shapes = {
            "q_proj": (f"{p}self_attn.q_proj", (q_out, c.hidden_size), c.attention_bias),
            "k_proj": (f"{p}self_attn.k_proj", (kv_out, c.hidden_size), c.attention_bias),
            "v_proj": (f"{p}self_attn.v_proj", (kv_out, c.hidden_size), c.attention_bias),
            "o_proj": (f"{p}self_attn.o_proj", (c.hidden_size, q_out), c.attention_bias),
            "gate_proj": (f"{p}mlp.gate_proj", (c.intermediate_size, c.hidden_size), c.mlp_bias),
            "up_proj": (f"{p}mlp.up_proj", (c.intermediate_size, c.hidden_size), c.mlp_bias),
            "down_proj": (f"{p}mlp.down_proj", (c.hidden_size, c.intermediate_size), c.mlp_bias),
        }
        weights = {key: take(f"{name}.weight", shape) for key, (name, shape, _) in shapes.items()}
        biases = {key: take(f"{name}.bias", shape[:1]) for key, (name, shape, has) in shapes.items() if has}
        return LayerWeights(
            input_norm=take(f"{p}input_layernorm.weight", (c.hidden_size,)),
            post_norm=take(f"{p}post_attention_layernorm.weight", (c.hidden_size,)),
            biases=biases,
            **weights,
        )

    # -- the shared body -------------------------------------------------------------------

    def _run_layers(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attend: AttendFn, feature_layers: tuple[int, ...]
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Embed, run every decoder layer, final norm. Leading dims of input_ids are kept."""
        c, ops = self.config, self.ops
        x = F.embedding(input_ids, self.embed_tokens)
        cos, sin = self.rotary.cos_sin(positions, x.dtype)
        captured: dict[int, torch.Tensor] = {}
        pending: torch.Tensor | None = None  # the last sublayer's output, added with the next norm
        for i, layer in enumerate(self.layers):
            if pending is None:
                h = ops.rms_norm(x, layer.input_norm, c.rms_norm_eps)
            else:
                x, h = ops.add_rms_norm(x, pending, layer.input_norm, c.rms_norm_eps)
            if i in feature_layers:
                captured[i] = x
            q = _linear(h, layer.q_proj, layer, "q_proj").unflatten(-1, (c.num_heads, c.head_dim))
            k = _linear(h, layer.k_proj, layer, "k_proj").unflatten(-1, (c.num_kv_heads, c.head_dim))
            v = _linear(h, layer.v_proj, layer, "v_proj").unflatten(-1, (c.num_kv_heads, c.head_dim))
            attn = attend(i, ops.apply_rotary(q, cos, sin), ops.apply_rotary(k, cos, sin), v)
            attn_out = _linear(attn.flatten(-2), layer.o_proj, layer, "o_proj")
            x, h = ops.add_rms_norm(x, attn_out, layer.post_norm, c.rms_norm_eps)
            gate, up = _linear(h, layer.gate_proj, layer, "gate_proj"), _linear(h, layer.up_proj, layer, "up_proj")
            gated = ops.silu_mul(gate, up)
            pending = _linear(gated, layer.down_proj, layer, "down_proj")
        features = torch.cat([captured[i] for i in feature_layers], dim=-1) if feature_layers else None
        assert pending is not None  # a model has at least one layer
        return ops.add_rms_norm(x, pending, self.norm, c.rms_norm_eps)[1], features

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., hidden] -> [..., vocab] in float32."""
        return F.linear(hidden, self.lm_head).float()

    # -- the two attention paths -----------------------------------------------------------

    def forward_paged(
        self,
        input_ids: torch.Tensor,  # [total_q] int64
        positions: torch.Tensor,  # [total_q] int64
        k_pages: torch.Tensor,  # [num_layers, num_pages, page_size, num_kv_heads, head_dim]
        v_pages: torch.Tensor,  # [num_layers, num_pages, page_size, num_kv_heads, head_dim]
        meta: AttentionMetadata,
        backend: AttentionBackend,
        feature_layers: tuple[int, ...] = (),
    ) -> PagedForwardOutput:
        """New tokens of a batch of sequences over their committed pages; the pages are only read."""
        c = self.config
        shape = (c.num_layers, input_ids.numel(), c.num_kv_heads, c.head_dim)
        new_k = torch.empty(shape, dtype=self.dtype, device=self.device)
        new_v = torch.empty(shape, dtype=self.dtype, device=self.device)

        def attend(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            new_k[i], new_v[i] = k, v
            return backend(q, k, v, k_pages[i], v_pages[i], meta, self.scale)

        hidden, features = self._run_layers(input_ids, positions, attend, feature_layers)
        return PagedForwardOutput(hidden, features, new_k, new_v, tuple(feature_layers) if features is not None else ())

    def forward_dense(
        self, input_ids: torch.Tensor, feature_layers: tuple[int, ...] = ()
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """input_ids [batch, seq] from position 0, causal -> (final hidden [B, S, h], features [B, S, 3h])."""
        positions = torch.arange(input_ids.shape[-1], device=input_ids.device).expand_as(input_ids)
        group = self.config.num_heads // self.config.num_kv_heads

        def attend(_: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, heads, S, D]
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale).transpose(1, 2)

        return self._run_layers(input_ids, positions, attend, feature_layers)


class _WeightTaker:
    """Pops checkpoint tensors by name with shape checks, so a wrong layout fails at load time."""

    def __init__(self, state: dict[str, torch.Tensor]) -> None:
        self.state = state

    def __call__(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        if name not in self.state:
            raise CheckpointError(f"checkpoint lacks weight {name!r}")
        tensor = self.state[name]
        if tuple(tensor.shape) != shape:
            raise CheckpointError(f"weight {name!r} has shape {tuple(tensor.shape)}, expected {shape}")
        return tensor
