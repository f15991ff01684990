"""A head of two decoder layers serves speculative decoding end to end on the tiny pair: greedy output equals
Auto's for every policy, with and without salience, loaded from its directory like any head."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Iterator

import pytest
import torch
from transformers import AutoTokenizer

import draft_service.drafter

from diffspec.settings import BUNDLED_DRAFT, DiffSpecSettings
from draft_service.eagle3_head import Eagle3Config, Eagle3Head
from draft_service.inprocess import load_draft_runtime
from draft_service.options import DraftOptions
from gateway.engine import SpeculativeEngine
from gateway.request import GenerationRequest
from target_service.runtime import TargetRuntime
from tests.conftest import CODE_PROMPTS, source_prompts
from tests.gateway.conftest import assert_all_released, collect

NEW_TOKENS = 32
VARIANTS = [
    DraftOptions("chain", "24:0.0:5"),
    DraftOptions("full", "24:0.0:5"),
    DraftOptions("online", "24:0.0:5"),
    DraftOptions("online", "64:0.0:8", salience=True),
]


@pytest.fixture(scope="module")
def target(tiny_target_dir) -> TargetRuntime:
    return TargetRuntime(DiffSpecSettings(base_model=tiny_target_dir, num_pages=2048))


@pytest.fixture(scope="module")
def tokenizer(tiny_target_dir):  # noqa: ANN201 - a transformers tokenizer
    return AutoTokenizer.from_pretrained(tiny_target_dir)


def shipped_under_a_second_layer(target: TargetRuntime) -> Eagle3Head:
    """The shipped head's layer 0 under a seeded random layer 1 whose additions are scaled down: it drafts close
    to the shipped head, so runs get accepted, and every draft goes through both layers."""
    shipped = Eagle3Head.load(BUNDLED_DRAFT, target.model.embed_tokens, torch.device("cpu"), torch.float32)
    torch.manual_seed(0)
    head = Eagle3Head(replace(shipped.config, num_layers=2), target.model.embed_tokens)
    head.load_state_dict(shipped.state_dict(), strict=False)
    with torch.no_grad():
        head.layers["1"].self_attn.o_proj.weight.mul_(0.1)
        head.layers["1"].mlp.down_proj.weight.mul_(0.1)
    return head


def random_two_layer_head(target: TargetRuntime) -> Eagle3Head:
    """Mostly wrong drafts: the hardest case for losslessness."""
    torch.manual_seed(1)
    config = Eagle3Config.for_target(target.model.config, 4096, target.feature_layers)
    return Eagle3Head(replace(config, num_layers=2), target.model.embed_tokens)


@dataclass
class Served:
    engine: SpeculativeEngine
    min_accepted: int  # drafts the head must get accepted over the test's generations


HEADS = {"near-shipped": (shipped_under_a_second_layer, 100), "random": (random_two_layer_head, 0)}


@pytest.fixture(scope="module", params=list(HEADS))
def served(request, target, tokenizer, tmp_path_factory) -> Iterator[Served]:
    """The engine over the head saved and loaded as a configured draft model; prompts are ingested in chunks of
    64 entries."""
    build, min_accepted = HEADS[request.param]
    head_dir = Path(tmp_path_factory.mktemp("two-layer-head"))
    build(target).save(head_dir)
    settings = DiffSpecSettings(draft_model=head_dir, chunk_size=32, working_set_tokens=256, salience_recent_tokens=64)
    draft = load_draft_runtime(settings, target)
    assert draft.head.config.num_layers == 2
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(draft_service.drafter, "EXTEND_CHUNK", 64)
        engine = SpeculativeEngine(target, draft, tokenizer)
        yield Served(engine, min_accepted)
        engine.close()


@pytest.fixture(scope="module")
def auto(target, tokenizer) -> Iterator[Callable[[list[int]], list[int]]]:
    """prompt ids -> the greedy Auto output, memoised."""
    engine = SpeculativeEngine(target, None, tokenizer)
    memo: dict[tuple[int, ...], list[int]] = {}

    def reference(ids: list[int]) -> list[int]:
        if tuple(ids) not in memo:
            memo[tuple(ids)] = collect(engine, GenerationRequest(ids, NEW_TOKENS))[0]
        return memo[tuple(ids)]

    yield reference
    engine.close()


def test_two_layer_head_greedy_equals_auto(served, auto, tokenizer):
    texts = CODE_PROMPTS[:2] + [t[-600:] for t in source_prompts(1)]
    accepted = 0
    for options in VARIANTS:
        for ids in (tokenizer(t)["input_ids"] for t in texts):
            spec_ids, _, stats = collect(served.engine, GenerationRequest(ids, NEW_TOKENS, draft=options))
            assert spec_ids == auto(ids), options
            assert not stats.fell_back_to_auto and stats.steps == sum(stats.stop_depth_histogram)
            if options.salience:
                assert 0 < stats.working_set_tokens <= 256
            accepted += stats.accepted_drafts
    assert accepted >= served.min_accepted
    assert_all_released(served.engine)
