"""Wire an engine from settings: in-process backends by default, gRPC clients when addresses are set."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, TypeVar, runtime_checkable

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from diffspec.errors import CheckpointError, PeerUnavailable
from diffspec.settings import DiffSpecSettings
from draft_service.backend import DraftBackend
from gateway.engine import SpeculativeEngine
from target_service.backend import TargetBackend

if TYPE_CHECKING:
    from target_service.grpc_client import RemoteTarget
    from target_service.inprocess import InProcessTarget

log = logging.getLogger(__name__)

Backend = TypeVar("Backend")
PEER_POLL_TIMEOUT_S = 5.0  # one readiness poll of a remote target (a blackholed host never answers)


@runtime_checkable
class RemoteBackend(Protocol):
    """A backend behind gRPC: each request gets a client of its own whose calls end at its deadline."""

    def with_timeout(self, timeout: float | None) -> object: ...

    async def close(self) -> None: ...


def load_tokenizer(settings: DiffSpecSettings) -> PreTrainedTokenizerBase:
    """The target's tokenizer, read from the target checkpoint directory."""
    try:
        return AutoTokenizer.from_pretrained(str(settings.base_model))
    except (OSError, ValueError) as bad:
        raise CheckpointError(f"cannot load a tokenizer from {settings.base_model}: {bad}") from None


def inprocess_target(settings: DiffSpecSettings) -> InProcessTarget:
    from target_service.inprocess import InProcessTarget
    from target_service.runtime import TargetRuntime

    return InProcessTarget(TargetRuntime(settings), settings.max_batch_tokens)


def build_target(settings: DiffSpecSettings) -> TargetBackend:
    """A gRPC client when ``target_address`` is set (call inside the event loop), else the model in process."""
    if settings.target_address:
        from target_service.grpc_client import RemoteTarget

        return RemoteTarget.connect(settings.target_address, settings)
    return inprocess_target(settings)


def build_draft(settings: DiffSpecSettings, target: TargetBackend) -> DraftBackend | None:
    """A gRPC client when ``draft_address`` is set, else the in-process draft, or None (Auto only)
    when the draft model directory is absent."""
    if settings.draft_address:
        from draft_service.grpc_client import RemoteDraft

        return RemoteDraft.connect(settings.draft_address, settings)
    if not settings.draft_model.exists():
        log.warning("no draft model at %s: only policy 'auto' is served", settings.draft_model)
        return None
    from draft_service.inprocess import InProcessDraft

    return InProcessDraft.from_settings(settings, target)


def build_engine(settings: DiffSpecSettings, with_draft: bool = True) -> SpeculativeEngine:
    target = build_target(settings)
    draft = build_draft(settings, target) if with_draft else None
    return SpeculativeEngine(target, draft, load_tokenizer(settings))


@dataclass(frozen=True)
class Backends:
    """What a gateway serves with; ``engine`` makes the per-request engine."""

    target: TargetBackend
    draft: DraftBackend | None
    tokenizer: PreTrainedTokenizerBase

    def engine(self, timeout: float | None = None) -> SpeculativeEngine:
        """An engine whose remote calls end within ``timeout`` seconds (the inbound call's deadline)."""
        return SpeculativeEngine(_bound(self.target, timeout), _bound(self.draft, timeout), self.tokenizer)

    async def close(self) -> None:
        for backend in (self.target, self.draft):
            if isinstance(backend, RemoteBackend):
                await backend.close()


async def load_backends(settings: DiffSpecSettings) -> Backends:
    """A gateway's backends: gRPC clients are made in the event loop, models load in a worker thread;
    a remote target must answer before this returns."""
    remote_target = bool(settings.target_address)
    target = build_target(settings) if remote_target else await asyncio.to_thread(build_target, settings)
    if settings.draft_address:
        draft = build_draft(settings, target)
    else:
        draft = await asyncio.to_thread(build_draft, settings, target)
    tokenizer = await asyncio.to_thread(load_tokenizer, settings)
    if remote_target:
        await wait_for_target(target, settings.peer_wait_seconds)  # type: ignore[arg-type]
    return Backends(target, draft, tokenizer)


async def wait_for_target(target: RemoteTarget, timeout: float) -> None:
    """Poll ``info`` until the target answers (it is UNAVAILABLE while it loads), at most ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    delay = 0.05
    while True:
        try:
            await target.with_timeout(PEER_POLL_TIMEOUT_S).info()
            return
        except PeerUnavailable as failure:
            if time.monotonic() + delay > deadline:
                raise PeerUnavailable(f"the target did not answer within {timeout:.0f} s: {failure}") from None
        await asyncio.sleep(delay)
        delay = min(2 * delay, 1.0)


def _bound(backend: Backend, timeout: float | None) -> Backend:
    return backend.with_timeout(timeout) if isinstance(backend, RemoteBackend) else backend  # type: ignore[return-value]
