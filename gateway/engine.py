"""The request loop: prefill -> (propose -> verify -> accept)* -> stream, over two backends.

The same loop runs Auto (no draft: one ``decode`` per token) and speculative decoding. If the
draft fails mid-generation the loop finishes with Auto on the target: the tokens are the same
either way, since the target alone decides every token. Whatever way the generation ends
(finished, cancelled, failed), both sessions are released.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from typing import AsyncIterator

from diffspec.errors import DiffSpecError, InvalidRequest
from draft_service.backend import DraftBackend
from draft_service.runtime import validate_options
from gateway.detokenizer import IncrementalDetokenizer, Tokenizer
from gateway.request import GenerationChunk, GenerationRequest, GenerationStats
from target_service.backend import PrefillProgress, TargetBackend, TargetInfo, VerifyResult

log = logging.getLogger(__name__)


class SpeculativeEngine:
    def __init__(
        self,
        target: TargetBackend,
        draft: DraftBackend | None,
        tokenizer: Tokenizer,
        prefill_progress: PrefillProgress | None = None,  # told (done, total) tokens while a prompt prefills
    ) -> None:
        self.target = target
        self.draft = draft
        self.tokenizer = tokenizer
        self.prefill_progress = prefill_progress
        self._target_info: TargetInfo | None = None

    async def target_info(self) -> TargetInfo:
        if self._target_info is None:
            self._target_info = await self.target.info()
        return self._target_info

    async def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationChunk]:
        """Stream the generation chunk by chunk; the last chunk carries the stats."""
        info = await self.target_info()
        self._check(request, info)
        if request.draft is not None and self.draft is None:
            raise InvalidRequest(f"policy {request.draft.policy!r} needs a draft model, and none is configured")
        run = _Generation(self, request, info)
        try:
            async for chunk in run.chunks():
                yield chunk
        finally:
            await asyncio.shield(run.release())

    @staticmethod
    def _check(request: GenerationRequest, info: TargetInfo) -> None:
        if not request.prompt_ids:
            raise InvalidRequest("the prompt is empty")
        if len(request.prompt_ids) >= info.max_context:
            raise InvalidRequest(
                f"prompt of {len(request.prompt_ids)} tokens does not fit the context of {info.max_context} tokens"
            )
        if request.max_new_tokens < 1:
            raise InvalidRequest(f"max_new_tokens must be >= 1, got {request.max_new_tokens}")
        if request.draft is not None:
            validate_options(request.draft)


class _Generation:
    """State of one request inside the loop."""

    def __init__(self, engine: SpeculativeEngine, request: GenerationRequest, info: TargetInfo) -> None:
        self.engine = engine
        self.request = request
        self.info = info
        self.session_id = uuid.uuid4().hex
        self.stats = GenerationStats(prompt_tokens=len(request.prompt_ids))
        self.text = IncrementalDetokenizer(engine.tokenizer, request.stop_sequences)
        self.drafting = request.draft is not None
        self.draft_started = False
        self.target_started = False
        # the last emitted token's KV is not committed; each step commits at most depth + 1 more
        self.context_left = info.max_context - len(request.prompt_ids)

    async def chunks(self) -> AsyncIterator[GenerationChunk]:
        target, draft, req = self.engine.target, self.engine.draft, self.request
        start = time.perf_counter()
        self.target_started = True
        prefill = await target.prefill(
            self.session_id, req.prompt_ids, req.sampling, self.drafting, self.engine.prefill_progress
        )
        first_token_at = time.perf_counter()
        self.stats.prefill_seconds = first_token_at - start
        chunk = self._emit([prefill.first_token])
        if chunk.token_ids or chunk.text:
            yield chunk
        if self.drafting and not self.stats.finish_reason:
            assert draft is not None and req.draft is not None and prefill.features is not None
            self.draft_started = True
            await self._draft_call(
                draft.start(self.session_id, req.prompt_ids, prefill.features, prefill.first_token, req.draft)
            )
        while not self.stats.finish_reason:
            result = await self._step()
            self.stats.record_step(len(result.accepted_tokens))
            self.context_left -= len(result.emitted_tokens)
            chunk = self._emit(result.emitted_tokens)
            if chunk.token_ids or chunk.text:
                yield chunk
            if self.drafting and not self.stats.finish_reason:
                assert draft is not None and result.features is not None
                await self._draft_call(draft.accept(self.session_id, result.emitted_tokens, result.features))
        self.stats.decode_seconds = time.perf_counter() - first_token_at
        if self.draft_started and self.drafting:
            draft_stats = await self._draft_call(draft.stats(self.session_id))  # type: ignore[union-attr]
            if draft_stats is not None:
                self.stats.hazard = draft_stats.hazard
                self.stats.working_set_tokens = draft_stats.working_set_tokens
        yield GenerationChunk(token_ids=[], text=self.text.flush(), stats=self.stats)

    async def _step(self) -> VerifyResult:
        """One speculative step, or one Auto step when there is no draft (any more)."""
        target, draft = self.engine.target, self.engine.draft
        if self.drafting:
            t0 = time.perf_counter()
            tree = await self._draft_call(draft.propose(self.session_id))  # type: ignore[union-attr]
            self.stats.draft_seconds += time.perf_counter() - t0
            if tree is not None and int(tree.depths().max()) + 1 < self.context_left:
                t0 = time.perf_counter()
                result = await target.verify(self.session_id, tree)
                self.stats.verify_seconds += time.perf_counter() - t0
                return result
        t0 = time.perf_counter()
        result = await target.decode(self.session_id)
        self.stats.verify_seconds += time.perf_counter() - t0
        return result

    async def _draft_call(self, call):  # noqa: ANN001, ANN202 - any draft coroutine
        """Await a draft call; if the draft fails, finish this request with Auto instead."""
        if not self.drafting:
            call.close()
            return None
        try:
            return await call
        except (DiffSpecError, ConnectionError, OSError) as failure:
            log.warning("draft failed for session %s, continuing with Auto: %s", self.session_id, failure)
            self.drafting = False
            self.stats.fell_back_to_auto = True
            return None

    def _emit(self, tokens: list[int]) -> GenerationChunk:
        """Clip the step's tokens at EOS, a stop sequence, max_new_tokens or the context end."""
        kept: list[int] = []
        text = ""
        for token in tokens:
            if token in self.info.eos_token_ids:
                self.stats.finish_reason = "eos"
                break
            kept.append(token)
            self.stats.new_tokens += 1
            text += self.text.push(token)
            if self.text.stopped:
                self.stats.finish_reason = "stop"
            elif self.stats.new_tokens >= self.request.max_new_tokens:
                self.stats.finish_reason = "length"
            elif len(self.request.prompt_ids) + self.stats.new_tokens >= self.info.max_context:
                self.stats.finish_reason = "context"
            if self.stats.finish_reason:
                break
        return GenerationChunk(token_ids=kept, text=text)

    async def release(self) -> None:
        """Free the session on both services; failures here are logged, never raised."""
        if self.draft_started and self.engine.draft is not None:
            try:
                await self.engine.draft.release(self.session_id)
            except Exception as failure:  # noqa: BLE001 - release must not mask the real outcome
                log.warning("draft release of %s failed: %s", self.session_id, failure)
        if self.target_started:
            try:
                await self.engine.target.release(self.session_id)
            except Exception as failure:  # noqa: BLE001
                log.warning("target release of %s failed: %s", self.session_id, failure)
