"""The in-process ``DraftBackend``: the draft runtime in this process, calls run in a worker thread."""

from __future__ import annotations

import asyncio

import torch

from diffspec.coalescer import Coalescer
from diffspec.devices import resolve_device, resolve_dtype
from diffspec.errors import CheckpointError
from diffspec.settings import DiffSpecSettings
from diffspec.tree import DraftTree
from draft_service.backend import DraftOptions, DraftStats
from draft_service.eagle3_head import Eagle3Head
from draft_service.runtime import DraftRuntime
from draft_service.working_set import WorkingSetConfig


def working_set_config(settings: DiffSpecSettings) -> WorkingSetConfig:
    return WorkingSetConfig(
        chunk_size=settings.chunk_size,
        budget_tokens=settings.working_set_tokens,
        recent_chunks=max(1, settings.salience_recent_tokens // settings.chunk_size),
        reselect_every=settings.salience_reselect_every,
    )
from draft_service.target_embedding import load_target_embedding


class InProcessDraft:
    def __init__(self, runtime: DraftRuntime, max_batch_sessions: int = 64) -> None:
        self.runtime = runtime
        self.batcher: Coalescer[str, DraftTree] = Coalescer(
            runtime.propose_batch, weight=lambda _: 1, max_weight=max_batch_sessions
        )

    @classmethod
    def from_settings(cls, settings: DiffSpecSettings, target: object | None = None) -> InProcessDraft:
        """Load the head; the target's embedding is shared when the target runs in this process."""
        device = resolve_device(settings.device)
        dtype = resolve_dtype(settings.dtype, device)
        runtime = getattr(target, "runtime", None)
        embedding = runtime.model.embed_tokens if runtime is not None else None
        if embedding is None:
            embedding = load_target_embedding(settings.base_model, device, dtype)
        head = Eagle3Head.load(settings.draft_model, embedding, device, dtype)
        trained_on, serving = head.config.feature_layers, getattr(runtime, "feature_layers", None)
        if trained_on and serving is not None and tuple(trained_on) != tuple(serving):
            raise CheckpointError(
                f"draft head {settings.draft_model} was trained on target layers {list(trained_on)}, "
                f"but the target extracts features from layers {list(serving)} (set DIFFSPEC_FEATURE_LAYERS)"
            )
        return cls(DraftRuntime(head, working_set_config(settings), settings.cuda_graphs), settings.max_sessions)

    async def start(
        self, session_id: str, prompt_ids: list[int], features: torch.Tensor, first_token: int, options: DraftOptions
    ) -> None:
        await asyncio.to_thread(self.runtime.start, session_id, prompt_ids, features, first_token, options)

    async def propose(self, session_id: str) -> DraftTree:
        return await self.batcher.submit(session_id)

    async def accept(self, session_id: str, emitted_tokens: list[int], features: torch.Tensor) -> None:
        await asyncio.to_thread(self.runtime.accept, session_id, emitted_tokens, features)

    async def stats(self, session_id: str) -> DraftStats:
        return self.runtime.stats(session_id)

    async def release(self, session_id: str) -> None:
        await asyncio.to_thread(self.runtime.release, session_id)
