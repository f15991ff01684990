"""The engine checks every request once, whichever front end built it (gRPC, HTTP, the CLI): what the
target could not serve is refused before any service sees it."""

from __future__ import annotations

from typing import Iterator

import pytest

from diffspec.errors import InvalidRequest
from draft_service.backend import DraftBatch, DraftBatchResult
from draft_service.options import DraftOptions
from gateway.engine import SpeculativeEngine
from gateway.request import GenerationRequest
from target_service.backend import TargetBatch, TargetBatchResult, TargetInfo

# vocabulary 100, context 64 tokens
INFO = TargetInfo("m", 100, 8, 2, (0, 1, 1), (1,), 64, 16, 8, 8, 0, "cpu", "float32")


class InfoOnlyTarget:
    """A target that only describes itself: a checked request never reaches a step."""

    def info(self) -> TargetInfo:
        return INFO

    def step(self, batch: TargetBatch) -> TargetBatchResult:
        raise AssertionError(f"a step reached the target: {batch}")


class UnusedDraft:
    def step(self, batch: DraftBatch) -> DraftBatchResult:
        raise AssertionError(f"a step reached the draft: {batch}")


@pytest.fixture(scope="module", params=["with draft", "auto only"])
def engine(request) -> Iterator[SpeculativeEngine]:
    draft = UnusedDraft() if request.param == "with draft" else None
    engine = SpeculativeEngine(InfoOnlyTarget(), draft, tokenizer=None)  # type: ignore[arg-type]
    yield engine
    engine.close()


@pytest.mark.parametrize(
    "request_, message",
    [
        (GenerationRequest([], 5), "the prompt is empty"),
        (GenerationRequest([0] * 64, 5), "prompt of 64 tokens does not fit the context of 64 tokens"),
        (GenerationRequest([0, 100], 5), "token ids out of the vocabulary \\[0, 100\\): \\[100\\]"),
        (GenerationRequest([0, -1, 7], 5), "out of the vocabulary \\[0, 100\\): \\[-1\\]"),
        (GenerationRequest([0], 0), "max_new_tokens must be in \\[1, 64\\]"),
        (GenerationRequest([0], 65), "max_new_tokens must be in \\[1, 64\\]"),
        (GenerationRequest([0], 5, draft=DraftOptions("sideways")), "policy"),
        (GenerationRequest([0], 5, draft=DraftOptions("uniform")), "policy"),
        (GenerationRequest([0], 5, draft=DraftOptions("full", "64:x:8")), "tree config"),
    ],
)
def test_requests_the_target_could_not_serve_are_refused(engine, request_, message):
    with pytest.raises(InvalidRequest, match=message):
        engine.check(request_)


def test_requests_that_fit_pass(engine):
    engine.check(GenerationRequest([0] * 63, 1))
    engine.check(GenerationRequest([0, 99], 64))
    if engine.draft is None:
        with pytest.raises(InvalidRequest, match="needs a draft model"):
            engine.check(GenerationRequest([0], 5, draft=DraftOptions()))
    else:
        engine.check(GenerationRequest([0], 5, draft=DraftOptions()))
