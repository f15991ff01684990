"""The EAGLE-3 draft head in its published layout: one Llama decoder layer over (token, feature) pairs.

The attention is split in two halves (``attention_inputs`` -> caller's attention ->
``attention_outputs``) because each caller attends over different keys: the tree drafter over
its KV cache plus the tree, the trainer over step-0 keys plus each position's unrolled keys,
``forward_dense`` causally. The head holds no per-request state. Serving passes
``FusedProjections`` (q|k|v and gate|up concatenated) to run two matmuls where training runs five.
"""

from __future__ import annotations

import json
import pickle
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn

from diffspec.errors import CheckpointError
from kernels.layer_ops import REFERENCE_OPS, LayerOps, layer_ops_for
from target_service.checkpoint import (
    LlamaConfig,
    RopeConfig,
    load_state_dict,
    parse_llama_config,
    read_config,
    safetensors_files,
)
from target_service.rope import RotaryEmbedding

PUBLISHED_ARCHITECTURE = "LlamaForCausalLMEagle3"
VOCAB_MAP_KEYS = ("d2t", "t2d")


@dataclass(frozen=True)
class Eagle3Config:
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeConfig
    vocab_size: int  # target vocab
    draft_vocab_size: int
    target_hidden_size: int  # fc input is 3 * target_hidden_size
    feature_layers: tuple[int, ...] = ()  # target layers it was trained on; () = the target's default rule
    max_positions: int = 2048

    @staticmethod
    def for_target(target: LlamaConfig, draft_vocab_size: int, feature_layers: tuple[int, ...]) -> Eagle3Config:
        """A head shaped like one decoder layer of its target, as the published heads are.

        It keeps the target's RoPE (theta and any llama3 scaling): the head runs at the target's
        positions, so sharing its frequencies keeps long-context behaviour in line with the target.
        """
        return Eagle3Config(
            hidden_size=target.hidden_size,
            intermediate_size=target.intermediate_size,
            num_heads=target.num_heads,
            num_kv_heads=target.num_kv_heads,
            head_dim=target.head_dim,
            rms_norm_eps=target.rms_norm_eps,
            rope=target.rope,
            vocab_size=target.vocab_size,
            draft_vocab_size=draft_vocab_size,
            target_hidden_size=target.hidden_size,
            feature_layers=tuple(feature_layers),
            max_positions=target.max_positions,
        )

    @staticmethod
    def from_json(raw: dict) -> Eagle3Config:
        """Parse a head's config.json (published or written by ``to_json``)."""
        if int(raw.get("num_hidden_layers", 1)) != 1:
            raise CheckpointError(f"an EAGLE-3 head has one decoder layer, config says {raw['num_hidden_layers']}")
        if raw.get("hidden_act", "silu") != "silu":
            raise CheckpointError(f"unsupported hidden_act {raw['hidden_act']!r} (EAGLE-3 heads use silu)")
        # The body is a Llama layer, so the target's parser applies; its architecture check is the target's.
        llama = parse_llama_config({**raw, "architectures": ["LlamaForCausalLM"], "num_hidden_layers": 1})
        draft_vocab_size = int(raw.get("draft_vocab_size") or llama.vocab_size)
        if not 0 < draft_vocab_size <= llama.vocab_size:
            raise CheckpointError(f"draft_vocab_size {draft_vocab_size} outside 1..vocab_size {llama.vocab_size}")
        layers = (raw.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids") or ()
        return Eagle3Config(
            hidden_size=llama.hidden_size,
            intermediate_size=llama.intermediate_size,
            num_heads=llama.num_heads,
            num_kv_heads=llama.num_kv_heads,
            head_dim=llama.head_dim,
            rms_norm_eps=llama.rms_norm_eps,
            rope=llama.rope,
            vocab_size=llama.vocab_size,
            draft_vocab_size=draft_vocab_size,
            target_hidden_size=int(raw.get("target_hidden_size") or llama.hidden_size),
            feature_layers=tuple(int(i) for i in layers),
            max_positions=llama.max_positions,
        )

    def to_json(self) -> dict:
        """A Llama config.json with one layer, as the published heads ship."""
        raw: dict = {
            "architectures": [PUBLISHED_ARCHITECTURE],
            "model_type": "llama",
            "hidden_act": "silu",
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "num_hidden_layers": 1,
            "rms_norm_eps": self.rms_norm_eps,
            "max_position_embeddings": self.max_positions,
            "vocab_size": self.vocab_size,
            "draft_vocab_size": self.draft_vocab_size,
            "tie_word_embeddings": False,
            "rope_theta": self.rope.theta,
        }
        if self.rope.kind == "llama3":
            raw["rope_scaling"] = {
                "rope_type": "llama3",
                "factor": self.rope.factor,
                "low_freq_factor": self.rope.low_freq_factor,
                "high_freq_factor": self.rope.high_freq_factor,
                "original_max_position_embeddings": self.rope.original_max_positions,
            }
        if self.target_hidden_size != self.hidden_size:
            raw["target_hidden_size"] = self.target_hidden_size
        if self.feature_layers:
            raw["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(self.feature_layers)}
        return raw


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, factory: dict) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size, **factory))  # [size]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _ops(x.device).rms_norm(x, self.weight, self.eps)


def _ops(device: torch.device) -> LayerOps:
    """Fused kernels when serving on a GPU; they have no backward, so training keeps the reference."""
    return REFERENCE_OPS if torch.is_grad_enabled() else layer_ops_for(device)


@dataclass(frozen=True)
class FusedProjections:
    """The q|k|v and gate|up weights concatenated: one matmul each instead of three and two.

    A snapshot for serving, where the weights no longer change. Training keeps the separate
    layers (their gradients, the published checkpoint keys), so this is never saved.
    """

    qkv: torch.Tensor  # [(heads + 2 * kv_heads) * hd, 2 * hidden]
    gate_up: torch.Tensor  # [2 * intermediate, hidden]


class _AttentionProjections(nn.Module):
    """q/k/v read the 2h-wide (embedding, feature) concat; o writes back h."""

    def __init__(self, c: Eagle3Config, factory: dict) -> None:
        super().__init__()
        q_out, kv_out, wide = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, 2 * c.hidden_size
        self.q_proj = nn.Linear(wide, q_out, bias=False, **factory)
        self.k_proj = nn.Linear(wide, kv_out, bias=False, **factory)
        self.v_proj = nn.Linear(wide, kv_out, bias=False, **factory)
        self.o_proj = nn.Linear(q_out, c.hidden_size, bias=False, **factory)


class _MLP(nn.Module):
    def __init__(self, c: Eagle3Config, factory: dict) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False, **factory)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False, **factory)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False, **factory)

    def forward(self, x: torch.Tensor, fused: FusedProjections | None = None) -> torch.Tensor:
        if fused is None:
            gate, up = self.gate_proj(x), self.up_proj(x)
        else:
            gate, up = F.linear(x, fused.gate_up).chunk(2, dim=-1)
        return self.down_proj(_ops(x.device).silu_mul(gate, up))


class _MidLayer(nn.Module):
    """Attribute names are the published checkpoint's ``midlayer.*`` keys."""

    def __init__(self, c: Eagle3Config, factory: dict) -> None:
        super().__init__()
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps, factory)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, factory)
        self.self_attn = _AttentionProjections(c, factory)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, factory)
        self.mlp = _MLP(c, factory)


class Eagle3Head(nn.Module):
    """fc (3h -> h) on target features, one decoder layer, norm + lm_head over the draft vocab."""

    def __init__(self, config: Eagle3Config, target_embedding: torch.Tensor) -> None:
        super().__init__()
        if config.target_hidden_size != config.hidden_size:
            raise CheckpointError(
                f"head hidden_size {config.hidden_size} differs from its target's {config.target_hidden_size}; "
                "only heads as wide as their target are supported (they reuse its embedding)"
            )
        if tuple(target_embedding.shape) != (config.vocab_size, config.hidden_size):
            raise CheckpointError(
                f"target embedding has shape {tuple(target_embedding.shape)}, "
                f"the head expects ({config.vocab_size}, {config.hidden_size})"
            )
        self.config = config
        self.scale = config.head_dim**-0.5
        factory = {"device": target_embedding.device, "dtype": target_embedding.dtype}
        self.fc = nn.Linear(3 * config.target_hidden_size, config.hidden_size, bias=False, **factory)
        self.midlayer = _MidLayer(config, factory)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, factory)
        self.lm_head = nn.Linear(config.hidden_size, config.draft_vocab_size, bias=False, **factory)
        self.rotary = RotaryEmbedding(config.rope, config.head_dim, target_embedding.device)
        device = target_embedding.device
        # Until a map is set, draft id i is target id i (the identity when the vocabularies match).
        d2t = torch.zeros(config.draft_vocab_size, dtype=torch.int64, device=device)
        self.register_buffer("d2t", d2t)  # [draft_vocab]
        t2d = torch.arange(config.vocab_size, device=device) < config.draft_vocab_size
        self.register_buffer("t2d", t2d)  # [vocab] bool
        # The target's own embedding, frozen and never saved.
        self.register_buffer("embed_tokens", target_embedding.detach(), persistent=False)  # [vocab, target_hidden]

    # -- the forward pieces ------------------------------------------------------------------

    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """Target features [..., 3 * target_hidden] -> [..., hidden]; the draft's own outputs skip this."""
        return self.fc(features)

    def attention_inputs(
        self,
        token_ids: torch.Tensor,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        fused: FusedProjections | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """token_ids [..., T], hidden [..., T, hidden], positions [..., T]
        -> roped q [..., T, heads, hd], roped k [..., T, kv_heads, hd], v [..., T, kv_heads, hd].

        ``fused``: the serving path's concatenated weights; None uses the separate layers (training).
        """
        c, layer = self.config, self.midlayer
        token = layer.input_layernorm(F.embedding(token_ids, self.embed_tokens))
        x = torch.cat([token, layer.hidden_norm(hidden)], dim=-1)
        q, k, v = self._qkv(x, fused)
        q = q.unflatten(-1, (c.num_heads, c.head_dim))
        k = k.unflatten(-1, (c.num_kv_heads, c.head_dim))
        v = v.unflatten(-1, (c.num_kv_heads, c.head_dim))
        cos, sin = self.rotary.cos_sin(positions, q.dtype)
        rotate = _ops(q.device).apply_rotary
        return rotate(q, cos, sin), rotate(k, cos, sin), v

    def _qkv(
        self, x: torch.Tensor, fused: FusedProjections | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        attn = self.midlayer.self_attn
        if fused is None:
            return attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)
        widths = [attn.q_proj.out_features, attn.k_proj.out_features, attn.v_proj.out_features]
        q, k, v = F.linear(x, fused.qkv).split(widths, dim=-1)
        return q, k, v

    def attention_outputs(
        self, attn: torch.Tensor, hidden: torch.Tensor, fused: FusedProjections | None = None
    ) -> torch.Tensor:
        """attn [..., T, heads, hd], residual hidden [..., T, hidden] -> draft output [..., T, hidden] (pre-norm)."""
        layer = self.midlayer
        x = hidden + layer.self_attn.o_proj(attn.flatten(-2))
        return x + layer.mlp(layer.post_attention_layernorm(x), fused)

    @torch.no_grad()
    def fused_projections(self) -> FusedProjections:
        """Concatenated inference weights; take them once the weights are final (they are a copy)."""
        attn, mlp = self.midlayer.self_attn, self.midlayer.mlp
        return FusedProjections(
            qkv=torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]),
            gate_up=torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]),
        )

    def draft_logits(self, output: torch.Tensor) -> torch.Tensor:
        """[..., hidden] -> float32 [..., draft_vocab]."""
        return self.lm_head(self.norm(output)).float()

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    def forward_dense(self, token_ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Causal self-attention over whole sequences: token_ids [B, S], hidden [B, S, h], positions [B, S]
        -> output [B, S, h]."""
        q, k, v = self.attention_inputs(token_ids, hidden, positions)
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
        cls, head_dir: Path, target_embedding: torch.Tensor, device: torch.device, dtype: torch.dtype
    ) -> Eagle3Head:
        """A head directory (config.json + pytorch_model.bin or safetensors) onto ``device`` in ``dtype``."""
        head_dir = Path(head_dir)
        config = Eagle3Config.from_json(read_config(head_dir))
        state = _read_weights(head_dir)
        head = cls(config, target_embedding.to(device=device, dtype=dtype))
        expected = head.state_dict()
        optional = set(VOCAB_MAP_KEYS) if config.draft_vocab_size == config.vocab_size else set()
        missing, extra = sorted(expected.keys() - state.keys() - optional), sorted(state.keys() - expected.keys())
        if missing or extra:
            raise CheckpointError(f"{head_dir}: missing keys {missing}, unexpected keys {extra}")
        misshaped = [
            f"{name} {tuple(state[name].shape)} (expected {tuple(want.shape)})"
            for name, want in expected.items()
            if name in state and state[name].shape != want.shape
        ]
        if misshaped:
            raise CheckpointError(f"{head_dir}: misshaped weights: {', '.join(misshaped)}")
        maps = {name: state.pop(name) for name in VOCAB_MAP_KEYS if name in state}
        head.load_state_dict(state, strict=False)
        if maps:
            head.set_vocab_map(maps["d2t"].to(device), maps["t2d"].to(device))
        return head

    def save(self, head_dir: Path) -> None:
        """config.json + model.safetensors in the published key layout (no embed_tokens)."""
        head_dir = Path(head_dir)
        head_dir.mkdir(parents=True, exist_ok=True)
        (head_dir / "config.json").write_text(json.dumps(self.config.to_json(), indent=2) + "\n")
        tensors = {name: t.detach().cpu().contiguous() for name, t in self.state_dict().items()}
        save_file(tensors, str(head_dir / "model.safetensors"))


def _read_weights(head_dir: Path) -> dict[str, torch.Tensor]:
    """Safetensors when present (as transformers prefers), else the published pytorch_model.bin."""
    if (head_dir / "model.safetensors.index.json").exists() or any(head_dir.glob("*.safetensors")):
        return load_state_dict(safetensors_files(head_dir), torch.device("cpu"), None)
    path = head_dir / "pytorch_model.bin"
    if not path.exists():
        raise CheckpointError(f"no weights in {head_dir}: expected pytorch_model.bin or *.safetensors")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except (OSError, RuntimeError, EOFError, pickle.UnpicklingError) as bad:
        raise CheckpointError(f"cannot read {path}: {bad}") from None
    if not isinstance(state, dict) or not all(isinstance(t, torch.Tensor) for t in state.values()):
        raise CheckpointError(f"{path} is not a flat state dict of tensors")
    return state
