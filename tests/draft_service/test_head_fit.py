"""Which head drafts for which target, on a tiny target written in Llama-3.1's layout (llama3 RoPE,
untied embeddings, sharded safetensors, EOS list) and heads written in the published layout."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

from diffspec.errors import CheckpointError
from diffspec.model_config import load_llama_config
from diffspec.settings import BUNDLED_DRAFT, DiffSpecSettings
from draft_service.eagle3_config import Eagle3Config
from draft_service.eagle3_head import Eagle3Head
from draft_service.head_fit import check_head_fits_target, draft_model_for, feature_layers_for, read_head_config
from draft_service.target_embedding import load_target_embedding
from draft_service.vocab_map import build_vocab_map
from target_service.llama import LlamaModel
from tests.conftest import write_random_llama

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def llama31_dir(tmp_path_factory) -> Path:
    return write_random_llama(tmp_path_factory.mktemp("llama31"), llama3_rope=True, tie_embeddings=False,
                              max_shard_size="60KB")  # fmt: skip


def published_head(target_dir: Path, head_dir: Path, aux_layers: list[int], nested: bool) -> Path:
    """A random head for the target in the published layout: pytorch_model.bin, a draft vocab
    smaller than the vocab, aux layer ids other than the default, max_position_embeddings 2048."""
    target = load_llama_config(target_dir)
    config = Eagle3Config.for_target(target, draft_vocab_size=200, feature_layers=())
    torch.manual_seed(0)
    head = Eagle3Head(config, load_target_embedding(target_dir, CPU, torch.float32))
    head.set_vocab_map(*build_vocab_map(torch.arange(target.vocab_size), 200))
    raw = config.to_json() | {"max_position_embeddings": 2048}
    raw.pop("rope_scaling", None)  # published heads declare neither rope_theta nor scaling
    raw.pop("rope_theta", None)
    if nested:
        raw["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": aux_layers}
    else:
        raw["eagle_aux_hidden_state_layer_ids"] = aux_layers
    head_dir.mkdir(parents=True, exist_ok=True)
    (head_dir / "config.json").write_text(json.dumps(raw))
    torch.save(head.state_dict(), head_dir / "pytorch_model.bin")
    return head_dir


def test_a_users_target_without_a_draft_serves_auto(llama31_dir, caplog):
    with caplog.at_level(logging.WARNING, logger="draft_service.head_fit"):
        assert draft_model_for(DiffSpecSettings(base_model=llama31_dir)) is None
    assert len(caplog.records) == 1 and "serving Auto" in caplog.records[0].getMessage()
    assert draft_model_for(DiffSpecSettings()) == BUNDLED_DRAFT  # the demo pair speculates
    explicit = DiffSpecSettings(base_model=llama31_dir, draft_model=BUNDLED_DRAFT)
    assert draft_model_for(explicit) == BUNDLED_DRAFT  # asked for: checked, then refused below


def test_the_bundled_head_does_not_fit_a_users_target(llama31_dir):
    head, target = read_head_config(BUNDLED_DRAFT), load_llama_config(llama31_dir)
    with pytest.raises(CheckpointError) as refused:
        check_head_fits_target(head, target, BUNDLED_DRAFT, llama31_dir)
    message = str(refused.value)
    assert f"draft head {BUNDLED_DRAFT} does not fit target {llama31_dir}" in message
    assert "vocabulary has 8192 tokens, the target's 320" in message
    assert "reads features 256 wide, the target's are 64" in message
    assert "trained on target layers [1, 2, 3]" not in message  # layers 1..3 exist in a 4-layer target


@pytest.mark.parametrize("nested", [False, True], ids=["top-level", "eagle_config"])
def test_a_published_head_for_the_target_loads_and_drafts(llama31_dir, tmp_path, nested):
    head_dir = published_head(llama31_dir, tmp_path / "head", [0, 2, 3], nested)
    head_config, target_config = read_head_config(head_dir), load_llama_config(llama31_dir)
    check_head_fits_target(head_config, target_config, head_dir, llama31_dir)
    assert head_config.max_positions == 2048 and head_config.rope.theta == 10000.0
    layers = feature_layers_for(DiffSpecSettings(base_model=llama31_dir), target_config, head_config)
    assert layers == (0, 2, 3) != feature_layers_for(DiffSpecSettings(), target_config, None)  # default (1, 2, 3)

    target = LlamaModel.from_pretrained(llama31_dir, CPU, torch.float32)
    head = Eagle3Head.load(head_dir, load_target_embedding(llama31_dir, CPU, torch.float32), CPU, torch.float32)
    ids = torch.randint(3, 320, (1, 12), generator=torch.Generator().manual_seed(1))
    _, features = target.forward_dense(ids, layers)
    assert features is not None and features.shape == (1, 12, 3 * 64)
    with torch.no_grad():
        output = head.forward_dense(ids[:, 1:], head.fuse(features[:, :-1]), torch.arange(11).unsqueeze(0))
        drafted = head.to_target_ids(head.draft_logits(output).argmax(-1))
    assert bool(head.t2d[drafted].all())  # every drafted id is in the draft vocab


def test_feature_layers_that_contradict_the_head_are_refused(llama31_dir, tmp_path):
    head_config = read_head_config(published_head(llama31_dir, tmp_path / "head", [0, 2, 3], nested=False))
    target_config = load_llama_config(llama31_dir)
    agreeing = DiffSpecSettings(base_model=llama31_dir, feature_layers="0,2,3")
    assert feature_layers_for(agreeing, target_config, head_config) == (0, 2, 3)
    with pytest.raises(CheckpointError, match="DIFFSPEC_FEATURE_LAYERS=1,2,3 contradicts the draft head"):
        feature_layers_for(DiffSpecSettings(feature_layers="1,2,3"), target_config, head_config)


def test_layers_outside_the_target_are_named(llama31_dir, tmp_path):
    head_dir = published_head(llama31_dir, tmp_path / "head", [2, 16, 29], nested=True)
    with pytest.raises(CheckpointError, match=r"trained on target layers \[2, 16, 29\], the target has layers 0..3"):
        check_head_fits_target(read_head_config(head_dir), load_llama_config(llama31_dir), head_dir, llama31_dir)


def test_loading_checks_the_fit_before_any_weight(llama31_dir):
    """The issue's reproduction: DIFFSPEC_BASE_MODEL alone, the demo head left as the draft."""
    from diffspec.settings import BUNDLED_TARGET
    from draft_service.inprocess import load_draft_runtime

    check_head_fits_target(read_head_config(BUNDLED_DRAFT), load_llama_config(BUNDLED_TARGET), BUNDLED_DRAFT,
                           BUNDLED_TARGET)  # fmt: skip
    with pytest.raises(CheckpointError, match=r"does not fit target .*: its vocabulary has 8192 tokens"):
        load_draft_runtime(DiffSpecSettings(base_model=llama31_dir, device="cpu"))
