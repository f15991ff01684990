"""The client-facing servicer: Generate / Tokenize / ModelInfo over a per-request ``SpeculativeEngine``.

Admission control is a plain count: at most ``max_sessions`` generations run at once and
the next one gets RESOURCE_EXHAUSTED at once (clients retry with backoff; a queue here would
only hide overload). Each generation's engine gets the call's remaining time as the deadline
of its calls to the target and the draft; when the call is cancelled, the engine's
``finally`` releases both sessions, which closes their streams.
"""

from __future__ import annotations

import asyncio
from contextlib import aclosing, contextmanager
from typing import Iterator

import grpc

from diffspec.errors import ResourceExhausted
from diffspec.metrics import ServingMetrics
from diffspec.serving import Loading
from diffspec.settings import DiffSpecSettings
from diffspec.v1 import gateway_pb2, gateway_pb2_grpc
from gateway.assembly import Backends
from gateway.messages import chunk_to_proto, generation_request, prompt_text

SERVICE_NAME = gateway_pb2.DESCRIPTOR.services_by_name["Gateway"].full_name
Context = grpc.aio.ServicerContext


class GatewayServicer(gateway_pb2_grpc.GatewayServicer):
    def __init__(self, backends: Loading[Backends], settings: DiffSpecSettings, metrics: ServingMetrics) -> None:
        self.backends = backends
        self.settings = settings
        self.metrics = metrics
        self.active_generations = 0

    async def Generate(self, request: gateway_pb2.GenerateRequest, context: Context) -> None:
        backends = self.backends.get()
        with self._admitted():
            engine = backends.engine(timeout=context.time_remaining())
            info = await engine.target_info()
            text = prompt_text(request)
            prompt_ids = list(request.token_ids.ids) if text is None else await self._tokenize(backends, text)
            generation = generation_request(request, prompt_ids, info, self.settings)
            async with aclosing(engine.generate(generation)) as chunks:
                async for chunk in chunks:
                    await context.write(chunk_to_proto(chunk))
                    if chunk.stats is not None:
                        self.metrics.record_generation(chunk.stats)

    async def Tokenize(self, request: gateway_pb2.TokenizeRequest, context: Context) -> gateway_pb2.TokenizeResponse:
        return gateway_pb2.TokenizeResponse(token_ids=await self._tokenize(self.backends.get(), request.text))

    async def ModelInfo(self, request: gateway_pb2.ModelInfoRequest, context: Context) -> gateway_pb2.ModelInfoResponse:
        backends = self.backends.get()
        info = await backends.engine(timeout=context.time_remaining()).target_info()
        return gateway_pb2.ModelInfoResponse(
            target_model=info.model,
            vocab_size=info.vocab_size,
            max_context=info.max_context,
            eos_token_ids=info.eos_token_ids,
            draft_available=backends.draft is not None,
            default_policy=self.settings.policy,
            default_tree_config=self.settings.tree_config,
            max_sessions=self.settings.max_sessions,
        )

    @contextmanager
    def _admitted(self) -> Iterator[None]:
        if self.active_generations >= self.settings.max_sessions:
            raise ResourceExhausted(f"{self.active_generations} generations in flight (max_sessions); retry later")
        self.active_generations += 1
        self.metrics.active_generations.inc()
        try:
            yield
        finally:
            self.active_generations -= 1
            self.metrics.active_generations.dec()

    @staticmethod
    async def _tokenize(backends: Backends, text: str) -> list[int]:
        """The target's tokenizer, off the event loop (a long prompt takes a while)."""
        return (await asyncio.to_thread(backends.tokenizer, text))["input_ids"]
