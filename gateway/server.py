"""The client-facing servicer: Generate / Tokenize / ModelInfo over the process's one engine loop.

Admission is the engine's: at most ``max_sessions`` requests are in it at once, running or queued
until the KV pool can hold them, and the next one gets RESOURCE_EXHAUSTED at once (clients retry
with backoff), as does a client past its own quota (``gateway/quota.py``: the caller is its
``x-diffspec-client`` metadata, else its host). A request runs within the call's deadline; when the
call is cancelled, leaving the engine's stream aborts the request, which frees its sessions on both
services.

Prompt text is tokenized before admission to the engine, so it has admission of its own: a text
longer than ``MAX_CHARS_PER_TOKEN`` per context token is refused unread, a tokenization holds one
of its client's request slots (a client at its cap is refused before it costs anything), and at
most ``max_tokenizations`` run at once, on the ``TokenizerPool``'s own threads; ``Tokenize`` is
admitted the same way. With ``api_keys_file`` the caller is the tenant its key names.
"""

from __future__ import annotations

import asyncio
from contextlib import aclosing
from dataclasses import replace

import grpc

from diffspec.auth import ApiKeys
from diffspec.errors import InvalidRequest, PeerUnavailable
from diffspec.metrics import ServingMetrics
from diffspec.serving import Loading, model_name
from diffspec.settings import DiffSpecSettings
from diffspec.v1 import gateway_pb2, gateway_pb2_grpc
from gateway.engine import SpeculativeEngine
from gateway.prompt import encode_prompt
from gateway.samples import generate_samples
from gateway.quota import CLIENT_HEADER, client_id, grpc_peer_host
from gateway.messages import chunk_to_proto, generation_request, prompt_text
from gateway.tokenizer_pool import TokenizerPool

# A token is rarely longer than this many characters; longer texts are refused before they are tokenized,
# so a huge text cannot cost seconds of tokenizer time and gigabytes of memory before its length check.
MAX_CHARS_PER_TOKEN = 16
# Info does not wait for the target's steps, so a target busy with a long prefill still answers in far less
TARGET_PROBE_TIMEOUT_S = 2.0
SERVICE_NAME = gateway_pb2.DESCRIPTOR.services_by_name["Gateway"].full_name
Context = grpc.aio.ServicerContext


class GatewayServicer(gateway_pb2_grpc.GatewayServicer):
    def __init__(self, engine: Loading[SpeculativeEngine], settings: DiffSpecSettings, metrics: ServingMetrics) -> None:
        self.engine = engine
        self.settings = settings
        self.metrics = metrics
        self.api_keys = ApiKeys.for_role(settings, "gateway")
        self.tokenizer_pool = TokenizerPool(settings.tokenize_threads, settings.max_tokenizations)

    async def Generate(self, request: gateway_pb2.GenerateRequest, context: Context) -> None:
        engine = self.engine.get()
        client = self.caller(context)
        text = prompt_text(request)
        if text is None:
            prompt_ids = list(request.token_ids.ids)
        else:
            with engine.core.quotas.holding(client):
                prompt_ids = await self._tokenize(engine, text)
        generation = generation_request(
            request, prompt_ids, self.settings, engine.draft is not None, engine.sampling_defaults,
            max_context=engine.core.info.max_context,
        )  # fmt: skip
        generation = replace(generation, client=client)
        self.metrics.active_generations.inc()
        try:
            async with aclosing(generate_samples(engine, generation, context.time_remaining())) as chunks:
                async for chunk in chunks:
                    await context.write(chunk_to_proto(chunk))
                    if chunk.stats is not None:
                        self.metrics.record_generation(chunk.stats)
        finally:
            self.metrics.active_generations.dec()

    async def Tokenize(self, request: gateway_pb2.TokenizeRequest, context: Context) -> gateway_pb2.TokenizeResponse:
        engine = self.engine.get()
        with engine.core.quotas.holding(self.caller(context)):
            return gateway_pb2.TokenizeResponse(token_ids=await self._tokenize(engine, request.text))

    async def ModelInfo(self, request: gateway_pb2.ModelInfoRequest, context: Context) -> gateway_pb2.ModelInfoResponse:
        engine = self.engine.get()
        info = await engine.target_info()
        return gateway_pb2.ModelInfoResponse(
            target_model=model_name(info.model),
            vocab_size=info.vocab_size,
            max_context=info.max_context,
            eos_token_ids=info.eos_token_ids,
            draft_available=engine.draft is not None,
            default_policy=self.settings.policy,
            default_tree_config=self.settings.tree_config,
            max_sessions=self.settings.max_sessions,
        )

    async def _tokenize(self, engine: SpeculativeEngine, text: str) -> list[int]:
        """The target's tokenizer on the tokenizer pool, after the length bound (a long prompt takes a while)."""
        max_context = (await engine.target_info()).max_context
        if len(text) > MAX_CHARS_PER_TOKEN * max_context:
            raise InvalidRequest(
                f"a text of {len(text)} characters cannot fit the context of {max_context} tokens"
            )
        return await self.tokenizer_pool.run(encode_prompt, engine.tokenizer, text)

    def caller(self, context: Context) -> str:
        """The client a call comes from (gateway/quota.py): the tenant of its API key, else its declared name,
        else its host."""
        metadata = dict(context.invocation_metadata() or ())
        tenant = self.api_keys.tenant_of(metadata.get("authorization")) or None
        return client_id(metadata.get(CLIENT_HEADER), grpc_peer_host(context.peer()), tenant)

    async def target_answers(self) -> bool:
        """Whether the remote target answers an Info call within ``TARGET_PROBE_TIMEOUT_S`` (health follows it)."""
        target = self.engine.get().target
        try:
            await asyncio.to_thread(target.info, TARGET_PROBE_TIMEOUT_S)  # type: ignore[call-arg]
        except PeerUnavailable:
            return False
        return True
