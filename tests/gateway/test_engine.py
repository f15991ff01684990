"""The request loop: lossless for every policy, clipping, fallback to Auto, release on every exit."""

from __future__ import annotations

import asyncio
import json

import pytest
import torch

from diffspec.errors import InvalidRequest, PeerUnavailable
from diffspec.sampling import SamplingParams
from diffspec.settings import DiffSpecSettings
from draft_service.backend import DraftOptions
from draft_service.eagle3_head import Eagle3Config, Eagle3Head
from draft_service.inprocess import InProcessDraft
from draft_service.runtime import DraftRuntime
from gateway.engine import SpeculativeEngine
from gateway.request import GenerationRequest, GenerationStats
from target_service.inprocess import InProcessTarget
from target_service.runtime import TargetRuntime
from diffspec.settings import BUNDLED_DRAFT, SHARED_DIR
from draft_service.working_set import WorkingSetConfig
from tests.conftest import short_prompts

CODE_PROMPTS = [
    "import os\nimport sys\n\n\ndef main(argv):",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):",
    "def fibonacci(n):",
]
VARIANTS = [
    DraftOptions("chain", "24:0.0:5"),
    DraftOptions("uniform4", "24:0.0:5"),
    DraftOptions("full", "24:0.0:5"),
    DraftOptions("online", "24:0.0:5"),
    DraftOptions("full", "24:0.0:5", salience=True),
    DraftOptions("online", "64:0.0:8", salience=True),
]
LONG_PROMPTS = SHARED_DIR / "data" / "longctx_eval.jsonl"


@pytest.fixture(scope="module")
def target(tiny_target_dir) -> InProcessTarget:
    return InProcessTarget(TargetRuntime(DiffSpecSettings(base_model=tiny_target_dir, num_pages=2048)))


@pytest.fixture(scope="module")
def random_head_engine(target, tokenizer) -> SpeculativeEngine:
    """A random head proposes mostly wrong tokens: the hardest case for losslessness."""
    rt = target.runtime
    torch.manual_seed(0)
    head = Eagle3Head(Eagle3Config.for_target(rt.model.config, 4096, rt.feature_layers), rt.model.embed_tokens)
    working_set = WorkingSetConfig(chunk_size=32, budget_tokens=256, recent_chunks=2)
    return SpeculativeEngine(target, InProcessDraft(DraftRuntime(head, working_set)), tokenizer)


def collect(engine: SpeculativeEngine, request: GenerationRequest) -> tuple[list[int], str, GenerationStats]:
    async def run():
        ids, text, stats = [], "", None
        async for chunk in engine.generate(request):
            ids += chunk.token_ids
            text += chunk.text
            stats = chunk.stats or stats
        return ids, text, stats

    return asyncio.run(run())


def prompts(tokenizer) -> list[list[int]]:
    texts = CODE_PROMPTS + [t[-1500:] for t in short_prompts(2)]
    return [tokenizer(t)["input_ids"] for t in texts]


@pytest.mark.parametrize("options", VARIANTS, ids=lambda o: f"{o.policy}-salience-{o.salience}")
def test_speculative_greedy_equals_auto(random_head_engine, tokenizer, options):
    for ids in prompts(tokenizer):
        auto_ids, auto_text, _ = collect(random_head_engine, GenerationRequest(ids, 128))
        spec_ids, spec_text, stats = collect(random_head_engine, GenerationRequest(ids, 128, draft=options))
        assert spec_ids == auto_ids and spec_text == auto_text
        assert stats.steps == sum(stats.stop_depth_histogram) and stats.new_tokens == len(spec_ids)
        if options.salience:
            assert 0 < stats.working_set_tokens <= 256
        if options.policy == "online":
            assert stats.hazard and all(0 < h < 1 for h in stats.hazard)
    assert asyncio.run(random_head_engine.target.info()).active_sessions == 0


@pytest.fixture(scope="module")
def shipped_head_engine(target, tokenizer) -> SpeculativeEngine:
    """The trained demo head: long accepted paths, the other half of the losslessness story."""
    settings = DiffSpecSettings(draft_model=BUNDLED_DRAFT)
    return SpeculativeEngine(target, InProcessDraft.from_settings(settings, target), tokenizer)


@pytest.mark.parametrize("options", [DraftOptions("full"), DraftOptions("online", salience=True)], ids=str)
def test_trained_head_greedy_equals_auto(shipped_head_engine, tokenizer, options):
    accepted = 0
    for ids in prompts(tokenizer):
        auto_ids, _, _ = collect(shipped_head_engine, GenerationRequest(ids, 128))
        spec_ids, _, stats = collect(shipped_head_engine, GenerationRequest(ids, 128, draft=options))
        assert spec_ids == auto_ids
        accepted += stats.accepted_drafts
    assert accepted > 100, "the trained head should have drafts accepted"


def test_long_prompt_greedy_equals_auto(random_head_engine, tokenizer):
    if not LONG_PROMPTS.exists():
        pytest.skip(f"{LONG_PROMPTS} not present")
    text = json.loads(LONG_PROMPTS.read_text().splitlines()[0])["text"]
    ids = tokenizer(text)["input_ids"][-8000:]
    auto_ids, _, _ = collect(random_head_engine, GenerationRequest(ids, 48))
    for options in (DraftOptions("full", "32:0.0:6"), DraftOptions("online", "32:0.0:6", salience=True)):
        spec_ids, _, stats = collect(random_head_engine, GenerationRequest(ids, 48, draft=options))
        assert spec_ids == auto_ids
        assert stats.working_set_tokens <= (256 if options.salience else 8100)


def test_sampling_with_a_seed_is_reproducible(random_head_engine, tokenizer):
    ids = tokenizer(CODE_PROMPTS[1])["input_ids"]
    request = GenerationRequest(ids, 40, SamplingParams(temperature=0.8, top_p=0.9, seed=11), (), DraftOptions("full"))
    assert collect(random_head_engine, request)[0] == collect(random_head_engine, request)[0]


def test_stop_sequence_and_length_clip_the_output(random_head_engine, tokenizer):
    ids = tokenizer("def fibonacci(n):")["input_ids"]
    full_ids, full_text, _ = collect(random_head_engine, GenerationRequest(ids, 60))
    stop = full_text[10:14]
    ids_stopped, text_stopped, stats = collect(
        random_head_engine, GenerationRequest(ids, 60, stop_sequences=(stop,), draft=DraftOptions("chain"))
    )
    assert stats.finish_reason == "stop" and text_stopped == full_text[: full_text.index(stop)]
    assert ids_stopped == full_ids[: len(ids_stopped)]
    short_ids, _, short_stats = collect(random_head_engine, GenerationRequest(ids, 7, draft=DraftOptions("full")))
    assert short_ids == full_ids[:7] and short_stats.finish_reason == "length"


class FlakyDraft:
    """Forwards to a real draft, then fails like a vanished service after some proposals."""

    def __init__(self, inner: InProcessDraft, fail_after: int) -> None:
        self.inner, self.calls, self.fail_after = inner, 0, fail_after

    def __getattr__(self, name):
        return getattr(self.inner, name)

    async def propose(self, session_id):
        self.calls += 1
        if self.calls > self.fail_after:
            raise PeerUnavailable("draft service went away")
        return await self.inner.propose(session_id)


def test_draft_failure_finishes_with_auto(random_head_engine, target, tokenizer):
    ids = tokenizer(CODE_PROMPTS[0])["input_ids"]
    expected, _, _ = collect(random_head_engine, GenerationRequest(ids, 50))
    flaky = SpeculativeEngine(target, FlakyDraft(random_head_engine.draft, 3), tokenizer)
    got, _, stats = collect(flaky, GenerationRequest(ids, 50, draft=DraftOptions("full")))
    assert got == expected and stats.fell_back_to_auto
    assert asyncio.run(target.info()).num_free_pages == target.runtime.pool.num_pages


def test_cancelled_generation_frees_every_page(random_head_engine, target, tokenizer):
    ids = tokenizer(CODE_PROMPTS[1])["input_ids"]

    async def cancel_midway():
        stream = random_head_engine.generate(GenerationRequest(ids, 200, draft=DraftOptions("full")))
        await stream.__anext__()
        await stream.__anext__()
        await stream.aclose()

    asyncio.run(cancel_midway())
    info = asyncio.run(target.info())
    assert info.num_free_pages == info.num_pages and info.active_sessions == 0
    assert not random_head_engine.draft.runtime.sessions


@pytest.mark.parametrize(
    "request_, message",
    [
        (GenerationRequest([], 5), "empty"),
        (GenerationRequest([0, 5], 0), "max_new_tokens"),
        (GenerationRequest([0] * 20000, 5), "does not fit"),
        (GenerationRequest([0, 5], 5, draft=DraftOptions("sideways")), "unknown policy"),
        (GenerationRequest([0, 5], 5, draft=DraftOptions("full", "64:x:8")), "bad tree config"),
    ],
)
def test_bad_requests_are_rejected(random_head_engine, target, request_, message):
    with pytest.raises(InvalidRequest, match=message):
        collect(random_head_engine, request_)
    assert asyncio.run(target.info()).num_free_pages == target.runtime.pool.num_pages
