"""An EAGLE-3 head's config.json, read as vLLM and SGLang read it.

A published head's config is a Llama config plus EAGLE-3 fields: ``draft_vocab_size``,
``target_hidden_size`` (the width of the target's features when it differs from the head's own),
``norm_before_residual`` and ``eagle_aux_hidden_state_layer_ids`` (the target layers it was trained
on: vLLM reads it at the top level, some heads, this project's own included, nest it under
``eagle_config``). ``num_hidden_layers`` is 1 in the published heads; vLLM and SGLang also run
deeper ones (``eagle3_layers``).
"""

from __future__ import annotations

from dataclasses import dataclass

from diffspec.errors import CheckpointError
from diffspec.model_config import LlamaConfig, RopeConfig, parse_llama_config

PUBLISHED_ARCHITECTURE = "LlamaForCausalLMEagle3"
AUX_LAYERS_KEY = "eagle_aux_hidden_state_layer_ids"


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
    # Declared only: RoPE is computed per position (diffspec.rope), so drafting is not bounded by it.
    max_positions: int = 2048
    norm_before_residual: bool = False  # the residual is hidden_norm(feature) rather than the feature
    num_layers: int = 1  # decoder layers: layer 0 reads (token, feature), the rest the residual stream

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
        if raw.get("hidden_act", "silu") != "silu":
            raise CheckpointError(f"unsupported hidden_act {raw['hidden_act']!r} (EAGLE-3 heads use silu)")
        eagle = raw.get("eagle_config") or {}
        if not eagle.get("use_aux_hidden_state", True):
            raise CheckpointError("a head without auxiliary hidden states (use_aux_hidden_state: false) is not EAGLE-3")
        # The body is Llama layers, so the target's parser applies; its architecture check is the target's.
        llama = parse_llama_config({**raw, "architectures": ["LlamaForCausalLM"], "num_hidden_layers": 1})
        num_layers = raw.get("num_hidden_layers", 1)
        if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers < 1:
            raise CheckpointError(f"num_hidden_layers must be a whole number >= 1, got {num_layers!r}")
        draft_vocab_size = int(raw.get("draft_vocab_size") or llama.vocab_size)
        if not 0 < draft_vocab_size <= llama.vocab_size:
            raise CheckpointError(f"draft_vocab_size {draft_vocab_size} outside 1..vocab_size {llama.vocab_size}")
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
            feature_layers=declared_feature_layers(raw),
            max_positions=llama.max_positions,
            norm_before_residual=bool(raw.get("norm_before_residual", False)),
            num_layers=num_layers,
        )

    def to_json(self) -> dict:
        """A Llama config.json, as the published heads ship."""
        raw: dict = {
            "architectures": [PUBLISHED_ARCHITECTURE],
            "model_type": "llama",
            "hidden_act": "silu",
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "num_hidden_layers": self.num_layers,
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
        if self.norm_before_residual:
            raw["norm_before_residual"] = True
        if self.feature_layers:
            raw["eagle_config"] = {AUX_LAYERS_KEY: list(self.feature_layers)}
        return raw


def declared_feature_layers(raw: dict) -> tuple[int, ...]:
    """The target layers a head's config names, at the top level or under ``eagle_config``; () if none."""
    top, nested = raw.get(AUX_LAYERS_KEY), (raw.get("eagle_config") or {}).get(AUX_LAYERS_KEY)
    try:
        top_ids = tuple(int(i) for i in top or ())
        nested_ids = tuple(int(i) for i in nested or ())
    except (TypeError, ValueError):
        raise CheckpointError(f"{AUX_LAYERS_KEY} must be a list of layer indices, got {top or nested!r}") from None
    if top_ids and nested_ids and top_ids != nested_ids:
        raise CheckpointError(f"{AUX_LAYERS_KEY} is {list(top_ids)} at the top level but {list(nested_ids)} "
                              "under eagle_config")  # fmt: skip
    ids = top_ids or nested_ids
    if ids and len(ids) != 3:
        raise CheckpointError(f"{AUX_LAYERS_KEY} names {len(ids)} layers; fc reads the features of 3")
    return ids
