"""The engine in process: lossless for every policy, clipping, fallback to Auto, release on every exit."""

from __future__ import annotations

import asyncio
import json
from typing import Callable, Iterator

import pytest
import torch

from diffspec.errors import InvalidRequest, PeerUnavailable
from diffspec.sampling import SamplingParams
from diffspec.settings import BUNDLED_DRAFT, SHARED_DIR, DiffSpecSettings
from draft_service.backend import DraftBatch, DraftBatchResult
from draft_service.eagle3_head import Eagle3Config, Eagle3Head
from draft_service.inprocess import load_draft_runtime
from draft_service.options import DraftOptions
from draft_service.runtime import DraftRuntime
from draft_service.working_set import WorkingSetConfig
from gateway.engine import SpeculativeEngine
from gateway.request import GenerationRequest
from target_service.runtime import TargetRuntime
from tests.conftest import source_prompts
from tests.gateway.conftest import CODE_PROMPTS, assert_all_released, collect, collect_async

VARIANTS = [
    DraftOptions("chain", "24:0.0:5"),
    DraftOptions("uniform4", "24:0.0:5"),
    DraftOptions("full", "24:0.0:5"),
    DraftOptions("online", "24:0.0:5"),
    DraftOptions("full", "24:0.0:5", salience=True),
    DraftOptions("online", "64:0.0:8", salience=True),
]
NEW_TOKENS = 32
LONG_PROMPTS = SHARED_DIR / "data" / "longctx_eval.jsonl"
WORKING_SET = WorkingSetConfig(chunk_size=32, budget_tokens=256, recent_chunks=2)


@pytest.fixture(scope="module")
def target(tiny_target_dir) -> TargetRuntime:
    return TargetRuntime(DiffSpecSettings(base_model=tiny_target_dir, num_pages=2048))


def random_head(target: TargetRuntime) -> Eagle3Head:
    """A random head proposes mostly wrong tokens: the hardest case for losslessness."""
    torch.manual_seed(0)
    config = Eagle3Config.for_target(target.model.config, 4096, target.feature_layers)
    return Eagle3Head(config, target.model.embed_tokens)


@pytest.fixture(scope="module")
def random_head_engine(target, tokenizer) -> Iterator[SpeculativeEngine]:
    engine = SpeculativeEngine(target, DraftRuntime(random_head(target), WORKING_SET), tokenizer)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def auto(random_head_engine) -> Callable[[list[int], int], tuple[list[int], str]]:
    """prompt ids, max_new_tokens -> the greedy Auto output (ids, text), memoised."""
    memo: dict[tuple[tuple[int, ...], int], tuple[list[int], str]] = {}

    def reference(ids: list[int], n: int) -> tuple[list[int], str]:
        if (tuple(ids), n) not in memo:
            memo[(tuple(ids), n)] = collect(random_head_engine, GenerationRequest(ids, n))[:2]
        return memo[(tuple(ids), n)]

    return reference


def prompts(tokenizer) -> list[list[int]]:
    texts = CODE_PROMPTS[:2] + [t[-600:] for t in source_prompts(1)]
    return [tokenizer(t)["input_ids"] for t in texts]


@pytest.mark.parametrize("options", VARIANTS, ids=lambda o: f"{o.policy}-salience-{o.salience}")
def test_speculative_greedy_equals_auto(random_head_engine, auto, tokenizer, options):
    for ids in prompts(tokenizer):
        auto_ids, auto_text = auto(ids, NEW_TOKENS)
        spec_ids, spec_text, stats = collect(random_head_engine, GenerationRequest(ids, NEW_TOKENS, draft=options))
        assert spec_ids == auto_ids and spec_text == auto_text
        assert stats.steps == sum(stats.stop_depth_histogram) and stats.new_tokens == len(spec_ids)
        assert not stats.fell_back_to_auto
        if options.salience:
            assert 0 < stats.working_set_tokens <= 256
        if options.policy == "online":
            assert stats.hazard and all(0 < h < 1 for h in stats.hazard)
    assert_all_released(random_head_engine)


@pytest.fixture(scope="module")
def shipped_head_engine(target, tokenizer) -> Iterator[SpeculativeEngine]:
    """The trained demo head: long accepted paths, the other half of the losslessness story."""
    draft = load_draft_runtime(DiffSpecSettings(draft_model=BUNDLED_DRAFT), target)
    engine = SpeculativeEngine(target, draft, tokenizer)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def int8_head_engine(target, tokenizer) -> Iterator[SpeculativeEngine]:
    """The trained demo head with every per-depth matmul in int8."""
    draft = load_draft_runtime(DiffSpecSettings(draft_model=BUNDLED_DRAFT, draft_quantization="int8"), target)
    assert draft.drafter.weights.lm_head.weight.dtype == torch.int8
    engine = SpeculativeEngine(target, draft, tokenizer)
    yield engine
    engine.close()


@pytest.mark.parametrize("options", [DraftOptions("full"), DraftOptions("online", salience=True)], ids=str)
@pytest.mark.parametrize("engine_name", ["shipped_head_engine", "int8_head_engine"])
def test_trained_head_greedy_equals_auto(request, engine_name, auto, tokenizer, options):
    engine = request.getfixturevalue(engine_name)
    accepted = 0
    for ids in prompts(tokenizer):
        spec_ids, _, stats = collect(engine, GenerationRequest(ids, NEW_TOKENS, draft=options))
        assert spec_ids == auto(ids, NEW_TOKENS)[0]
        accepted += stats.accepted_drafts
    assert accepted > 30, "the trained head should have drafts accepted"
    assert_all_released(engine)


def test_long_prompt_greedy_equals_auto(random_head_engine, auto, tokenizer):
    if not LONG_PROMPTS.exists():
        pytest.skip(f"{LONG_PROMPTS} not present")
    text = json.loads(LONG_PROMPTS.read_text().splitlines()[0])["text"]
    ids = tokenizer(text)["input_ids"][-2000:]
    auto_ids, _ = auto(ids, 12)
    for options in (DraftOptions("full", "32:0.0:6"), DraftOptions("online", "32:0.0:6", salience=True)):
        spec_ids, _, stats = collect(random_head_engine, GenerationRequest(ids, 12, draft=options))
        assert spec_ids == auto_ids
        assert stats.working_set_tokens <= (256 if options.salience else 2012)
        # a 2,000-token context outgrows the 256-token working set: its first set is chosen at the prompt,
        # and a later one at most once a step; over the whole context nothing is chosen
        if options.salience:
            assert 1 <= stats.working_set_updates <= stats.steps + 1
        else:
            assert stats.working_set_updates == 0


def test_sampling_with_a_seed_is_reproducible(random_head_engine, tokenizer):
    ids = tokenizer(CODE_PROMPTS[1])["input_ids"]
    request = GenerationRequest(ids, 40, SamplingParams(temperature=0.8, top_p=0.9, seed=11), (), DraftOptions("full"))
    first = collect(random_head_engine, request)[0]
    assert len(first) == 40 and collect(random_head_engine, request)[0] == first


def test_stop_sequence_and_length_clip_the_output(random_head_engine, auto, tokenizer):
    ids = tokenizer("def fibonacci(n):")["input_ids"]
    full_ids, full_text = auto(ids, NEW_TOKENS)
    stop = full_text[10:14]
    ids_stopped, text_stopped, stats = collect(
        random_head_engine, GenerationRequest(ids, NEW_TOKENS, stop_sequences=(stop,), draft=DraftOptions("chain"))
    )
    assert stats.finish_reason == "stop" and text_stopped == full_text[: full_text.index(stop)]
    assert ids_stopped == full_ids[: len(ids_stopped)]
    short_ids, _, short_stats = collect(random_head_engine, GenerationRequest(ids, 7, draft=DraftOptions("full")))
    assert short_ids == full_ids[:7] and short_stats.finish_reason == "length"


def test_a_stop_token_inside_an_accepted_run_cuts_the_output_there(shipped_head_engine, auto, tokenizer):
    """The trained head gets runs of several tokens accepted per step; a stop token in the middle of one
    ends the output just before it, as Auto's would."""
    ids = tokenizer(CODE_PROMPTS[0])["input_ids"]
    full_ids = auto(ids, NEW_TOKENS)[0]
    _, _, spec_stats = collect(shipped_head_engine, GenerationRequest(ids, NEW_TOKENS, draft=DraftOptions("full")))
    assert spec_stats.mean_accepted_length > 2  # the cut below falls inside accepted runs
    for cut in (5, 11, 20):
        stop = full_ids[cut]
        want = full_ids[: full_ids.index(stop)]
        for draft in (None, DraftOptions("full"), DraftOptions("chain")):
            request = GenerationRequest(ids, NEW_TOKENS, stop_token_ids=frozenset({stop}), draft=draft)
            got, text, stats = collect(shipped_head_engine, request)
            assert got == want and text == tokenizer.decode(want) and stats.finish_reason == "stop", (cut, draft)
            assert stats.new_tokens == len(want)
    assert_all_released(shipped_head_engine)


class FlakyDraft:
    """A draft service that answers ``fail_after`` steps, then is gone (every later step is UNAVAILABLE)."""

    def __init__(self, inner: DraftRuntime, fail_after: int) -> None:
        self.inner, self.calls, self.fail_after = inner, 0, fail_after

    @property
    def sessions(self) -> dict:
        return {} if self.calls > self.fail_after else self.inner.sessions  # a vanished service holds nothing

    def step(self, batch: DraftBatch) -> DraftBatchResult:
        self.calls += 1
        if self.calls > self.fail_after:
            raise PeerUnavailable("draft service went away")
        return self.inner.step(batch)


class SessionFailingDraft:
    """A draft that drops the session of one prompt at its ``fail_at``-th proposal, as a draft
    reports a session it cannot serve (the session is gone from the draft afterwards)."""

    def __init__(self, inner: DraftRuntime, prompt_ids: list[int], fail_at: int) -> None:
        self.inner, self.prompt_ids, self.fail_at = inner, prompt_ids, fail_at
        self.victim: str | None = None
        self.proposals = 0

    @property
    def sessions(self) -> dict:
        return self.inner.sessions

    def step(self, batch: DraftBatch) -> DraftBatchResult:
        for start in batch.starts:
            if start.prompt_ids == self.prompt_ids:
                self.victim = start.session_id
        result = self.inner.step(batch)
        if self.victim not in batch.proposes:
            return result
        self.proposals += 1
        if self.proposals != self.fail_at:
            return result
        self.inner.step(DraftBatch(releases=[self.victim]))
        trees = {sid: tree for sid, tree in result.trees.items() if sid != self.victim}
        failures = {**result.failures, self.victim: InvalidRequest("the draft lost this session")}
        return DraftBatchResult(trees, result.released, failures)


def test_draft_outage_finishes_with_auto(target, auto, tokenizer):
    ids = tokenizer(CODE_PROMPTS[0])["input_ids"]
    flaky = FlakyDraft(DraftRuntime(random_head(target), WORKING_SET), fail_after=3)
    engine = SpeculativeEngine(target, flaky, tokenizer)
    try:
        got, _, stats = collect(engine, GenerationRequest(ids, NEW_TOKENS, draft=DraftOptions("full")))
        assert got == auto(ids, NEW_TOKENS)[0] and stats.fell_back_to_auto
        assert flaky.calls == 4  # start + propose, two accept + propose, then the failure: no more draft calls
        assert_all_released(engine)
    finally:
        engine.close()


def test_one_session_failing_in_the_draft_falls_back_alone(target, auto, tokenizer):
    victim, other = (tokenizer(text)["input_ids"] for text in CODE_PROMPTS[:2])
    draft = SessionFailingDraft(DraftRuntime(random_head(target), WORKING_SET), victim, fail_at=2)
    engine = SpeculativeEngine(target, draft, tokenizer)

    async def both():
        requests = [GenerationRequest(ids, NEW_TOKENS, draft=DraftOptions("full")) for ids in (victim, other)]
        return await asyncio.gather(*(collect_async(engine, r) for r in requests))

    try:
        (victim_ids, _, victim_stats), (other_ids, _, other_stats) = asyncio.run(both())
        assert victim_ids == auto(victim, NEW_TOKENS)[0] and victim_stats.fell_back_to_auto
        assert other_ids == auto(other, NEW_TOKENS)[0] and not other_stats.fell_back_to_auto
        assert draft.proposals == 2
        assert_all_released(engine)
    finally:
        engine.close()


def test_cancelled_generation_frees_every_page(random_head_engine, tokenizer):
    ids = tokenizer(CODE_PROMPTS[1])["input_ids"]

    async def cancel_midway():
        stream = random_head_engine.generate(GenerationRequest(ids, 200, draft=DraftOptions("full")))
        await stream.__anext__()
        await stream.__anext__()
        await stream.aclose()

    asyncio.run(cancel_midway())
    assert_all_released(random_head_engine)


@pytest.mark.parametrize(
    "request_, message",
    [
        (GenerationRequest([], 5), "empty"),
        (GenerationRequest([0, 5], 0), "max_new_tokens"),
        (GenerationRequest([0] * 20000, 5), "does not fit"),
        (GenerationRequest([0, 5], 5, draft=DraftOptions("sideways")), "unknown policy"),
        (GenerationRequest([0, 5], 5, draft=DraftOptions("full", "64:x:8")), "bad tree config"),
        (GenerationRequest([0, 9000], 5), "out of the vocabulary"),
        (GenerationRequest([0, 5], 5, stop_token_ids=frozenset({9000})), "stop token ids out of the vocabulary"),
    ],
)
def test_bad_requests_are_rejected(random_head_engine, request_, message):
    with pytest.raises(InvalidRequest, match=message):
        collect(random_head_engine, request_)
    assert_all_released(random_head_engine)


def test_a_compacted_working_set_drafts_from_settings_and_stays_lossless(target, tokenizer, auto):
    """``salience_compact_positions`` reaches the draft's working set; the trained head drafts over it, re-roped
    each time the set moves, and the output is Auto's."""
    settings = DiffSpecSettings(draft_model=BUNDLED_DRAFT, chunk_size=16, working_set_tokens=128,
                                salience_recent_tokens=32, salience_compact_positions=True)
    draft = load_draft_runtime(settings, target)
    assert draft.working_set.compact_positions
    engine = SpeculativeEngine(target, draft, tokenizer)
    try:
        ids = tokenizer(source_prompts(1)[0])["input_ids"][-900:]
        spec_ids, _, stats = collect(engine, GenerationRequest(ids, NEW_TOKENS, draft=DraftOptions("full", salience=True)))
        assert spec_ids == auto(ids, NEW_TOKENS)[0]
        assert stats.accepted_drafts > 0 and 0 < stats.working_set_tokens <= 128
        assert stats.working_set_updates >= 2  # the prompt's set, then at least one move
        assert_all_released(engine)
    finally:
        engine.close()
