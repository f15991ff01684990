"""The target and draft backends with every step's batch recorded beside the engine loop's iteration that
sent it, for tests that check what each iteration asked of them."""

from __future__ import annotations

import threading

from diffspec.device_accept import DeviceAccept
from draft_service.backend import DraftBatch, DraftBatchResult
from draft_service.prefix_cache import DraftPrefixCache
from draft_service.runtime import DraftRuntime
from gateway.detokenizer import Tokenizer
from gateway.engine import SpeculativeEngine
from gateway.engine_core import EngineCore, EngineLimits
from target_service.backend import TargetBatch, TargetBatchResult, TargetInfo
from target_service.runtime import TargetRuntime


class RecordingTarget:
    """The runtime, with every step's batch recorded beside the loop iteration that sent it, and a
    gate: while it is shut, a step waits, so requests submitted meanwhile reach the same iteration."""

    def __init__(self, inner: TargetRuntime) -> None:
        self.inner = inner
        self.core: EngineCore | None = None
        self.batches: list[tuple[int, TargetBatch]] = []  # (iteration, batch)
        self.results: list[TargetBatchResult] = []  # each batch's
        self.gate = threading.Event()
        self.gate.set()

    def info(self) -> TargetInfo:
        return self.inner.info()

    def step(self, batch: TargetBatch) -> TargetBatchResult:
        assert self.gate.wait(timeout=30)
        self.batches.append((self.core.timing.iterations if self.core else -1, batch))
        result = self.inner.step(batch)
        self.results.append(result)
        return result


class RecordingDraft:
    def __init__(self, inner: DraftRuntime) -> None:
        self.inner = inner
        self.core: EngineCore | None = None
        self.batches: list[tuple[int, DraftBatch]] = []  # (iteration, batch)
        self.written_on_device: list[tuple[int, set[str]]] = []  # (iteration, sessions) of each accept_on_device
        self.took_ahead: list[bool] = []  # per step that proposed: whether it took the trees queued ahead

    @property
    def sessions(self) -> dict:
        return self.inner.sessions

    @property
    def prefix_cache(self) -> DraftPrefixCache | None:
        return self.inner.prefix_cache

    def step(self, batch: DraftBatch) -> DraftBatchResult:
        self.batches.append((self.core.timing.iterations if self.core else -1, batch))
        taken = self.inner.proposals_ahead
        result = self.inner.step(batch)
        if result.trees:
            self.took_ahead.append(self.inner.proposals_ahead > taken)
        return result

    def accept_on_device(self, accepts: dict[str, DeviceAccept], ending: frozenset[str] = frozenset()) -> set[str]:
        written = self.inner.accept_on_device(accepts, ending)
        self.written_on_device.append((self.core.timing.iterations if self.core else -1, written))
        return written


def recording_engine(
    target: TargetRuntime, draft: DraftRuntime, tokenizer: Tokenizer, limits: EngineLimits
) -> SpeculativeEngine:
    """An engine over ``target`` and ``draft`` wrapped to record: ``engine.target`` and ``engine.draft``."""
    recording_target, recording_draft = RecordingTarget(target), RecordingDraft(draft)
    engine = SpeculativeEngine(recording_target, recording_draft, tokenizer, limits)
    recording_target.core = recording_draft.core = engine.core
    return engine
