"""Call a running gateway: ``stream_generate`` yields the same chunks as the in-process engine.

The last chunk's ``stats`` is a ``GenerationStats``, so ``diffspec generate --gateway`` prints
exactly the JSON contract of an in-process run. A failed call raises its typed error.
"""

from __future__ import annotations

from typing import AsyncIterator

import grpc

from diffspec.grpc_options import call_metadata, open_channel
from diffspec.rpc_status import error_for
from diffspec.settings import DiffSpecSettings
from diffspec.v1 import gateway_pb2, gateway_pb2_grpc
from gateway.messages import chunk_from_proto
from gateway.request import GenerationChunk

PEER = "gateway"


async def stream_generate(
    address: str, request: gateway_pb2.GenerateRequest, settings: DiffSpecSettings
) -> AsyncIterator[GenerationChunk]:
    """``settings``: the channel's message size, keepalive, TLS and token; the request's unset fields take the
    server's defaults."""
    async with open_channel(address, settings) as channel:
        call = gateway_pb2_grpc.GatewayStub(channel).Generate(request, metadata=call_metadata(settings))
        try:
            async for response in call:
                yield chunk_from_proto(response)
        except grpc.aio.AioRpcError as failed:
            raise error_for(PEER, failed.code(), failed.details()) from None
