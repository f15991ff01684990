"""Call a running gateway: ``stream_generate`` yields the same chunks as the in-process engine.

The last chunk's ``stats`` is a ``GenerationStats``, so ``diffspec generate --gateway`` prints
exactly the JSON contract of an in-process run. A failed call raises its typed error.
"""

from __future__ import annotations

import argparse
from typing import AsyncIterator

import grpc

from diffspec.grpc_options import open_channel
from diffspec.rpc_status import error_for
from diffspec.settings import DiffSpecSettings
from diffspec.v1 import gateway_pb2, gateway_pb2_grpc
from gateway.messages import chunk_from_proto
from gateway.request import GenerationChunk

PEER = "gateway"


def generate_request(text: str, args: argparse.Namespace, settings: DiffSpecSettings) -> gateway_pb2.GenerateRequest:
    """The CLI's generate flags and settings as a request (the settings fill policy, budget and length)."""
    return gateway_pb2.GenerateRequest(
        text=text,
        max_new_tokens=settings.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        seed=args.seed,
        stop=args.stop,
        policy=settings.policy,
        tree_config=settings.tree_config,
        salience=settings.salience,
    )


async def stream_generate(
    address: str, text: str, args: argparse.Namespace, settings: DiffSpecSettings
) -> AsyncIterator[GenerationChunk]:
    async with open_channel(address, settings) as channel:
        call = gateway_pb2_grpc.GatewayStub(channel).Generate(generate_request(text, args, settings))
        try:
            async for response in call:
                yield chunk_from_proto(response)
        except grpc.aio.AioRpcError as failed:
            raise error_for(PEER, failed.code(), failed.details()) from None
