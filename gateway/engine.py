"""The front ends' handle on the engine loop: check a request, submit it, stream its chunks.

Everything runs on the engine's thread (``gateway/engine_core.py``); this side only validates
and moves chunks from the engine thread into the caller's event loop. Leaving the stream early
(a cancelled call, a closed generator) aborts the request, which frees its sessions.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import AsyncIterator

from diffspec.errors import InvalidRequest
from diffspec.sampling_params import SamplingDefaults
from draft_service.backend import DraftBackend
from draft_service.options import validate_options
from gateway.detokenizer import Tokenizer
from gateway.engine_core import EngineCore, EngineLimits
from gateway.request import GenerationChunk, GenerationRequest
from target_service.backend import TargetBackend, TargetInfo

DEFAULT_LIMITS = EngineLimits(max_requests=64, max_batch_tokens=4096, prefill_chunk=2048)


class _LoopSink:
    """Hands chunks from the engine thread to one asyncio queue, thread-safely."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.queue: asyncio.Queue[GenerationChunk | BaseException] = asyncio.Queue()

    def put(self, chunk: GenerationChunk) -> None:
        self._send(chunk)

    def fail(self, error: BaseException) -> None:
        self._send(error)

    def _send(self, item: GenerationChunk | BaseException) -> None:
        if not self.loop.is_closed():
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


class SpeculativeEngine:
    def __init__(
        self,
        target: TargetBackend,
        draft: DraftBackend | None,
        tokenizer: Tokenizer,
        limits: EngineLimits = DEFAULT_LIMITS,
        feature_layers: tuple[int, ...] = (),
        sampling_defaults: SamplingDefaults = SamplingDefaults(),
    ) -> None:
        """``feature_layers``: the target layers the draft's head reads; () = the target's default.
        ``sampling_defaults``: the checkpoint's, for requests that leave those fields unset (the front ends
        apply them through ``gateway/messages.py``)."""
        self.target = target
        self.draft = draft
        self.tokenizer = tokenizer
        self.sampling_defaults = sampling_defaults
        self.core = EngineCore(target, draft, tokenizer, limits, feature_layers)

    async def target_info(self) -> TargetInfo:
        return self.core.info

    async def generate(
        self, request: GenerationRequest, timeout: float | None = None
    ) -> AsyncIterator[GenerationChunk]:
        """Stream the generation chunk by chunk; the last chunk carries the stats.

        ``timeout``: seconds the whole request may take (a call's remaining deadline)."""
        self.check(request)
        sink = _LoopSink(asyncio.get_running_loop())
        request_id = uuid.uuid4().hex
        deadline = time.monotonic() + timeout if timeout is not None else None
        self.core.submit(request_id, request, sink, deadline)
        done = False
        try:
            while not done:
                item = await sink.queue.get()
                if isinstance(item, BaseException):
                    done = True
                    raise item
                done = item.stats is not None
                yield item
        finally:
            if not done:
                self.core.abort(request_id)

    def check(self, request: GenerationRequest) -> None:
        """Everything about a request that can be refused before it reaches a service: the one check of
        every request, whichever front end built it (gRPC, HTTP, the CLI)."""
        info = self.core.info
        if not request.prompt_ids:
            raise InvalidRequest("the prompt is empty")
        if len(request.prompt_ids) >= info.max_context:
            raise InvalidRequest(
                f"prompt of {len(request.prompt_ids)} tokens does not fit the context of {info.max_context} tokens"
            )
        outside = [t for t in request.prompt_ids if not 0 <= t < info.vocab_size]
        if outside:
            raise InvalidRequest(f"token ids out of the vocabulary [0, {info.vocab_size}): {outside[:5]}")
        outside = sorted(t for t in request.stop_token_ids if not 0 <= t < info.vocab_size)
        if outside:
            raise InvalidRequest(f"stop token ids out of the vocabulary [0, {info.vocab_size}): {outside[:5]}")
        if not 1 <= request.max_new_tokens <= info.max_context:
            raise InvalidRequest(
                f"max_new_tokens must be in [1, {info.max_context}] (the context), got {request.max_new_tokens}"
            )
        if request.draft is not None:
            validate_options(request.draft)
            if self.draft is None:
                raise InvalidRequest(f"policy {request.draft.policy!r} needs a draft model, and none is configured")

    def close(self) -> None:
        """Stop the loop (its requests fail as the server shuts down), then drop remote connections."""
        self.core.close()
        for backend in (self.target, self.draft):
            close = getattr(backend, "close", None)  # the gRPC clients; in-process runtimes hold nothing to close
            if close is not None:
                close()
