"""``diffspec generate``: stream one generation to the terminal, in process or through a gateway."""

from __future__ import annotations

import argparse
import sys
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, AsyncIterator, Callable

from cli.output import show, summary_line
from cli.request import check_draft_fields, read_prompt, request_from_flags
from diffspec.errors import InvalidRequest
from diffspec.settings import DiffSpecSettings
from diffspec.v1 import gateway_pb2

if TYPE_CHECKING:  # help and argument errors import neither torch nor the engine
    from gateway.request import GenerationChunk

Source = Callable[[gateway_pb2.GenerateRequest], "AsyncIterator[GenerationChunk]"]


async def run_generate(args: argparse.Namespace, settings: DiffSpecSettings, model_flags: list[str]) -> int:
    """``model_flags``: the in-process model flags the user gave (an error with ``--gateway``)."""
    message = request_from_flags(args, read_prompt(args))
    if args.gateway and model_flags:
        raise InvalidRequest(f"{', '.join(model_flags)}: in-process model flags; a gateway serves its own models")
    if args.vs_auto and message.n > 1:
        raise InvalidRequest("--vs-auto compares one sample with Auto: leave --n at 1")
    if not args.gateway:
        check_draft_fields(settings.policy, settings.tree_config)  # the defaults a request leaves unset
    num_samples = message.n if message.HasField("n") else 1
    async with _gateway(args.gateway, settings) if args.gateway else _in_process(settings) as source:
        runs = await show(source(message), args.json, num_samples)
        if args.vs_auto:
            auto_message = gateway_pb2.GenerateRequest()
            auto_message.CopyFrom(message)
            auto_message.policy = "auto"
            (auto,) = await show(source(auto_message), as_json=False, quiet=True)
            print(summary_line(runs[0], auto), file=sys.stderr)
        elif not args.json:
            for index, run in enumerate(runs):
                print(f"sample {index}: " * (num_samples > 1) + summary_line(run), file=sys.stderr)
    return 0


@asynccontextmanager
async def _gateway(address: str, settings: DiffSpecSettings) -> AsyncIterator[Source]:
    from gateway.client import stream_generate

    yield lambda message: stream_generate(address, message, settings)


@asynccontextmanager
async def _in_process(settings: DiffSpecSettings) -> AsyncIterator[Source]:
    """The models load here, once; each request then goes through the gateway's own checks and defaults."""
    from gateway.assembly import build_engine
    from gateway.messages import generation_request, prompt_text
    from gateway.samples import generate_samples

    engine = build_engine(settings)

    async def generate(message: gateway_pb2.GenerateRequest) -> AsyncIterator[GenerationChunk]:
        prompt_ids = engine.tokenizer(prompt_text(message))["input_ids"]
        request = generation_request(
            message, prompt_ids, settings, engine.draft is not None, engine.sampling_defaults,
            max_context=engine.core.info.max_context,
        )  # fmt: skip
        async for chunk in generate_samples(engine, request):
            yield chunk

    try:
        yield generate
    finally:
        engine.close()
