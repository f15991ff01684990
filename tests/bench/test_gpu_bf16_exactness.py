"""bf16 on the GPU: speculative decoding against Auto through the engine loop, with what a deployment runs
(bf16 weights and activations, the Triton attention backend, CUDA graphs for verification and drafting).

In bf16 a tree verification and an Auto decode reduce over different GEMM shapes (and graph buckets, and
batches of other sessions), so at a near-tie the target's argmax can differ between them, and either one
can be the side that leaves the fp32 choice. The verdict is the reproduce tool's rule
(bench/reproduce/exactness.py): every generation equals Auto's, or it parts at a named near-tie: Auto's
token and the speculative one both lie less than the spread below the fp32 top-1 at the divergence (with two
candidates, the fp32 top-2 margin), the spread being that of the position's logits over the serving runtime's
paths in bf16 (decode, verify, verify in batches and buckets, deeper in a tree: bench/reproduce/replay.py),
and the same prompts generated in fp32
(the same engine settings, fp32 weights) do not diverge. A mismatch fails; near-ties are named in the log
and counted, not capped: each one is already checked against the fp32 run, and how many prompts meet
one in 128 tokens follows the model's margins, not the decoder. Run on the GPU machine:
``python -m pytest -q -m gpu tests/bench/test_gpu_bf16_exactness.py``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from bench.reproduce.exactness import ExactnessResult
from bench.reproduce.judging import Judge
from bench.reproduce.fp32_rerun import Fp32Rerun
from bench.reproduce.replay import TargetReplay
from diffspec.settings import BUNDLED_DRAFT, BUNDLED_TARGET, SHARED_DIR, DiffSpecSettings
from draft_service.options import DraftOptions
from gateway.assembly import build_engine, load_tokenizer
from gateway.engine import SpeculativeEngine
from gateway.request import GenerationRequest
from tests.conftest import CODE_PROMPTS, short_prompts

pytestmark = pytest.mark.gpu

VARIANTS = [
    DraftOptions("chain", "8:0.0:8"),
    DraftOptions("uniform4", "32:0.0:6"),
    DraftOptions("full", "64:0.08:8"),
    DraftOptions("online", "64:0.0:8"),
    DraftOptions("full", "64:0.08:8", salience=True),
]
SHARED_TARGET = SHARED_DIR / "models" / "bench-code"
SHARED_DRAFT = SHARED_DIR / "models" / "bench-code-eagle3"


def bf16_settings(base_model: Path, draft_model: Path) -> DiffSpecSettings:
    return DiffSpecSettings(
        base_model=base_model, draft_model=draft_model, device="cuda", dtype="bfloat16", attention_backend="triton",
        cuda_graphs=True, num_pages=4096,
    )  # fmt: skip


async def generate(engine: SpeculativeEngine, ids: list[int], options: DraftOptions | None, max_new: int) -> list[int]:
    tokens: list[int] = []
    async for chunk in engine.generate(GenerationRequest(ids, max_new, draft=options)):
        tokens += chunk.token_ids
    return tokens


def verdicts(
    judge: Judge, prompts: list[list[int]], auto: list[list[int]], arm: list[list[int]], options: DraftOptions,
    max_new: int, concurrent: bool = False,
) -> list[ExactnessResult]:  # fmt: skip
    """The reproduce protocol's verdicts; ``concurrent``: the arm ran every prompt at once, and so does its fp32 run."""
    verify_tokens = int(options.tree_config.split(":")[0])  # the tree budget: the largest verify
    return [judge.verdict(prompt, a, b, options, verify_tokens, max_new, prompts if concurrent else None)
            for prompt, a, b in zip(prompts, auto, arm)]


def assert_exact_up_to_near_ties(results: list[ExactnessResult], label: str) -> None:
    mismatches = [r for r in results if r.verdict == "mismatch"]
    near_ties = [r for r in results if r.verdict == "near-tie"]
    assert not mismatches, f"{label}: {[(r.divergence, r.reason, r.evidence) for r in mismatches]}"
    for tie in near_ties:  # named in the log (pytest -rP): where rounding parted the generations, and by how much
        print(f"{label}: near-tie at {tie.divergence}: {tie.reason}; fp32 gaps {tie.evidence and tie.evidence.fp32_gaps}")
    print(f"{label}: {len(near_ties)} near-ties in {len(results)} generations")


def judge_for(settings: DiffSpecSettings) -> Judge:
    return Judge(TargetReplay(settings.base_model, torch.bfloat16, torch.device("cuda"), settings), Fp32Rerun(settings))


@pytest.fixture(scope="module")
def bundled() -> Iterator[tuple[SpeculativeEngine, Judge, list[list[int]]]]:
    settings = bf16_settings(BUNDLED_TARGET, BUNDLED_DRAFT)
    engine = build_engine(settings)
    judge = judge_for(settings)
    tokenizer = load_tokenizer(settings)
    prompts = [tokenizer(text)["input_ids"] for text in CODE_PROMPTS]
    yield engine, judge, prompts
    judge.close()
    engine.close()


@pytest.mark.parametrize("options", VARIANTS, ids=lambda o: f"{o.policy}-{o.tree_config}-salience{int(o.salience)}")
def test_each_policy_in_bf16_equals_auto_up_to_near_ties(bundled, options: DraftOptions):
    engine, judge, prompts = bundled
    auto = [asyncio.run(generate(engine, ids, None, 128)) for ids in prompts]
    arm = [asyncio.run(generate(engine, ids, options, 128)) for ids in prompts]
    assert_exact_up_to_near_ties(verdicts(judge, prompts, auto, arm, options, 128), options.policy)


def test_concurrent_streams_in_bf16_equal_auto_up_to_near_ties(bundled):
    """Eight streams at once: verification batches of several sessions replay the padded batch buckets."""
    engine, judge, _ = bundled
    prompts = [list(range(5 + 40 * i, 300 + 40 * i)) for i in range(8)]
    options = DraftOptions("full", "64:0.08:8")

    async def all_streams() -> list[list[int]]:
        return await asyncio.gather(*(generate(engine, ids, options, 64) for ids in prompts))

    auto = [asyncio.run(generate(engine, ids, None, 64)) for ids in prompts]  # one at a time: batch-1 buckets
    arm = asyncio.run(all_streams())
    assert_exact_up_to_near_ties(verdicts(judge, prompts, auto, arm, options, 64, concurrent=True), "8 streams")


@pytest.mark.parametrize("options", [DraftOptions("online", "64:0.0:8"), DraftOptions("online", "64:0.0:8", salience=True)],
                         ids=["online", "online-salience"])  # fmt: skip
def test_shared_pair_on_eval_prompts_in_bf16_equals_auto_up_to_near_ties(options: DraftOptions):
    """../shared's trained pair (long accepted runs, so deep trees are verified) on ~2K-token eval prompts."""
    texts = short_prompts(4)
    settings = bf16_settings(SHARED_TARGET, SHARED_DRAFT)
    engine = build_engine(settings)
    try:
        tokenizer = load_tokenizer(settings)
        prompts = [tokenizer(text)["input_ids"] for text in texts]
        auto = [asyncio.run(generate(engine, ids, None, 128)) for ids in prompts]
        arm = [asyncio.run(generate(engine, ids, options, 128)) for ids in prompts]
    finally:
        engine.close()
    judge = judge_for(settings)
    try:
        assert_exact_up_to_near_ties(verdicts(judge, prompts, auto, arm, options, 128), "../shared pair")
    finally:
        judge.close()
