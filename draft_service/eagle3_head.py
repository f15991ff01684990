"""The EAGLE-3 draft head: fc on the target's features, one decoder layer over (token, feature)
pairs, norm + lm_head over the draft vocab.

The attention is split in two halves (``attention_inputs`` -> caller's attention ->
``attention_outputs``) because each caller attends over different keys: the tree drafter over
its KV cache plus the tree, the trainer over step-0 keys plus each position's unrolled keys,
``forward_dense`` causally. The head holds no per-request state. Serving passes
``FusedProjections`` (q|k|v and gate|up concatenated) to run two matmuls where training runs five.
Its config is ``eagle3_config``, its layer ``eagle3_layers``, its directory ``eagle3_checkpoint``.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from diffspec.errors import CheckpointError
from diffspec.rope import RotaryEmbedding
from draft_service.eagle3_checkpoint import (
    EMBEDDING_KEY,
    VOCAB_MAP_KEYS,
    check_weights,
    read_head_checkpoint,
    write_head_checkpoint,
)
from draft_service.eagle3_config import Eagle3Config
from draft_service.eagle3_layers import FusedProjections, MidLayer, RMSNorm, layer_ops

__all__ = ["Eagle3Config", "Eagle3Head", "FusedProjections"]


class Eagle3Head(nn.Module):
    """fc (3 * target_hidden -> hidden) on target features, one decoder layer, norm + lm_head."""

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
        fused: FusedProjections | None = None,
        kv_out: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """token_ids [..., T], hidden [..., T, hidden], rope: cos, sin [..., T, hd] of the rows' positions
        (``rope``; they may be broadcast views) -> roped q [..., T, heads, hd], roped k [..., T, kv_heads, hd],
        v [..., T, kv_heads, hd].

        ``fused``: the serving path's concatenated weights; None uses the separate layers (training).
        ``kv_out``: where k and v are written (a tree's entry slots), returned in their place.
        """
        c, layer = self.config, self.midlayer
        ops = layer_ops(hidden.device)
        norms = layer.input_layernorm, layer.hidden_norm
        x = ops.head_input(token_ids, self.embed_tokens, hidden, norms[0].weight, norms[1].weight, norms[0].eps)
        qkv = layer.self_attn.qkv(x, fused)
        return ops.qkv_rope(qkv, *rope, c.num_heads, c.num_kv_heads, kv_out)

    def attention_outputs(
        self, attn: torch.Tensor, hidden: torch.Tensor, fused: FusedProjections | None = None
    ) -> torch.Tensor:
        """attn [..., T, heads, hd], hidden [..., T, hidden] (as given to ``attention_inputs``)
        -> draft output [..., T, hidden] (pre-norm).

        The residual is the hidden input, or its ``hidden_norm`` for a head trained with
        ``norm_before_residual`` (as vLLM reads that flag).
        """
        layer = self.midlayer
        residual = layer.hidden_norm(hidden) if self.config.norm_before_residual else hidden
        post_norm = layer.post_attention_layernorm
        x, normed = layer_ops(attn.device).add_rms_norm(
            residual, layer.self_attn.o_proj(attn.flatten(-2)), post_norm.weight, post_norm.eps
        )
        return x + layer.mlp(normed, fused)

    @torch.no_grad()
    def fused_projections(self) -> FusedProjections:
        """Concatenated inference weights; take them once the weights are final (they are a copy)."""
        attn, mlp = self.midlayer.self_attn, self.midlayer.mlp
        return FusedProjections(
            qkv=torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]),
            gate_up=torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]),
        )

    def vocab_logits(self, output: torch.Tensor) -> torch.Tensor:
        """[..., hidden] -> [..., draft_vocab] in the head's dtype (the tree search casts inside its softmax)."""
        return self.lm_head(self.norm(output))

    def draft_logits(self, output: torch.Tensor) -> torch.Tensor:
        """[..., hidden] -> float32 [..., draft_vocab]."""
        return self.vocab_logits(output).float()

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    def forward_dense(self, token_ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Causal self-attention over whole sequences: token_ids [B, S], hidden [B, S, h], positions [B, S]
        -> output [B, S, h]."""
        q, k, v = self.attention_inputs(token_ids, hidden, self.rope(positions))
        group = self.config.num_heads // self.config.num_kv_heads
        q, k, v = (t.transpose(-3, -2) for t in (q, k, v))  # [B, heads, S, hd]
        k, v = k.repeat_interleave(group, dim=-3), v.repeat_interleave(group, dim=-3)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale)
        return self.attention_outputs(attn.transpose(-3, -2), hidden)

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
