"""n samples of one prompt (gateway/samples.py): the prompt is computed once and its pages forked, each
sample equals its lone run with its derived seed, Auto and speculative alike, and every page comes back."""

from __future__ import annotations

import asyncio
from typing import Iterator

import pytest
import torch

from diffspec.sampling import SamplingParams
from diffspec.settings import BUNDLED_DRAFT, DiffSpecSettings
from draft_service.eagle3_head import Eagle3Head
from draft_service.options import DraftOptions
from draft_service.runtime import DraftRuntime
from gateway.engine import SpeculativeEngine
from gateway.request import GenerationRequest
from gateway.samples import generate_samples
from target_service.runtime import TargetRuntime
from tests.gateway.conftest import CODE_PROMPTS, assert_all_released, collect

NEW_TOKENS = 10


@pytest.fixture(scope="module")
def target(tiny_target_dir) -> TargetRuntime:
    """This module's own target: its tests count the prompt positions it computes."""
    return TargetRuntime(DiffSpecSettings(base_model=tiny_target_dir, num_pages=512, dtype="float32"))


@pytest.fixture(scope="module")
def engine(target: TargetRuntime, tokenizer) -> Iterator[SpeculativeEngine]:
    head = Eagle3Head.load(BUNDLED_DRAFT, target.model.embed_tokens, torch.device("cpu"), torch.float32)
    loaded = SpeculativeEngine(target, DraftRuntime(head), tokenizer)
    yield loaded
    loaded.close()


class PromptCounter:
    """Counts the prompt positions the target's prefill forwards compute (shared pages cost none)."""

    def __init__(self, target: TargetRuntime) -> None:
        self.target, self.computed = target, 0
        self._prefill = target._prefill  # noqa: SLF001 - the one place prompt positions are computed

    def __enter__(self) -> PromptCounter:
        def counting(work, failures):  # noqa: ANN001, ANN202
            before = {w.session_id: self.target.sessions[w.session_id].prefilled for w in work}
            result = self._prefill(work, failures)
            self.computed += sum(self.target.sessions[sid].prefilled - done for sid, done in before.items())
            return result

        self.target._prefill = counting  # noqa: SLF001
        return self

    def __exit__(self, *_: object) -> None:
        del self.target._prefill  # noqa: SLF001


def run_samples(engine: SpeculativeEngine, request: GenerationRequest) -> dict[int, list[int]]:
    async def go() -> dict[int, list[int]]:
        out: dict[int, list[int]] = {}
        async for chunk in generate_samples(engine, request):
            out.setdefault(chunk.index, []).extend(chunk.token_ids)
        return out

    return asyncio.run(go())


@pytest.mark.parametrize("draft", [None, DraftOptions("full", "16:0.0:4")], ids=["auto", "speculative"])
def test_the_prompt_is_computed_once_and_each_sample_equals_its_lone_run(engine, target, tokenizer, draft):
    # a prompt no other test sends, longer than two pages and not page-aligned: the forks share a partial page
    prompt = tokenizer(f"# {draft}\n" + CODE_PROMPTS[1] * 3)["input_ids"]
    assert len(prompt) > 2 * target.pool.page_size and len(prompt) % target.pool.page_size
    sampled = SamplingParams(temperature=0.9, seed=21)
    with PromptCounter(target) as counter:
        samples = run_samples(engine, GenerationRequest(prompt, NEW_TOKENS, sampled, draft=draft, n=3))
    assert counter.computed == len(prompt) + 2  # sample 0's prompt, then each fork's last position alone
    assert sorted(samples) == [0, 1, 2] and len({tuple(ids) for ids in samples.values()}) > 1
    for index, ids in samples.items():
        alone = collect(engine, GenerationRequest(prompt, NEW_TOKENS, sampled.for_sample(index), draft=draft))[0]
        assert ids == alone, index
    assert_all_released(engine)


def test_greedy_speculative_samples_are_autos_tokens(engine, tokenizer):
    prompt = tokenizer(CODE_PROMPTS[3])["input_ids"]
    auto = collect(engine, GenerationRequest(prompt, NEW_TOKENS))[0]
    samples = run_samples(engine, GenerationRequest(prompt, NEW_TOKENS, draft=DraftOptions("chain", "8:0.0:4"), n=4))
    assert [samples[i] for i in range(4)] == [auto] * 4
    assert_all_released(engine)


def test_samples_of_a_prompt_that_ends_at_once_still_run(engine, tokenizer):
    """Sample 0 ends at its first token and releases its session before the others open: they compute the
    prompt's last page themselves, with sample 0's features for their drafts."""
    prompt = tokenizer(CODE_PROMPTS[0])["input_ids"]
    sampled = SamplingParams(temperature=1.0, seed=4)
    samples = run_samples(engine, GenerationRequest(prompt, 1, sampled, draft=DraftOptions("full"), n=3))
    for index in range(3):
        assert samples[index] == collect(engine, GenerationRequest(prompt, 1, sampled.for_sample(index)))[0]
    assert_all_released(engine)
