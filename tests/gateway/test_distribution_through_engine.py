"""Speculative sampling through the engine keeps the target's distribution (temperature > 0).

``test_sampling_lossless.py`` checks the acceptance rule on one hand-built verification. Here the
whole path runs: the engine loop, the trained draft's trees, ``TargetRuntime``'s batched verify and
its per-session generators. Many seeded requests of three tokens each: the first token is sampled at
prefill, the second and third by the first one or two verifications (an accepted draft, a token
recovered after a rejection, or the bonus token). Their joint frequencies are compared with
p(t1) p(t2 | t1) p(t3 | t1 t2) computed by ``transformers``' own forward (an oracle outside the
project's model code), by a chi-square test over every sequence expected 5+ times and one pooled
bin for the rest.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from dataclasses import replace
from typing import Iterator

import pytest
import torch
from scipy.stats import chisquare
from transformers import AutoModelForCausalLM

from diffspec.sampling import SamplingParams, target_probs
from diffspec.settings import BUNDLED_DRAFT, BUNDLED_TARGET, DiffSpecSettings
from draft_service.inprocess import load_draft_runtime
from draft_service.options import DraftOptions
from gateway.engine import SpeculativeEngine
from gateway.engine_core import EngineLimits
from gateway.request import GenerationRequest, GenerationStats
from target_service.runtime import TargetRuntime
from tests.gateway.conftest import assert_all_released, collect_async

PROMPT = "import os\nimport"  # five tokens: cheap samples, and the three tokens after it vary
SAMPLING = SamplingParams(temperature=0.6)  # top_p = 1: no sort per tree row, every token can be drawn
NEW_TOKENS = 3
SAMPLES = 500
MIN_P_VALUE = 1e-4  # seeded, so a run repeats; a wrong rule scores far below (see the power check)
Sequence = tuple[int, ...]


@pytest.fixture(scope="module")
def engine(tokenizer) -> Iterator[SpeculativeEngine]:
    """The bundled pair, all samples admitted at once (each holds 2-3 pages)."""
    settings = DiffSpecSettings(base_model=BUNDLED_TARGET, draft_model=BUNDLED_DRAFT, num_pages=4 * SAMPLES)
    target = TargetRuntime(settings)
    limits = EngineLimits(max_requests=SAMPLES, max_batch_tokens=16384, prefill_chunk=2048)
    engine = SpeculativeEngine(target, load_draft_runtime(settings, target), tokenizer, limits)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def oracle():  # noqa: ANN201 - (prefixes, sampling) -> next-token distributions
    model = AutoModelForCausalLM.from_pretrained(BUNDLED_TARGET, dtype=torch.float32).eval()

    @torch.no_grad()
    def next_probs(prefixes: list[list[int]], sampling: SamplingParams) -> torch.Tensor:
        """[len(prefixes), vocab]: the distribution sampled from after each prefix (all of one length)."""
        return target_probs(model(torch.tensor(prefixes)).logits[:, -1], sampling)

    return next_probs


def sample_all(engine: SpeculativeEngine, prompt_ids: list[int], options: DraftOptions) -> list[tuple[Sequence, GenerationStats]]:
    """SAMPLES requests with seeds 0, 1, ..., submitted together: the engine batches them."""
    requests = [
        GenerationRequest(prompt_ids, NEW_TOKENS, replace(SAMPLING, seed=seed), draft=options) for seed in range(SAMPLES)
    ]

    async def run() -> list[tuple[list[int], str, GenerationStats | None]]:
        return await asyncio.gather(*(collect_async(engine, request) for request in requests))

    return [(tuple(ids), stats) for ids, _, stats in asyncio.run(run())]


def frequent_sequences(oracle, prompt_ids: list[int], sampling: SamplingParams) -> dict[Sequence, float]:
    """p(t1 t2 t3) of every sequence expected 5+ times in SAMPLES: only prefixes that likely are extended."""
    floor = 5 / SAMPLES
    probs: dict[Sequence, float] = {(): 1.0}
    for _ in range(NEW_TOKENS):
        prefixes = list(probs)
        nexts = oracle([prompt_ids + list(prefix) for prefix in prefixes], sampling)
        probs = {
            (*prefix, token): p
            for prefix, dist in zip(prefixes, nexts)
            for token in (dist * probs[prefix] >= floor).nonzero().flatten().tolist()
            if (p := probs[prefix] * float(dist[token])) >= floor
        }
    return probs


def chi_square_p_value(counts: Counter[Sequence], frequent: dict[Sequence, float]) -> float:
    """Each frequent sequence its own bin, every other sequence in one pooled bin."""
    observed = [counts[s] for s in frequent]
    expected = [p * SAMPLES for p in frequent.values()]
    observed.append(SAMPLES - sum(observed))
    expected.append(SAMPLES - sum(expected))
    return float(chisquare(observed, expected).pvalue)


@pytest.mark.slow
@pytest.mark.parametrize(
    "options",
    [DraftOptions("chain", "2:0.0:1"), DraftOptions("full", "8:0.0:2")],
    ids=["chain-depth-1", "full-depth-2"],  # the third token a bonus token after one draft; several drafts per level
)
def test_three_sampled_tokens_follow_the_target(engine, oracle, tokenizer, options):
    prompt_ids = tokenizer(PROMPT)["input_ids"]
    results = sample_all(engine, prompt_ids, options)
    assert_all_released(engine)
    assert all(len(ids) == NEW_TOKENS and stats.finish_reason == "length" for ids, stats in results)
    accepted = Counter(stats.accepted_drafts for _, stats in results)
    with_a_rejection = sum(n for drafts, n in accepted.items() if drafts < NEW_TOKENS - 1)
    assert min(with_a_rejection, SAMPLES - accepted[0]) >= SAMPLES // 10, (
        f"both outcomes of the acceptance rule must be common, drafts rejected and accepted: {accepted}"
    )
    counts = Counter(ids for ids, _ in results)
    frequent = frequent_sequences(oracle, prompt_ids, SAMPLING)
    assert len(frequent) >= 10 and sum(frequent.values()) > 0.5  # enough bins, most of the mass
    assert chi_square_p_value(counts, frequent) > MIN_P_VALUE
    # power: the same samples against a temperature that is off by a quarter are rejected
    hotter = frequent_sequences(oracle, prompt_ids, replace(SAMPLING, temperature=1.0))
    assert chi_square_p_value(counts, hotter) < MIN_P_VALUE
