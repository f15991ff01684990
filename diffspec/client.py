"""A Python client of the gateway's gRPC API, blocking (``GatewayClient``) or asyncio (``AsyncGatewayClient``).

    from diffspec.client import GatewayClient

    with GatewayClient("127.0.0.1:50051") as client:
        for chunk in client.generate("def fibonacci(n):", max_new_tokens=64):
            print(chunk.text, end="", flush=True)

``generate`` yields ``Chunk``s as the server streams them: the new token ids, the text they
complete, their logprobs when asked for, which sample they belong to (``n`` > 1) and, on each
sample's last chunk, its ``Stats``. ``complete`` collects them into one ``Completion`` per sample.
Unset arguments take the server's defaults. A failed call raises its typed error from
``diffspec.errors`` (``InvalidRequest``, ``ResourceExhausted``, ``PeerUnavailable``,
``DeadlineExceeded``). Connection settings not given here (keepalive, message size) follow the
``DIFFSPEC_*`` environment, as the CLI's do.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import AsyncIterator, Iterable, Iterator, Sequence, TypedDict

import grpc
from typing_extensions import Unpack

from diffspec.grpc_options import call_metadata, open_blocking_channel, open_channel
from diffspec.rpc_status import error_for
from diffspec.settings import DiffSpecSettings
from diffspec.v1 import gateway_pb2, gateway_pb2_grpc

PEER = "gateway"


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float  # under the distribution the token was drawn from (the model's softmax when greedy)
    top: dict[int, float]  # the most likely alternatives there: token id -> logprob


@dataclass(frozen=True)
class Stats:
    """One sample's numbers; tau = ``mean_accepted_length`` (accepted drafts + 1 bonus per verification)."""

    prompt_tokens: int
    new_tokens: int
    finish_reason: str  # length, eos, stop, context
    steps: int  # target forwards after the prefill
    accepted_drafts: int
    mean_accepted_length: float
    prefill_seconds: float
    decode_seconds: float
    decode_tokens_per_second: float
    fell_back_to_auto: bool  # the draft went away and the target finished alone (same tokens)

    @staticmethod
    def from_proto(message: gateway_pb2.GenerationStats) -> Stats:
        return Stats(**{name: getattr(message, name) for name in Stats.__dataclass_fields__})


@dataclass(frozen=True)
class Chunk:
    index: int  # which of the request's n samples
    token_ids: list[int]  # new in this chunk
    text: str  # the text they complete
    logprobs: list[TokenLogprob]  # one per token id, when asked for
    stats: Stats | None  # on each sample's last chunk


@dataclass
class Completion:
    """One sample, whole."""

    index: int
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[TokenLogprob] = field(default_factory=list)
    stats: Stats | None = None

    def add(self, chunk: Chunk) -> None:
        self.token_ids += chunk.token_ids
        self.text += chunk.text
        self.logprobs += chunk.logprobs
        self.stats = chunk.stats or self.stats


class GenerateOptions(TypedDict, total=False):
    """What ``generate`` and ``complete`` accept beside the prompt (``generate_request``'s keywords)."""

    max_new_tokens: int  # unset = the checkpoint's generation_config.json value, else the server's --max-new-tokens
    temperature: float  # 0 = greedy; unset = the checkpoint's generation_config.json value, else greedy
    top_p: float  # unset = the checkpoint's, else 1
    top_k: int  # 0 = all tokens; unset = the checkpoint's, else all
    seed: int
    stop: Sequence[str]
    stop_token_ids: Sequence[int]  # a generated id among these ends the sample, itself not emitted
    n: int  # independent samples
    logprobs: int  # each token's logprob and this many alternatives
    policy: str  # auto, chain, uniform<K>, full, online
    tree_config: str  # total_tokens:threshold:depth
    salience: bool


def generate_request(
    prompt: str | Sequence[int],
    *,
    max_new_tokens: int | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    seed: int | None = None,
    stop: Sequence[str] = (),
    stop_token_ids: Sequence[int] = (),
    n: int | None = None,
    logprobs: int | None = None,
    policy: str = "",
    tree_config: str = "",
    salience: bool | None = None,
) -> gateway_pb2.GenerateRequest:
    """The ``GenerateRequest`` message; ``prompt``: text, or target-vocab token ids (BOS included)."""
    if isinstance(prompt, str):
        message = gateway_pb2.GenerateRequest(text=prompt)
    else:
        message = gateway_pb2.GenerateRequest(token_ids=gateway_pb2.TokenIds(ids=list(prompt)))
    message.policy, message.tree_config = policy, tree_config
    message.stop.extend(stop)
    message.stop_token_ids.extend(stop_token_ids)
    optional = {"max_new_tokens": max_new_tokens, "temperature": temperature, "top_p": top_p, "top_k": top_k,
                "seed": seed, "n": n, "logprobs": logprobs, "salience": salience}  # fmt: skip
    for name, value in optional.items():
        if value is not None:
            setattr(message, name, value)
    return message


def chunk_of(response: gateway_pb2.GenerateResponse) -> Chunk:
    logprobs = [
        TokenLogprob(token_id, logprob, dict(zip(top.token_ids, top.logprobs)))
        for token_id, logprob, top in zip(response.token_ids, response.logprobs.logprobs, response.logprobs.top)
    ]
    stats = Stats.from_proto(response.stats) if response.HasField("stats") else None
    return Chunk(response.index, list(response.token_ids), response.text, logprobs, stats)


def _completions(chunks: Iterable[Chunk]) -> list[Completion]:
    samples: dict[int, Completion] = {}
    for chunk in chunks:
        samples.setdefault(chunk.index, Completion(chunk.index)).add(chunk)
    return [samples[i] for i in sorted(samples)]


def _settings(auth_token: str | None, tls_ca: str | None, max_message_bytes: int | None) -> DiffSpecSettings:
    given = {"auth_token": auth_token, "tls_ca": tls_ca, "max_message_bytes": max_message_bytes}
    return DiffSpecSettings(**{name: value for name, value in given.items() if value is not None})


class GatewayClient:
    """A blocking client over one channel; use it as a context manager, or ``close`` it.

    ``auth_token``: the server's bearer token; ``tls_ca``: a PEM file of the CA that signed the
    server's certificate (TLS is off without it); ``max_message_bytes``: the channel's message limit."""

    def __init__(
        self, address: str, *, auth_token: str | None = None, tls_ca: str | None = None,
        max_message_bytes: int | None = None,
    ) -> None:  # fmt: skip
        settings = _settings(auth_token, tls_ca, max_message_bytes)
        self._channel = open_blocking_channel(address, settings)
        self._stub = gateway_pb2_grpc.GatewayStub(self._channel)
        self._metadata = call_metadata(settings)

    def generate(
        self, prompt: str | Sequence[int], *, timeout: float | None = None, **options: Unpack[GenerateOptions]
    ) -> Iterator[Chunk]:
        """Stream the generation; ``options``: ``GenerateOptions``;
        ``timeout``: seconds the whole call may take (the deadline reaches the engine)."""
        call = self._stub.Generate(generate_request(prompt, **options), timeout=timeout, metadata=self._metadata)
        try:
            for response in call:
                yield chunk_of(response)
        except grpc.RpcError as failed:
            raise error_for(PEER, failed.code(), failed.details()) from None
        finally:
            call.cancel()  # leaving the loop early ends the request on the server

    def complete(
        self, prompt: str | Sequence[int], *, timeout: float | None = None, **options: Unpack[GenerateOptions]
    ) -> list[Completion]:
        """The whole generation: one ``Completion`` per sample, in index order."""
        return _completions(self.generate(prompt, timeout=timeout, **options))

    def tokenize(self, text: str) -> list[int]:
        try:
            return list(self._stub.Tokenize(gateway_pb2.TokenizeRequest(text=text), metadata=self._metadata).token_ids)
        except grpc.RpcError as failed:
            raise error_for(PEER, failed.code(), failed.details()) from None

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> GatewayClient:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()


class AsyncGatewayClient:
    """``GatewayClient`` for asyncio: ``generate`` is an async iterator, ``complete`` and ``tokenize`` coroutines.
    Create it in the event loop that uses it (``async with AsyncGatewayClient(...) as client``)."""

    def __init__(
        self, address: str, *, auth_token: str | None = None, tls_ca: str | None = None,
        max_message_bytes: int | None = None,
    ) -> None:  # fmt: skip
        settings = _settings(auth_token, tls_ca, max_message_bytes)
        self._channel = open_channel(address, settings)
        self._stub = gateway_pb2_grpc.GatewayStub(self._channel)
        self._metadata = call_metadata(settings)

    async def generate(
        self, prompt: str | Sequence[int], *, timeout: float | None = None, **options: Unpack[GenerateOptions]
    ) -> AsyncIterator[Chunk]:
        call = self._stub.Generate(generate_request(prompt, **options), timeout=timeout, metadata=self._metadata)
        try:
            async for response in call:
                yield chunk_of(response)
        except grpc.aio.AioRpcError as failed:
            raise error_for(PEER, failed.code(), failed.details()) from None
        finally:
            call.cancel()

    async def complete(
        self, prompt: str | Sequence[int], *, timeout: float | None = None, **options: Unpack[GenerateOptions]
    ) -> list[Completion]:
        return _completions([chunk async for chunk in self.generate(prompt, timeout=timeout, **options)])

    async def tokenize(self, text: str) -> list[int]:
        try:
            reply = await self._stub.Tokenize(gateway_pb2.TokenizeRequest(text=text), metadata=self._metadata)
        except grpc.aio.AioRpcError as failed:
            raise error_for(PEER, failed.code(), failed.details()) from None
        return list(reply.token_ids)

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> AsyncGatewayClient:
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.close()
