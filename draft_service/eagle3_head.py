"""The EAGLE-3 draft head: fc on the target's features, decoder layers over (token, feature)
pairs, norm + lm_head over the draft vocab.

Layers. Layer 0 reads the (token, feature) pair; each layer above it reads the residual stream the
layer below returns (as vLLM and SGLang run deeper heads). The last layer's output, before the
norm, is both what lm_head reads (after ``norm``) and the hidden fed back to the next depth. A
published head has layer 0 only.

The attention is split in two halves per layer (``attention_inputs`` -> caller's attention ->
``attention_outputs``) because each caller attends over different keys: the tree drafter over
its KV cache plus the tree, the trainer over step-0 keys plus each position's unrolled keys,
``forward_dense`` causally. The head holds no per-request state. Serving passes each layer's
``ServingProjections`` (``serving_weights``: q|k|v and gate|up concatenated, int8 when asked), so it
runs four matmuls a layer where training runs seven.
Its config is ``eagle3_config``, its layers ``eagle3_layers``, its directory ``eagle3_checkpoint``.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from diffspec.errors import CheckpointError
from diffspec.rope import RotaryEmbedding
from draft_service.draft_attention import causal_attention
from draft_service.eagle3_checkpoint import (
    EMBEDDING_KEY,
    VOCAB_MAP_KEYS,
    check_weights,
    read_head_checkpoint,
    write_head_checkpoint,
)
from draft_service.eagle3_config import Eagle3Config
from draft_service.eagle3_layers import DecoderLayer, MidLayer, RMSNorm, layer_ops
from draft_service.serving_weights import Quantization, ServingLinear, ServingProjections, ServingWeights

__all__ = ["Eagle3Config", "Eagle3Head", "ServingProjections", "ServingWeights"]


class Eagle3Head(nn.Module):
    """fc (3 * target_hidden -> hidden) on target features, decoder layers, norm + lm_head."""

    def __init__(self, config: Eagle3Config, embedding: torch.Tensor, owns_embedding: bool = False) -> None:
        """``embedding`` [vocab, hidden]: the target's (frozen, never saved), or with ``owns_embedding``
        the head's own ``embed_tokens`` (frozen, saved with the head)."""
        super().__init__()
        if not owns_embedding and config.target_hidden_size != config.hidden_size:
            raise CheckpointError(
                f"the head is {config.hidden_size} wide and its target {config.target_hidden_size}: "
                "it cannot embed tokens with the target's embedding, and it ships no embed_tokens"
            )
        if tuple(embedding.shape) != (config.vocab_size, config.hidden_size):
            raise CheckpointError(
                f"{'head' if owns_embedding else 'target'} embedding has shape {tuple(embedding.shape)}, "
                f"the head expects ({config.vocab_size}, {config.hidden_size})"
            )
        self.config = config
        self.scale = config.head_dim**-0.5
        device = embedding.device
        factory = {"device": device, "dtype": embedding.dtype}
        self.fc = nn.Linear(3 * config.target_hidden_size, config.hidden_size, bias=False, **factory)
        self.midlayer = MidLayer(config, factory)
        # layers 1.. keyed as vLLM and SGLang key them (layers.{i}.*); empty for a published one-layer head
        self.layers = nn.ModuleDict({str(i): DecoderLayer(config, factory) for i in range(1, config.num_layers)})
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, factory)
        self.lm_head = nn.Linear(config.hidden_size, config.draft_vocab_size, bias=False, **factory)
        self.rotary = RotaryEmbedding(config.rope, config.head_dim, device)
        # Until a map is set, draft id i is target id i (the identity when the vocabularies match).
        d2t = torch.zeros(config.draft_vocab_size, dtype=torch.int64, device=device)
        self.register_buffer("d2t", d2t)  # [draft_vocab]
        t2d = torch.arange(config.vocab_size, device=device) < config.draft_vocab_size
        self.register_buffer("t2d", t2d)  # [vocab] bool
        self.register_buffer("embed_tokens", embedding.detach(), persistent=owns_embedding)  # [vocab, hidden]

    # -- the forward pieces ------------------------------------------------------------------

    def decoder_layer(self, index: int) -> DecoderLayer:
        return self.midlayer if index == 0 else self.layers[str(index)]

    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """Target features [..., 3 * target_hidden] -> [..., hidden]; the draft's own outputs skip this."""
        return self.fc(features)

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [...] int64 -> cos, sin [..., hd] in the head's dtype (``attention_inputs``' ``rope``)."""
        return self.rotary.cos_sin(positions, self.fc.weight.dtype)

    def attention_inputs(
        self,
        token_ids: torch.Tensor,
        hidden: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        serving: ServingProjections | None = None,
        kv_out: tuple[torch.Tensor, torch.Tensor] | None = None,
        layer: int = 0,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """token_ids [..., T], hidden [..., T, hidden], rope: cos, sin [..., T, hd] of the rows' positions
        (``rope``; they may be broadcast views) -> roped q [..., T, heads, hd], roped k [..., T, kv_heads, hd],
        v [..., T, kv_heads, hd] of decoder layer ``layer``.

        ``hidden``: layer 0's feature side (fc(feature) or a parent's output), or above it the residual
        stream the layer below returned (the token ids are layer 0's only).
        ``serving``: that layer's serving matmuls; None uses the separate layers (training).
        ``kv_out``: where k and v are written (a tree's entry slots), returned in their place.
        """
        c, decoder = self.config, self.decoder_layer(layer)
        qkv = decoder.self_attn.qkv(self._layer_input(token_ids, hidden, layer), serving)
        return layer_ops(hidden.device).qkv_rope(qkv, *rope, c.num_heads, c.num_kv_heads, kv_out)

    def keys_values(
        self,
        token_ids: torch.Tensor,
        hidden: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        serving: ServingProjections,
        layer: int = 0,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``attention_inputs``' roped k and v alone, for entries whose query no one reads (a prompt's, in the last
        layer): the q projection is a third of a start's matmul FLOPs with the 8B-shaped head."""
        kv = serving.kv(self._layer_input(token_ids, hidden, layer))
        _, k, v = layer_ops(hidden.device).qkv_rope(kv, *rope, 0, self.config.num_kv_heads)
        return k, v

    def queries(
        self,
        token_ids: torch.Tensor,
        hidden: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        serving: ServingProjections,
        layer: int = 0,
    ) -> torch.Tensor:
        """``attention_inputs``' roped q alone, for rows whose k and v ``keys_values`` wrote already (a prompt's
        last rows, whose queries the session's first proposal reads)."""
        q = serving.q(self._layer_input(token_ids, hidden, layer))
        return layer_ops(hidden.device).qkv_rope(q, *rope, self.config.num_heads, 0)[0]

    def _layer_input(self, token_ids: torch.Tensor, hidden: torch.Tensor, layer: int) -> torch.Tensor:
        """What decoder layer ``layer``'s projections multiply: layer 0's normed embedding beside its normed
        feature side (2h wide), a layer above it its normed residual stream."""
        decoder = self.decoder_layer(layer)
        if layer == 0:
            norms = decoder.input_layernorm, self.midlayer.hidden_norm
            return layer_ops(hidden.device).head_input(
                token_ids, self.embed_tokens, hidden, norms[0].weight, norms[1].weight, norms[0].eps
            )
        return decoder.input_layernorm(hidden)

    def attention_outputs(
        self, attn: torch.Tensor, hidden: torch.Tensor, serving: ServingProjections | None = None, layer: int = 0
    ) -> torch.Tensor:
        """attn [..., T, heads, hd], hidden [..., T, hidden] (as given to ``attention_inputs``)
        -> decoder layer ``layer``'s output [..., T, hidden] (the residual stream; the last layer's is
        the draft output, pre-norm).

        The residual is the hidden input; layer 0's is the feature's ``hidden_norm`` instead for a head
        trained with ``norm_before_residual`` (as vLLM reads that flag).
        """
        decoder = self.decoder_layer(layer)
        normed_feature = layer == 0 and self.config.norm_before_residual
        residual = self.midlayer.hidden_norm(hidden) if normed_feature else hidden
        post_norm = decoder.post_attention_layernorm
        x, normed = layer_ops(attn.device).add_rms_norm(
            residual, decoder.self_attn.out(attn.flatten(-2), serving), post_norm.weight, post_norm.eps
        )
        return x + decoder.mlp(normed, serving)

    @torch.no_grad()
    def serving_weights(self, quantization: Quantization = "none") -> ServingWeights:
        """Every matmul a draft depth runs, as serving multiplies it; take them once the weights are final."""
        layers = [self.decoder_layer(i).serving_projections(quantization) for i in range(self.config.num_layers)]
        return ServingWeights(layers, ServingLinear.of(self.lm_head.weight, quantization), quantization)

    def vocab_logits(self, output: torch.Tensor, lm_head: ServingLinear | None = None) -> torch.Tensor:
        """[..., hidden] -> [..., draft_vocab] in the head's dtype (the tree search casts inside its softmax).
        ``lm_head``: serving's matmul; None uses the module (training)."""
        normed = self.norm(output)
        return self.lm_head(normed) if lm_head is None else lm_head(normed)

    def draft_logits(self, output: torch.Tensor) -> torch.Tensor:
        """[..., hidden] -> float32 [..., draft_vocab]."""
        return self.vocab_logits(output).float()

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    def forward_dense(self, token_ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Causal self-attention over whole sequences, layer after layer: token_ids [B, S], hidden [B, S, h]
        (layer 0's feature side), positions [B, S] -> the last layer's output [B, S, h] (pre-norm)."""
        rope = self.rope(positions)
        for layer in range(self.config.num_layers):
            q, k, v = self.attention_inputs(token_ids, hidden, rope, layer=layer)
            hidden = self.attention_outputs(causal_attention(q, k, v, self.scale), hidden, layer=layer)
        return hidden

    # -- vocab maps and checkpoints ----------------------------------------------------------

    def set_vocab_map(self, d2t: torch.Tensor, t2d: torch.Tensor) -> None:
        """Install d2t [draft_vocab] int64 and t2d [vocab] bool after checking they describe one set of ids."""
        c = self.config
        if tuple(d2t.shape) != (c.draft_vocab_size,) or tuple(t2d.shape) != (c.vocab_size,):
            raise CheckpointError(f"vocab maps have shapes {tuple(d2t.shape)}, {tuple(t2d.shape)}; "
                                  f"expected ({c.draft_vocab_size},), ({c.vocab_size},)")
        targets = torch.arange(c.draft_vocab_size, device=d2t.device) + d2t.long()
        t2d = t2d.bool()
        ascending = bool((targets[1:] > targets[:-1]).all())
        in_range = bool(((targets >= 0) & (targets < c.vocab_size)).all())
        marked = in_range and bool(t2d[targets].all()) and int(t2d.sum()) == len(targets)
        if not (ascending and marked):
            raise CheckpointError("d2t and t2d disagree: draft ids must map, ascending, onto exactly the ids t2d marks")
        self.d2t.copy_(d2t)
        self.t2d.copy_(t2d)

    @classmethod
    def load(
        cls, head_dir: Path, target_embedding: torch.Tensor | None, device: torch.device, dtype: torch.dtype
    ) -> Eagle3Head:
        """A head directory onto ``device`` in ``dtype``. ``target_embedding`` [vocab, target_hidden]
        may be None when the head ships its own embed_tokens; when both are there, the target's only
        shows that the vocabularies agree."""
        checkpoint = read_head_checkpoint(head_dir)
        config, own = checkpoint.config, checkpoint.embedding
        if target_embedding is not None and target_embedding.shape[0] != config.vocab_size:
            raise CheckpointError(
                f"draft head {head_dir} has a vocabulary of {config.vocab_size} tokens, "
                f"its target {target_embedding.shape[0]}: the head was trained for another target"
            )
        embedding = own if own is not None else target_embedding
        if embedding is None:
            raise CheckpointError(f"draft head {head_dir} ships no embed_tokens and no target embedding was given")
        head = cls(config, embedding.to(device=device, dtype=dtype), owns_embedding=own is not None)
        expected = {name: t for name, t in head.state_dict().items() if name != "embed_tokens"}
        check_weights(Path(head_dir), checkpoint, expected)
        state = dict(checkpoint.weights)
        maps = {name: state.pop(name) for name in VOCAB_MAP_KEYS if name in state}
        head.load_state_dict(state, strict=False)
        if maps:
            head.set_vocab_map(maps["d2t"].to(device), maps["t2d"].to(device))
        return head

    def save(self, head_dir: Path) -> None:
        """config.json + model.safetensors in the published key layout (embed_tokens only if its own)."""
        tensors = self.state_dict()
        if "embed_tokens" in tensors:  # a buffer here, a module's weight in the published layout
            tensors[EMBEDDING_KEY] = tensors.pop("embed_tokens")
        write_head_checkpoint(Path(head_dir), self.config, tensors)
