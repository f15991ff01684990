"""The in-process ``TargetBackend``: the runtime in this process, steps batched across sessions."""

from __future__ import annotations

import asyncio

from diffspec.sampling import SamplingParams
from diffspec.tree import DraftTree
from target_service.backend import PrefillProgress, PrefillResult, TargetInfo, VerifyResult
from target_service.runtime import TargetRuntime, VerifyStep
from diffspec.coalescer import Coalescer


class InProcessTarget:
    def __init__(self, runtime: TargetRuntime, max_batch_tokens: int = 4096) -> None:
        self.runtime = runtime
        self.batcher: Coalescer[VerifyStep, VerifyResult] = Coalescer(
            runtime.verify_batch, weight=lambda step: step.tree.num_nodes, max_weight=max_batch_tokens
        )

    async def prefill(
        self,
        session_id: str,
        prompt_ids: list[int],
        sampling: SamplingParams,
        want_features: bool,
        progress: PrefillProgress | None = None,
    ) -> PrefillResult:
        work = asyncio.ensure_future(
            asyncio.to_thread(self.runtime.prefill, session_id, prompt_ids, sampling, want_features, progress)
        )
        try:
            return await asyncio.shield(work)
        except asyncio.CancelledError:
            # The thread cannot be stopped; once it ends, free whatever it allocated.
            work.add_done_callback(lambda _: self.runtime.release(session_id))
            raise

    async def verify(self, session_id: str, tree: DraftTree) -> VerifyResult:
        return await self.batcher.submit(VerifyStep(session_id, tree))

    async def decode(self, session_id: str) -> VerifyResult:
        pending = self.runtime.pending_token(session_id)
        return await self.batcher.submit(VerifyStep(session_id, DraftTree.root_only(pending)))

    async def release(self, session_id: str) -> None:
        await asyncio.to_thread(self.runtime.release, session_id)

    async def info(self) -> TargetInfo:
        return self.runtime.info()
