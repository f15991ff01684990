"""The requests' chunks are held until the next verify waits for its results, then handed to their streams."""

from __future__ import annotations

import dataclasses
import threading

import pytest

from diffspec.settings import BUNDLED_DRAFT, DiffSpecSettings
from draft_service.inprocess import load_draft_runtime
from draft_service.options import DraftOptions
from gateway.engine_core import EngineCore, EngineLimits
from gateway.outbox import Outbox
from gateway.request import GenerationChunk, GenerationRequest
from target_service.backend import TargetBatch, TargetBatchResult, TargetInfo
from target_service.runtime import TargetRuntime

LIMITS = EngineLimits(max_requests=8, max_batch_tokens=4096, prefill_chunk=2048)


class RecordingSink:
    def __init__(self, events: list[str], name: str) -> None:
        self.events, self.name = events, name
        self.tokens: list[int] = []
        self.done = threading.Event()

    def put(self, chunk: GenerationChunk) -> None:
        self.events.append(f"{self.name} chunk")
        self.tokens += chunk.token_ids
        if chunk.stats is not None:
            self.done.set()

    def fail(self, error: BaseException) -> None:
        self.events.append(f"{self.name} failed: {error}")
        self.done.set()


def test_held_chunks_and_failures_reach_their_sinks_in_order_once():
    events: list[str] = []
    outbox = Outbox()
    a, b = outbox.holding(RecordingSink(events, "a")), outbox.holding(RecordingSink(events, "b"))
    a.put(GenerationChunk([1], "x"))
    b.fail(RuntimeError("gone"))
    a.put(GenerationChunk([2], "y"))
    assert events == []
    outbox.flush()
    assert events == ["a chunk", "b failed: gone", "a chunk"]
    outbox.flush()
    assert len(events) == 3


def test_a_sink_that_fails_leaves_the_others_their_chunks():
    events: list[str] = []
    outbox = Outbox()

    class ClosedLoop:
        def put(self, chunk: GenerationChunk) -> None:
            raise RuntimeError("Event loop is closed")

        def fail(self, error: BaseException) -> None:
            raise RuntimeError("Event loop is closed")

    gone, alive = outbox.holding(ClosedLoop()), outbox.holding(RecordingSink(events, "a"))
    gone.put(GenerationChunk([1], "x"))
    alive.put(GenerationChunk([2], "y"))
    gone.fail(RuntimeError("deadline"))
    alive.put(GenerationChunk([3], "z"))
    outbox.flush()
    assert events == ["a chunk", "a chunk"]


class WaitRecordingTarget:
    """The runtime, with each step's start and end and its wait for the verify's results in ``events``."""

    def __init__(self, inner: TargetRuntime, events: list[str]) -> None:
        self.inner, self.events = inner, events

    def info(self) -> TargetInfo:
        return self.inner.info()

    def step(self, batch: TargetBatch) -> TargetBatchResult:
        self.events.append("verify" if batch.verifies else "prompt")
        handed = batch.before_results_wait
        if handed is not None:
            def waiting() -> None:
                self.events.append("wait")
                handed()

            batch = dataclasses.replace(batch, before_results_wait=waiting)
        result = self.inner.step(batch)
        self.events.append("end")
        return result


@pytest.mark.parametrize("draft", [None, DraftOptions("full", "8:0.0:4")], ids=["auto", "speculative"])
def test_a_step_s_chunks_go_out_while_the_next_verify_waits(tiny_target_dir, tokenizer, draft):
    target = TargetRuntime(DiffSpecSettings(base_model=tiny_target_dir, num_pages=256))
    drafter = load_draft_runtime(DiffSpecSettings(draft_model=BUNDLED_DRAFT), target) if draft else None
    events: list[str] = []
    core = EngineCore(WaitRecordingTarget(target, events), drafter, tokenizer, LIMITS)
    try:
        sink = RecordingSink(events, "s")
        prompt = tokenizer("def add(a, b):")["input_ids"]
        core.submit("s", GenerationRequest(prompt, 12, draft=draft), sink)
        assert sink.done.wait(timeout=120)
    finally:
        core.close()
    assert len(sink.tokens) == 12
    # one segment per target call and what follows it until the next: a verify's chunks go out at the next
    # verify's wait, never between its results and that wait; the last ones when no step follows
    segments: list[list[str]] = []
    for event in events:
        if event in ("verify", "prompt"):
            segments.append([])
        segments[-1].append(event)
    verifies = [segment for segment in segments if segment[0] == "verify"]
    assert len(verifies) >= 3
    assert verifies[0] == ["verify", "wait", "end"]  # the first token went out with the prompt's collection
    assert all(segment == ["verify", "wait", "s chunk", "end"] for segment in verifies[1:-1])
    last = verifies[-1]
    assert last[:4] == ["verify", "wait", "s chunk", "end"] and set(last[4:]) == {"s chunk"}
