"""bench/reproduce/draft_steps.py: the recorder around the draft drafts as serving does, and records every step."""

from __future__ import annotations

import asyncio

from bench.reproduce.draft_steps import DraftStep, DraftStepRecorder, build_recording_engine, recorder_around
from diffspec.settings import DiffSpecSettings
from draft_service.backend import AcceptsOnDevice, DraftBatch, DraftBatchResult
from draft_service.options import DraftOptions
from gateway.request import GenerationRequest, GenerationStats
from tests.conftest import CODE_PROMPTS


def _recorded_run(accept_on_device: bool) -> tuple[list[DraftStep], GenerationStats, int]:
    """One generation through a recording engine: its recorded steps, its stats, and the proposals taken ahead."""
    engine = build_recording_engine(DiffSpecSettings(num_pages=256, accept_on_device=accept_on_device))
    try:
        assert isinstance(engine.recorder, AcceptsOnDevice)  # the runtime takes them; the engine's setting decides

        async def generate() -> GenerationStats | None:
            request = GenerationRequest(engine.tokenizer(CODE_PROMPTS[0])["input_ids"], 24,
                                        draft=DraftOptions("full", "16:0.0:4"))
            stats = None
            async for chunk in engine.generate(request):
                stats = chunk.stats or stats
            return stats

        stats = asyncio.run(generate())
        assert stats is not None
        return engine.take_draft_steps(), stats, engine.recorder.draft.proposals_ahead
    finally:
        engine.close()


def test_a_recorded_engine_writes_accepts_on_the_device_and_proposes_ahead():
    """In one process the recorder passes the device-side accepts through, so the proposals are queued ahead as in
    serving, and it records the same steps as without them: every step but the last, whose request ends there (its
    session is released, not accepted into)."""
    ahead, stats, taken_ahead = _recorded_run(accept_on_device=True)
    after, _, taken_after = _recorded_run(accept_on_device=False)
    assert taken_ahead > 0 and taken_after == 0
    assert ahead == after and len(ahead) == stats.steps - 1
    assert sum(step.accepted for step in ahead) <= stats.accepted_drafts


class _RemoteDraft:
    """A draft in another process: it takes batches, and writes nothing on the target's device."""

    def step(self, batch: DraftBatch) -> DraftBatchResult:
        return DraftBatchResult()


def test_a_draft_in_another_process_gets_a_recorder_without_the_device_path():
    recorder = recorder_around(_RemoteDraft())
    assert type(recorder) is DraftStepRecorder and not isinstance(recorder, AcceptsOnDevice)
