"""n samples of one prompt (gateway/samples.py): the prompt is computed once and its pages forked, each
sample equals its lone run with its derived seed, Auto and speculative alike, and every page comes back."""

from __future__ import annotations

import asyncio

import pytest

from diffspec.sampling import SamplingParams
from draft_service.options import DraftOptions
from gateway.engine import SpeculativeEngine
from gateway.engine_core import EngineLimits
from gateway.request import GenerationRequest
from gateway.samples import generate_samples
from target_service.runtime import TargetRuntime
from tests.gateway.conftest import CODE_PROMPTS, assert_all_released, collect, collect_async
from tests.gateway.recording import recording_engine

NEW_TOKENS = 10


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
def test_the_prompt_is_computed_once_and_each_sample_equals_its_lone_run(fp32_engine, fp32_target, tokenizer, draft):
    # a prompt no other test sends, longer than two pages and not page-aligned: the forks share a partial page
    prompt = tokenizer(f"# {draft}\n" + CODE_PROMPTS[1] * 3)["input_ids"]
    assert len(prompt) > 2 * fp32_target.pool.page_size and len(prompt) % fp32_target.pool.page_size
    sampled = SamplingParams(temperature=0.9, seed=21)
    with PromptCounter(fp32_target) as counter:
        samples = run_samples(fp32_engine, GenerationRequest(prompt, NEW_TOKENS, sampled, draft=draft, n=3))
    assert counter.computed == len(prompt) + 2  # sample 0's prompt, then each fork's last position alone
    assert sorted(samples) == [0, 1, 2] and len({tuple(ids) for ids in samples.values()}) > 1
    for index, ids in samples.items():
        alone = collect(fp32_engine, GenerationRequest(prompt, NEW_TOKENS, sampled.for_sample(index), draft=draft))[0]
        assert ids == alone, index
    assert_all_released(fp32_engine)


def test_greedy_speculative_samples_are_autos_tokens(fp32_engine, tokenizer):
    prompt = tokenizer(CODE_PROMPTS[3])["input_ids"]
    auto = collect(fp32_engine, GenerationRequest(prompt, NEW_TOKENS))[0]
    chain = DraftOptions("chain", "8:0.0:4")
    samples = run_samples(fp32_engine, GenerationRequest(prompt, NEW_TOKENS, draft=chain, n=4))
    assert [samples[i] for i in range(4)] == [auto] * 4
    assert_all_released(fp32_engine)


def test_samples_of_a_prompt_that_ends_at_once_still_run(fp32_engine, tokenizer):
    """Sample 0 ends at its first token and releases its session before the others open: they compute the
    prompt's last page themselves, with sample 0's features for their drafts."""
    prompt = tokenizer(CODE_PROMPTS[0])["input_ids"]
    sampled = SamplingParams(temperature=1.0, seed=4)
    samples = run_samples(fp32_engine, GenerationRequest(prompt, 1, sampled, draft=DraftOptions("full"), n=3))
    for index in range(3):
        assert samples[index] == collect(fp32_engine, GenerationRequest(prompt, 1, sampled.for_sample(index)))[0]
    assert_all_released(fp32_engine)


@pytest.mark.parametrize("draft", [None, DraftOptions("full", "16:0.0:4")], ids=["auto", "speculative"])
def test_a_fork_is_charged_only_the_position_it_computes(fp32_target, fp32_draft, tokenizer, draft):
    """Each fork computes its prompt's last position alone, and that is all it takes from the iteration's
    token budget (``max_batch_tokens``): both forks of an n = 3 request open in one iteration, beside a
    whole prompt chunk of another request. Charged the whole prompt, as before, the first fork took a whole
    chunk of the budget, and the budget ran out before the second fork or the other prompt's chunk."""
    prompt = tokenizer(f"# forks {draft}\n" + CODE_PROMPTS[1] * 2)["input_ids"]
    other = tokenizer(f"# beside {draft}\n" + CODE_PROMPTS[3] * 30)["input_ids"]  # prefills for 15 steps
    chunk = 32
    assert len(prompt) > chunk and len(other) > 12 * chunk
    # the budget is MIN_PREFILL_TOKENS (64) whatever the trees take: two chunks an iteration
    limits = EngineLimits(8, max_batch_tokens=64, prefill_chunk=chunk)
    engine = recording_engine(fp32_target, fp32_draft, tokenizer, limits)
    recording = engine.target
    sampled = SamplingParams(temperature=0.9, seed=8)

    async def run() -> None:
        recording.gate.clear()
        samples = GenerationRequest(prompt, NEW_TOKENS, sampled, draft=draft, n=3)
        sampling = asyncio.ensure_future(_drain(generate_samples(engine, samples)))
        beside = asyncio.ensure_future(collect_async(engine, GenerationRequest(other, NEW_TOKENS)))
        while engine.core.num_requests < 4:
            await asyncio.sleep(0.001)  # each sample is submitted on its task's first run
        recording.gate.set()
        await asyncio.gather(sampling, beside)

    try:
        asyncio.run(run())
        batches = [batch for _, batch in recording.batches]
        forking = [b for b in batches if any(o.fork_of for o in b.opens)]
        assert len(forking) == 1  # both forks opened in one iteration
        forks = [o.session_id for o in forking[0].opens if o.fork_of]
        other_session = next(o.session_id for b in batches for o in b.opens if o.prompt_ids == other)
        charged = {w.session_id: w.num_tokens for w in forking[0].prefills}
        assert [charged[f] for f in forks] == [1, 1]
        assert charged[other_session] == chunk  # the other prompt's chunk in the same iteration
        assert_all_released(engine)
    finally:
        engine.close()


async def _drain(chunks) -> None:  # noqa: ANN001 - an async iterator of chunks
    async for _ in chunks:
        pass
