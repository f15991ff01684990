"""EAGLE-3 head: published checkpoint layouts (one layer and deeper), loading errors, vocab maps, split
attention == dense."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import torch.nn.functional as F

from diffspec.errors import CheckpointError
from draft_service import serving_weights
from draft_service.eagle3_head import Eagle3Config, Eagle3Head
from draft_service.serving_weights import INT8_MAX_ROWS, ServingLinear
from draft_service.vocab_map import build_vocab_map, target_to_draft_index
from diffspec.model_config import RopeConfig
from diffspec_kernels.layer_ops_ref import apply_rotary

VOCAB, DRAFT_VOCAB, HIDDEN = 96, 40, 32
PUBLISHED_KEYS = {
    "fc.weight", "midlayer.hidden_norm.weight", "midlayer.input_layernorm.weight",
    "midlayer.self_attn.q_proj.weight", "midlayer.self_attn.k_proj.weight", "midlayer.self_attn.v_proj.weight",
    "midlayer.self_attn.o_proj.weight", "midlayer.post_attention_layernorm.weight", "midlayer.mlp.gate_proj.weight",
    "midlayer.mlp.up_proj.weight", "midlayer.mlp.down_proj.weight", "norm.weight", "lm_head.weight", "d2t", "t2d",
}


UPPER_LAYER_KEYS = {  # a decoder layer above layer 0, as vLLM and SGLang key it
    "input_layernorm.weight", "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
    "self_attn.o_proj.weight", "post_attention_layernorm.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight",
    "mlp.down_proj.weight",
}


def small_config(draft_vocab: int = DRAFT_VOCAB, num_layers: int = 1, head_dim: int = 8) -> Eagle3Config:
    return Eagle3Config(
        hidden_size=HIDDEN, intermediate_size=48, num_heads=4, num_kv_heads=2, head_dim=head_dim, rms_norm_eps=1e-5,
        rope=RopeConfig(theta=10000.0), vocab_size=VOCAB, draft_vocab_size=draft_vocab, target_hidden_size=HIDDEN,
        feature_layers=(1, 2, 3), max_positions=512, num_layers=num_layers,
    )


def random_head(draft_vocab: int = DRAFT_VOCAB, seed: int = 0, num_layers: int = 1, head_dim: int = 8) -> Eagle3Head:
    """Every weight random (norms too), with a frequency-built vocab map."""
    generator = torch.Generator().manual_seed(seed)
    config = small_config(draft_vocab, num_layers, head_dim)
    head = Eagle3Head(config, torch.randn(VOCAB, HIDDEN, generator=generator))
    with torch.no_grad():
        for param in head.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * 0.3)
    head.set_vocab_map(*build_vocab_map(torch.randint(0, 1000, (VOCAB,), generator=generator), draft_vocab))
    return head


def save_bin(head: Eagle3Head, head_dir: Path, state: dict[str, torch.Tensor] | None = None) -> Path:
    """The published layout: config.json + pytorch_model.bin."""
    head_dir.mkdir(parents=True, exist_ok=True)
    (head_dir / "config.json").write_text(json.dumps(head.config.to_json()))
    torch.save(head.state_dict() if state is None else state, head_dir / "pytorch_model.bin")
    return head_dir


@pytest.mark.parametrize("layout", ["safetensors", "pytorch_model.bin"])
def test_saved_head_reloads_bit_identically(tmp_path: Path, layout: str) -> None:
    head = random_head()
    if layout == "safetensors":
        head.save(tmp_path)
    else:
        save_bin(head, tmp_path)
    loaded = Eagle3Head.load(tmp_path, head.embed_tokens, torch.device("cpu"), torch.float32)
    assert set(loaded.state_dict()) == PUBLISHED_KEYS  # embed_tokens never saved
    assert loaded.config == head.config
    for name, tensor in head.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    assert loaded.state_dict()["d2t"].dtype == torch.int64 and loaded.state_dict()["t2d"].dtype == torch.bool


def test_published_config_defaults() -> None:
    raw = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": 64,
           "intermediate_size": 96, "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 1,
           "rms_norm_eps": 1e-5, "vocab_size": 500, "draft_vocab_size": 100, "max_position_embeddings": 2048}
    config = Eagle3Config.from_json(raw)
    assert config.rope == RopeConfig(theta=10000.0)  # no rope_theta -> 10000
    assert (config.head_dim, config.target_hidden_size, config.feature_layers) == (16, 64, ())
    raw |= {"target_hidden_size": 128, "eagle_config": {"eagle_aux_hidden_state_layer_ids": [2, 16, 29]}}
    config = Eagle3Config.from_json(raw)
    assert (config.target_hidden_size, config.feature_layers) == (128, (2, 16, 29))
    assert Eagle3Config.from_json(config.to_json()) == config
    with pytest.raises(CheckpointError, match="it ships no embed_tokens"):
        Eagle3Head(config, torch.zeros(500, 64))


def test_llama3_rope_round_trips() -> None:
    rope = RopeConfig(theta=500000.0, kind="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                      original_max_positions=8192)
    config = Eagle3Config(**{**small_config().__dict__, "rope": rope})
    assert Eagle3Config.from_json(config.to_json()) == config


def _drop(key: str):
    return lambda state: {k: v for k, v in state.items() if k != key}


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (_drop("midlayer.mlp.up_proj.weight"), r"missing keys \['midlayer.mlp.up_proj.weight'\]"),
        (_drop("d2t"), r"missing keys \['d2t'\]"),
        (lambda s: s | {"midlayer.extra.weight": torch.zeros(3)}, r"unexpected keys \['midlayer.extra.weight'\]"),
        (lambda s: s | {"lm_head.weight": torch.zeros(DRAFT_VOCAB + 1, HIDDEN)}, r"misshaped weights: lm_head.weight"),
        (lambda s: s | {"d2t": s["d2t"].flip(0)}, "d2t and t2d disagree"),
    ],
)
def test_bad_checkpoints_fail_clearly(tmp_path: Path, edit, message: str) -> None:
    head = random_head()
    save_bin(head, tmp_path, edit(head.state_dict()))
    with pytest.raises(CheckpointError, match=message):
        Eagle3Head.load(tmp_path, head.embed_tokens, torch.device("cpu"), torch.float32)


def test_missing_directory_and_weights(tmp_path: Path) -> None:
    head = random_head()
    with pytest.raises(CheckpointError, match="does not exist"):
        Eagle3Head.load(tmp_path / "nowhere", head.embed_tokens, torch.device("cpu"), torch.float32)
    (tmp_path / "config.json").write_text(json.dumps(head.config.to_json()))
    with pytest.raises(CheckpointError, match="no weights"):
        Eagle3Head.load(tmp_path, head.embed_tokens, torch.device("cpu"), torch.float32)
    head.save(tmp_path)
    with pytest.raises(CheckpointError, match="vocabulary of 96 tokens, its target 97"):
        Eagle3Head.load(tmp_path, torch.zeros(VOCAB + 1, HIDDEN), torch.device("cpu"), torch.float32)
    with pytest.raises(CheckpointError, match=r"target embedding has shape \(96, 33\)"):
        Eagle3Head.load(tmp_path, torch.zeros(VOCAB, HIDDEN + 1), torch.device("cpu"), torch.float32)


def test_full_vocab_head_without_maps_is_identity(tmp_path: Path) -> None:
    head = random_head(draft_vocab=VOCAB)
    state = {k: v for k, v in head.state_dict().items() if k not in ("d2t", "t2d")}
    loaded = Eagle3Head.load(save_bin(head, tmp_path, state), head.embed_tokens, torch.device("cpu"), torch.float32)
    ids = torch.arange(VOCAB)
    assert torch.equal(loaded.to_target_ids(ids), ids)
    assert bool(loaded.t2d.all())


def test_vocab_map_round_trip() -> None:
    counts = torch.zeros(VOCAB, dtype=torch.int64)
    used = torch.tensor([3, 7, 8, 50, 95])
    counts[used] = torch.tensor([10, 40, 30, 20, 99])
    counts[60] = 10  # ties with id 3 at the cut: the lower id wins
    d2t, t2d = build_vocab_map(counts, 5)
    head = Eagle3Head(small_config(draft_vocab=5), torch.zeros(VOCAB, HIDDEN))
    head.set_vocab_map(d2t, t2d)
    assert head.to_target_ids(torch.arange(5)).tolist() == used.tolist()
    assert t2d.nonzero().flatten().tolist() == used.tolist()
    index = target_to_draft_index(t2d)
    assert index[used].tolist() == [0, 1, 2, 3, 4]
    assert int((index >= 0).sum()) == 5 and int(index[60]) == -1
    d2t_full, t2d_full = build_vocab_map(counts, VOCAB)
    assert not d2t_full.any() and t2d_full.all()


def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, t: int, scale: float) -> torch.Tensor:
    """Query t over keys 0..t, query head h reading kv head h // group, spelt out per head."""
    heads, kv_heads = q.shape[-2], k.shape[-2]
    rows = []
    for h in range(heads):
        kv = h // (heads // kv_heads)
        weights = torch.softmax(k[: t + 1, kv] @ q[t, h] * scale, dim=0)
        rows.append(weights @ v[: t + 1, kv])
    return torch.stack(rows)


def test_split_attention_matches_forward_dense() -> None:
    """attention_inputs -> per-token attention over a growing KV -> attention_outputs == forward_dense."""
    head = random_head()
    seq = 9
    token_ids = torch.randint(0, VOCAB, (1, seq), generator=torch.Generator().manual_seed(1))
    features = torch.randn(1, seq, 3 * HIDDEN, generator=torch.Generator().manual_seed(2))
    positions = torch.arange(5, 5 + seq).unsqueeze(0)  # rope must read the given positions
    hidden = head.fuse(features)
    with torch.no_grad():
        dense = head.forward_dense(token_ids, hidden, positions)
        q, k, v = head.attention_inputs(token_ids[0], hidden[0], head.rope(positions[0]))
        attn = torch.stack([reference_attention(q, k, v, t, head.scale) for t in range(seq)])
        split = head.attention_outputs(attn, hidden[0])
        shifted = head.forward_dense(token_ids, hidden, positions + 3)
        spread = head.forward_dense(token_ids, hidden, positions * 2)
    assert q.shape == (seq, 4, 8) and k.shape == (seq, 2, 8)
    torch.testing.assert_close(split, dense[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(shifted, dense, rtol=1e-4, atol=1e-4)  # RoPE: only distances matter
    assert not torch.allclose(spread, dense, atol=1e-3)  # ...and they do matter
    logits = head.draft_logits(dense)
    assert logits.dtype == torch.float32 and logits.shape == (1, seq, DRAFT_VOCAB)


@pytest.mark.parametrize("quantization, tolerance", [("none", 1e-6), ("int8", 0.03)])
def test_serving_weights_equal_the_separate_layers(quantization, tolerance) -> None:
    """q|k|v and gate|up as one matmul each, and every matmul in int8, give what the checkpoint's separate layers
    give: exactly up to the sum's order, and within int8's rounding (a few per cent of the output's range)."""
    head = random_head()
    gen = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, VOCAB, (7,), generator=gen)
    hidden = torch.randn(7, HIDDEN, generator=gen)
    positions = torch.arange(40, 47)
    weights = head.serving_weights(quantization)
    (serving,) = weights.layers

    def close(got: torch.Tensor, want: torch.Tensor) -> None:
        torch.testing.assert_close(got, want, rtol=0, atol=tolerance * want.abs().max().item())

    with torch.no_grad():
        for got, want in zip(head.attention_inputs(tokens, hidden, head.rope(positions), serving),
                             head.attention_inputs(tokens, hidden, head.rope(positions))):  # fmt: skip
            close(got, want)
        attn = torch.randn(7, 4, 8, generator=gen)
        close(head.attention_outputs(attn, hidden, serving), head.attention_outputs(attn, hidden))
        close(head.vocab_logits(hidden, weights.lm_head), head.vocab_logits(hidden))


@pytest.mark.parametrize("quantization", ["none", "int8", "auto"])
def test_the_q_alone_and_the_k_v_alone_are_the_fused_projections_parts(quantization, monkeypatch) -> None:
    """A prompt's start projects its keys and values alone and its last rows' queries alone (``keys_values``,
    ``queries``): each is the fused q|k|v matmul's own part, bit for bit, as views of its rows and their scales."""
    monkeypatch.setattr(serving_weights, "AUTO_INT8_MIN_ELEMENTS", 1)  # auto: both copies at this head's size
    head = random_head()
    gen = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, VOCAB, (6,), generator=gen)
    hidden = torch.randn(6, HIDDEN, generator=gen)
    rope = head.rope(torch.arange(100, 106))
    (serving,) = head.serving_weights(quantization).layers
    with torch.no_grad():
        q, k, v = head.attention_inputs(tokens, hidden, rope, serving)
        k_alone, v_alone = head.keys_values(tokens, hidden, rope, serving)
        q_alone = head.queries(tokens, hidden, rope, serving)
    assert torch.equal(q_alone, q) and torch.equal(k_alone, k) and torch.equal(v_alone, v)
    assert serving.q.weight.data_ptr() == serving.qkv.weight.data_ptr()  # views, not copies


def test_int8_serving_weights_read_about_half_the_bytes() -> None:
    head = random_head()
    full, int8 = head.serving_weights("none"), head.serving_weights("int8")
    assert full.quantization == "none" and int8.quantization == "int8"
    assert all(p.qkv.weight.dtype == torch.int8 and p.down.scale is not None for p in int8.layers)
    rows = sum(linear.weight.shape[0] for p in int8.layers for linear in (p.qkv, p.o, p.gate_up, p.down))
    rows += int8.lm_head.weight.shape[0]
    # a float32 head's 4 bytes a weight become 1, plus one float32 scale per output row
    assert int8.bytes_per_depth == full.bytes_per_depth // 4 + 4 * rows


def test_auto_multiplies_the_large_matrices_in_int8_at_few_rows_and_in_the_dtype_past_them(monkeypatch) -> None:
    monkeypatch.setattr(serving_weights, "AUTO_INT8_MIN_ELEMENTS", 64 * 32)  # the real bound: 8B-shaped matrices
    gen = torch.Generator().manual_seed(5)
    large, small = torch.randn(64, 32, generator=gen), torch.randn(63, 32, generator=gen)
    auto_large, auto_small = ServingLinear.of(large, "auto"), ServingLinear.of(small, "auto")
    int8 = ServingLinear.of(large, "int8")
    assert auto_large.weight.dtype == torch.int8 and auto_large.dense is large
    assert auto_small.scale is None and auto_small.weight is small  # under the bound: the dtype only
    few = torch.randn(2, INT8_MAX_ROWS // 2, 32, generator=gen)  # exactly INT8_MAX_ROWS rows
    many = torch.randn(INT8_MAX_ROWS + 1, 32, generator=gen)
    assert torch.equal(auto_large(few), int8(few))
    assert torch.equal(auto_large(many), F.linear(many, large))
    assert not torch.equal(int8(many), F.linear(many, large))  # the two paths differ: the rows chose one
    assert auto_large.nbytes == int8.nbytes  # what a few rows read


# -- configs as vLLM reads them ----------------------------------------------------------------

AUX = "eagle_aux_hidden_state_layer_ids"


def json_without_aux_layers() -> dict:
    return {k: v for k, v in small_config().to_json().items() if k != "eagle_config"}


@pytest.mark.parametrize(
    ("extra", "layers"),
    [
        ({AUX: [1, 5, 9]}, (1, 5, 9)),
        ({"eagle_config": {AUX: [1, 5, 9]}}, (1, 5, 9)),
        ({AUX: [1, 5, 9], "eagle_config": {AUX: [1, 5, 9], "use_aux_hidden_state": True}}, (1, 5, 9)),
        ({"eagle_config": {}}, ()),
    ],
    ids=["top-level", "nested", "both", "none"],
)
def test_aux_layer_ids_at_either_level(extra: dict, layers: tuple[int, ...]) -> None:
    assert Eagle3Config.from_json(json_without_aux_layers() | extra).feature_layers == layers


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({AUX: [1, 5, 9], "eagle_config": {AUX: [2, 5, 9]}}, r"\[1, 5, 9\] at the top level but \[2, 5, 9\]"),
        ({AUX: [1, 5]}, "names 2 layers; fc reads the features of 3"),
        ({AUX: ["x", 1, 2]}, "must be a list of layer indices"),
        ({"num_hidden_layers": 0}, "num_hidden_layers must be a whole number >= 1, got 0"),
        ({"eagle_config": {"use_aux_hidden_state": False}}, "use_aux_hidden_state: false"),
    ],
    ids=["conflict", "two-layers", "not-ints", "no-layers", "no-aux"],
)
def test_unsupported_configs_say_why(extra: dict, message: str) -> None:
    with pytest.raises(CheckpointError, match=message):
        Eagle3Config.from_json(json_without_aux_layers() | extra)


def test_norm_before_residual_makes_the_normed_feature_the_residual() -> None:
    plain = random_head()
    config = Eagle3Config(**{**small_config().__dict__, "norm_before_residual": True})
    assert Eagle3Config.from_json(config.to_json()) == config and config.to_json()["norm_before_residual"]
    normed = Eagle3Head(config, plain.embed_tokens)
    normed.load_state_dict(plain.state_dict())
    gen = torch.Generator().manual_seed(4)
    attn, hidden = torch.randn(5, 4, 8, generator=gen), torch.randn(5, HIDDEN, generator=gen) * 3
    layer = plain.midlayer
    with torch.no_grad():
        x = layer.hidden_norm(hidden) + layer.self_attn.o_proj(attn.flatten(-2))
        want = x + layer.mlp(layer.post_attention_layernorm(x))
        torch.testing.assert_close(normed.attention_outputs(attn, hidden), want, rtol=1e-5, atol=1e-5)
        assert not torch.allclose(plain.attention_outputs(attn, hidden), want, atol=1e-2)


def narrow_head_with_embedding(seed: int = 5) -> Eagle3Head:
    """A head 32 wide over a target 48 wide: it must ship its own embed_tokens [vocab, 32]."""
    config = Eagle3Config(**{**small_config().__dict__, "target_hidden_size": 48})
    generator = torch.Generator().manual_seed(seed)
    head = Eagle3Head(config, torch.randn(VOCAB, HIDDEN, generator=generator), owns_embedding=True)
    with torch.no_grad():
        for param in head.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * 0.3)
    return head


@pytest.mark.parametrize("target_embedding", [None, torch.zeros(VOCAB, 48)], ids=["no-target", "target"])
def test_a_head_with_its_own_embedding_reads_wider_target_features(tmp_path: Path, target_embedding) -> None:
    head = narrow_head_with_embedding()
    assert head.fc.weight.shape == (HIDDEN, 3 * 48)
    head.save(tmp_path)
    loaded = Eagle3Head.load(tmp_path, target_embedding, torch.device("cpu"), torch.float32)
    assert torch.equal(loaded.embed_tokens, head.embed_tokens)  # the head's own, not the target's zeros
    assert "embed_tokens" in loaded.state_dict()  # saved with the head
    features = torch.randn(1, 6, 3 * 48, generator=torch.Generator().manual_seed(6))
    tokens, positions = torch.randint(0, VOCAB, (1, 6)), torch.arange(6).unsqueeze(0)
    with torch.no_grad():
        torch.testing.assert_close(loaded.forward_dense(tokens, loaded.fuse(features), positions),
                                   head.forward_dense(tokens, head.fuse(features), positions))  # fmt: skip


def test_a_narrow_head_without_an_embedding_is_refused(tmp_path: Path) -> None:
    head = narrow_head_with_embedding()
    state = {k: v for k, v in head.state_dict().items() if k != "embed_tokens"}
    save_bin(head, tmp_path, state)
    with pytest.raises(CheckpointError, match="it ships no embed_tokens"):
        Eagle3Head.load(tmp_path, torch.zeros(VOCAB, 48), torch.device("cpu"), torch.float32)


def test_layers_0_keys_read_as_midlayer(tmp_path: Path) -> None:
    head = random_head()
    state = {k.replace("midlayer.", "layers.0."): v for k, v in head.state_dict().items()}
    loaded = Eagle3Head.load(save_bin(head, tmp_path, state), head.embed_tokens, torch.device("cpu"), torch.float32)
    assert torch.equal(loaded.midlayer.self_attn.q_proj.weight, head.midlayer.self_attn.q_proj.weight)


# -- heads of more than one decoder layer ------------------------------------------------------


def test_a_two_layer_head_saves_layer_0_as_midlayer_and_layer_1_as_layers_1(tmp_path: Path) -> None:
    head = random_head(num_layers=2)
    assert set(head.state_dict()) == PUBLISHED_KEYS | {f"layers.1.{key}" for key in UPPER_LAYER_KEYS}
    assert not any(key.startswith("layers.") for key in random_head().state_dict())  # one layer: keys unchanged
    assert Eagle3Config.from_json(head.config.to_json()) == head.config
    assert head.config.to_json()["num_hidden_layers"] == 2 and small_config().to_json()["num_hidden_layers"] == 1
    head.save(tmp_path)
    loaded = Eagle3Head.load(tmp_path, head.embed_tokens, torch.device("cpu"), torch.float32)
    assert loaded.config.num_layers == 2
    for name, tensor in head.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name


def _as_vllm(name: str) -> str:
    return name.replace("midlayer.", "layers.0.")


def _as_sglang(name: str) -> str:  # SGLang names the norm before attention of layers 1.. hidden_norm
    return _as_vllm(name).replace("layers.1.input_layernorm.", "layers.1.hidden_norm.")


def _as_sglang_midlayer(name: str) -> str:  # SGLang's older layer-0 name, which it still reads
    return _as_sglang(name).replace("layers.0.", "midlayer.")


@pytest.mark.parametrize(
    "rename",
    [lambda name: name, _as_vllm, _as_sglang, _as_sglang_midlayer],
    ids=["midlayer+layers.1", "layers.0+layers.1(vLLM)", "layers.0+hidden_norm(SGLang)", "midlayer+hidden_norm"],
)
def test_a_two_layer_head_loads_from_each_layout_vllm_and_sglang_read(tmp_path: Path, rename) -> None:
    head = random_head(num_layers=2)
    state = {rename(name): tensor for name, tensor in head.state_dict().items()}
    loaded = Eagle3Head.load(save_bin(head, tmp_path, state), head.embed_tokens, torch.device("cpu"), torch.float32)
    assert set(loaded.state_dict()) == set(head.state_dict())
    for name, tensor in head.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda s: {k.replace("midlayer.", "midlayer.0.").replace("layers.1.", "midlayer.1."): v
                    for k, v in s.items()},
         r"midlayer.0.hidden_norm.weight: neither vLLM nor SGLang reads midlayer.\{i\}.\* keys"),
        (lambda s: s | {"layers.1.hidden_norm.weight": s["layers.1.input_layernorm.weight"]},
         "layers.1.input_layernorm.weight and layers.1.hidden_norm.weight are both layers.1.input_layernorm.weight"),
        (lambda s: s | {"layers.0.mlp.up_proj.weight": s["midlayer.mlp.up_proj.weight"]},
         "midlayer.mlp.up_proj.weight and layers.0.mlp.up_proj.weight are both midlayer.mlp.up_proj.weight"),
        (lambda s: {k: v for k, v in s.items() if not k.startswith("layers.1.")},
         r"missing keys \['layers.1.input_layernorm.weight', 'layers.1.mlp.down_proj.weight'"),
        (lambda s: s | {"layers.2.input_layernorm.weight": s["layers.1.input_layernorm.weight"]},
         r"unexpected keys \['layers.2.input_layernorm.weight'\]"),
    ],
    ids=["midlayer.i", "both-norms", "midlayer-and-layers.0", "layer-1-missing", "layer-2-extra"],
)
def test_two_layer_layouts_that_stay_refused_say_why(tmp_path: Path, edit, message: str) -> None:
    head = random_head(num_layers=2)
    save_bin(head, tmp_path, edit(head.state_dict()))
    with pytest.raises(CheckpointError, match=message):
        Eagle3Head.load(tmp_path, head.embed_tokens, torch.device("cpu"), torch.float32)


def spelled_out_upper_layer(head: Eagle3Head, stream: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Layer 1 as vLLM's LlamaDecoderLayer runs it, spelt out: stream [S, h] (layer 0's output) -> [S, h]."""
    layer, c = head.layers["1"], head.config
    x = layer.input_layernorm(stream)
    cos, sin = head.rope(positions)
    q = apply_rotary(layer.self_attn.q_proj(x).view(-1, c.num_heads, c.head_dim), cos, sin)
    k = apply_rotary(layer.self_attn.k_proj(x).view(-1, c.num_kv_heads, c.head_dim), cos, sin)
    v = layer.self_attn.v_proj(x).view(-1, c.num_kv_heads, c.head_dim)
    attn = torch.stack([reference_attention(q, k, v, t, head.scale) for t in range(stream.shape[0])])
    stream = stream + layer.self_attn.o_proj(attn.flatten(-2))
    return stream + layer.mlp(layer.post_attention_layernorm(stream))


@pytest.mark.parametrize("norm_before_residual", [False, True])
def test_layer_1_reads_the_residual_stream_layer_0_leaves(norm_before_residual: bool) -> None:
    """A two-layer head's output is layer 1 (a Llama layer) over layer 0's output; the norm and lm_head read
    the last layer's output, which is also the hidden fed back."""
    source = random_head(num_layers=2)
    config = Eagle3Config(**{**source.config.__dict__, "norm_before_residual": norm_before_residual})
    deep = Eagle3Head(config, source.embed_tokens)
    deep.load_state_dict(source.state_dict())
    shallow = Eagle3Head(Eagle3Config(**{**config.__dict__, "num_layers": 1}), deep.embed_tokens)
    shallow.load_state_dict({k: v for k, v in deep.state_dict().items() if not k.startswith("layers.")})
    gen = torch.Generator().manual_seed(9)
    tokens = torch.randint(0, VOCAB, (1, 7), generator=gen)
    hidden = deep.fuse(torch.randn(1, 7, 3 * HIDDEN, generator=gen))
    positions = torch.arange(3, 10)[None]
    with torch.no_grad():
        layer_0 = shallow.forward_dense(tokens, hidden, positions)
        want = spelled_out_upper_layer(deep, layer_0[0], positions[0])
        got = deep.forward_dense(tokens, hidden, positions)
    torch.testing.assert_close(got[0], want, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(got, layer_0, atol=1e-2)
    torch.testing.assert_close(deep.draft_logits(got), deep.lm_head(deep.norm(want[None])).float())


# -- positions past the declared maximum -------------------------------------------------------


@pytest.mark.parametrize("rope_scaling", [None, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                 "high_freq_factor": 4.0, "original_max_position_embeddings": 512}])
def test_rope_at_64k_is_transformers_rope_for_a_head_that_declares_2048(rope_scaling) -> None:
    """Published heads declare max_position_embeddings 2048; a table of that size read at 64K is
    the silent-garbage bug vLLM had. RoPE here has no table: cos/sin at any position equal
    transformers' for the same config."""
    from transformers import LlamaConfig as HFLlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    raw = small_config().to_json() | {"max_position_embeddings": 2048, "rope_theta": 500000.0}
    if rope_scaling:
        raw["rope_scaling"] = rope_scaling
    head = Eagle3Head(Eagle3Config.from_json(raw), torch.zeros(VOCAB, HIDDEN))
    hf = LlamaRotaryEmbedding(HFLlamaConfig(**{k: v for k, v in raw.items() if k != "architectures"}))
    positions = torch.tensor([[0, 2047, 2048, 65_535, 65_536, 131_071]])
    cos, sin = hf(torch.zeros(1, 6, 8), positions)
    ours = head.rotary.cos_sin(positions, torch.float32)
    torch.testing.assert_close(ours[0], cos, rtol=0, atol=1e-6)
    torch.testing.assert_close(ours[1], sin, rtol=0, atol=1e-6)


def test_drafting_at_64k_depends_only_on_relative_positions() -> None:
    head = random_head()  # declares max_position_embeddings 512
    gen = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, VOCAB, (1, 9), generator=gen)
    hidden = head.fuse(torch.randn(1, 9, 3 * HIDDEN, generator=gen))
    positions = torch.arange(100, 109).unsqueeze(0)
    with torch.no_grad():
        near = head.forward_dense(tokens, hidden, positions)
        for offset in (65_536, 131_072 - 200):
            torch.testing.assert_close(head.forward_dense(tokens, hidden, positions + offset), near,
                                       rtol=1e-4, atol=1e-3)  # fmt: skip
