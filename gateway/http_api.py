"""The OpenAI-compatible HTTP API over the process's one engine loop, beside the gRPC gateway.

``create_app`` is a FastAPI app: ``/v1/models``, ``/v1/completions`` and ``/v1/chat/completions``
(streamed as server-sent events ``data: {...}`` ending with ``data: [DONE]``, or whole), ``/health``
(liveness), ``/ready`` (200 once the engine is loaded, 503 while it loads or drains) and
``/metrics`` (the process's Prometheus registry). ``HttpServer`` runs it with uvicorn as a task
of the gateway's event loop. ``n`` > 1 runs the samples of ``gateway/samples.py``: a streamed
response interleaves their chunks, each choice with its ``index``; logprobs travel with the chunk
of the tokens they belong to.

Errors are OpenAI's JSON shape: 400 for a bad request, 429 when ``max_sessions`` generations are
in flight or the client is past its quota (the client is its ``x-diffspec-client`` header, else its
host), 503 while the models load or when a service is unreachable, 504 past a deadline. A
streamed request answers its status once the first chunk is out of the engine, so admission and
validation failures get a status rather than an error inside a 200 stream. A client that goes away
mid-stream closes the engine's stream, which aborts the request and frees its KV pages and sessions.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import ssl
import time
import uuid
from contextlib import aclosing
from dataclasses import replace
from typing import Any, AsyncIterator, Iterator

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException

from diffspec.auth import ApiKeys
from diffspec.errors import DeadlineExceeded, DiffSpecError, InvalidRequest, PeerUnavailable, ResourceExhausted
from diffspec.metrics import ServingMetrics
from diffspec.sampling_params import TokenLogprobs
from diffspec.rpc_status import internal_error
from diffspec.serving import Loading, Readiness, model_name
from diffspec.settings import DiffSpecSettings
from diffspec.v1 import gateway_pb2
from gateway import openai_schema as oai
from gateway.engine import SpeculativeEngine
from gateway.messages import generation_request
from gateway.detokenizer import Tokenizer
from gateway.prompt import encode_prompt, render_chat
from gateway.quota import CLIENT_HEADER, client_id
from gateway.request import GenerationChunk, GenerationRequest, GenerationStats
from gateway.samples import generate_samples
from gateway.server import MAX_CHARS_PER_TOKEN
from gateway.tokenizer_pool import TokenizerPool
from target_service.backend import TargetInfo

log = logging.getLogger(__name__)

# error class -> (HTTP status, OpenAI error type); the first match in order wins
ERROR_STATUS: list[tuple[type[DiffSpecError], int, str]] = [
    (InvalidRequest, 400, "invalid_request_error"),
    (ResourceExhausted, 429, "rate_limit_exceeded"),
    (PeerUnavailable, 503, "service_unavailable"),
    (DeadlineExceeded, 504, "timeout"),
]


def status_of(error: DiffSpecError) -> tuple[int, str]:
    for kind, status, name in ERROR_STATUS:
        if isinstance(error, kind):
            return status, name
    return 500, "internal_error"


UNAUTHENTICATED_PATHS = frozenset({"/health", "/ready"})  # probes answer without the token


def create_app(
    engine: Loading[SpeculativeEngine],
    settings: DiffSpecSettings,
    metrics: ServingMetrics,
    readiness: Readiness | None = None,
) -> FastAPI:
    """``readiness``: the process's (``diffspec/serving.py``), so ``/ready`` agrees with gRPC health."""
    app = FastAPI(title="DiffSpec", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.draining = False  # set by HttpServer.stop: /ready answers 503 from then on
    app.state.tokenizer_pool = TokenizerPool(settings.tokenize_threads, settings.max_tokenizations)
    keys = ApiKeys.for_role(settings, "gateway")

    @app.middleware("http")
    async def _bearer_token(request: Request, call_next):  # noqa: ANN001, ANN202 - starlette's middleware shape
        """With a token or API keys set, every route but the probes needs one, as on the gRPC port; an API
        key's tenant is the caller (``request.state.tenant``)."""
        request.state.tenant = tenant = keys.tenant_of(request.headers.get("authorization"))
        if keys.required and tenant is None and request.url.path not in UNAUTHENTICATED_PATHS:
            return JSONResponse(oai.error_body("missing or wrong bearer token", "authentication_error", 401), 401)
        return await call_next(request)

    @app.exception_handler(DiffSpecError)
    async def _diffspec_error(request: Request, error: DiffSpecError) -> JSONResponse:
        status, kind = status_of(error)
        return JSONResponse(oai.error_body(str(error), kind, status), status_code=status)

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, error: Exception) -> JSONResponse:
        return JSONResponse(oai.error_body(internal_error(log, request.url.path, error), "internal_error", 500), status_code=500)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, error: RequestValidationError) -> JSONResponse:
        problems = "; ".join(_describe(problem) for problem in error.errors())
        return JSONResponse(oai.error_body(problems, "invalid_request_error", 400), status_code=400)

    @app.exception_handler(HTTPException)
    async def _http_error(request: Request, error: HTTPException) -> JSONResponse:
        return JSONResponse(oai.error_body(str(error.detail), "invalid_request_error", error.status_code), error.status_code)

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/ready")
    async def ready() -> JSONResponse:
        problem = "draining" if app.state.draining else readiness.problem() if readiness is not None else ""
        if problem:
            return JSONResponse({"status": problem}, status_code=503)
        engine.get()  # PeerUnavailable (503) while the models load
        return JSONResponse({"status": "ready"})

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        info = await engine.get().target_info()
        card = {"id": model_name(info.model), "object": "model", "created": 0, "owned_by": "diffspec", "max_model_len": info.max_context}
        return {"object": "list", "data": [card]}

    @app.post("/v1/completions")
    async def completions(body: oai.CompletionRequest, http: Request) -> Response:
        loaded = engine.get()
        info = await loaded.target_info()
        client = _caller(http)
        prompt = body.prompt_value()
        if isinstance(prompt, list):
            prompt_ids = prompt
        elif not prompt:
            raise InvalidRequest("the prompt is empty")
        else:
            _check_chars(len(prompt), info)
            with loaded.core.quotas.holding(client):
                prompt_ids = await app.state.tokenizer_pool.run(encode_prompt, loaded.tokenizer, prompt)
        request = _request(loaded, body.generate_message(body.max_tokens), prompt_ids, client)
        return await _respond(loaded, request, body, model_name(info.model), chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: oai.ChatRequest, http: Request) -> Response:
        loaded = engine.get()
        info = await loaded.target_info()
        client = _caller(http)
        messages = body.chat_messages()
        chars = sum(len(m["content"]) for m in messages if isinstance(m.get("content"), str))
        _check_chars(chars, info)
        with loaded.core.quotas.holding(client):
            prompt_ids = await app.state.tokenizer_pool.run(render_chat, loaded.tokenizer, messages)
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        request = _request(loaded, body.generate_message(max_tokens), prompt_ids, client)
        return await _respond(loaded, request, body, model_name(info.model), chat=True)

    def _request(
        loaded: SpeculativeEngine, message: gateway_pb2.GenerateRequest, prompt_ids: list[int], client: str
    ) -> GenerationRequest:
        """gRPC's conversion and defaults, with OpenAI's temperature 1 where neither request nor checkpoint sets one."""
        request = generation_request(
            message, prompt_ids, settings, loaded.draft is not None, loaded.sampling_defaults, oai.DEFAULT_TEMPERATURE,
            loaded.core.info.max_context,
        )  # fmt: skip
        return replace(request, client=client)

    async def _respond(
        loaded: SpeculativeEngine, request: GenerationRequest, body: oai.SamplingFields, model: str, chat: bool
    ) -> Response:
        reply = _Reply(model, chat, loaded.tokenizer)
        chunks = _generation(loaded, request, metrics)
        if not body.stream:
            async with aclosing(chunks):
                async for chunk in chunks:
                    reply.add(chunk)
            return JSONResponse(reply.whole())
        try:
            first = await anext(chunks)  # admission and the engine's checks fail here, with a status
        except BaseException:
            await chunks.aclose()
            raise
        return StreamingResponse(
            _events(reply, first, chunks, request.n, body.include_usage), media_type="text/event-stream"
        )

    return app


class _Choice:
    """What one sample has produced so far."""

    def __init__(self) -> None:
        self.text = ""
        self.token_ids: list[int] = []
        self.logprobs: list[TokenLogprobs] = []
        self.stats: GenerationStats | None = None


class _Reply:
    """The OpenAI objects of one response: one id and creation time for all its chunks, and each choice's
    text, logprobs and stats as they arrive (``add``)."""

    def __init__(self, model: str, chat: bool, tokenizer: Tokenizer) -> None:
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model = model
        self.chat = chat
        self.tokenizer = tokenizer
        self.choices: dict[int, _Choice] = {}

    def add(self, chunk: GenerationChunk) -> None:
        choice = self.choices.setdefault(chunk.index, _Choice())
        choice.text += chunk.text
        choice.token_ids += chunk.token_ids
        if chunk.logprobs is not None:
            choice.logprobs.append(chunk.logprobs)
        choice.stats = chunk.stats or choice.stats

    def chunk_logprobs(self, chunk: GenerationChunk) -> dict[str, Any] | None:
        """The logprobs object of a chunk not yet added (None when it has none)."""
        if chunk.logprobs is None:
            return None
        offset = len(self.choices[chunk.index].text) if chunk.index in self.choices else 0
        return self._logprobs(chunk.token_ids, chunk.logprobs, offset)

    def _object(self, kind: str, **fields: Any) -> dict[str, Any]:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model, **fields}

    def _logprobs(self, token_ids: list[int], logprobs: TokenLogprobs, offset: int) -> dict[str, Any]:
        """The choice's logprobs object for ``token_ids``, whose text starts at ``offset`` in the choice's."""
        tokens = [self.tokenizer.decode([t]) for t in token_ids]
        alternatives = [[self.tokenizer.decode([t]) for t in ids] for ids in logprobs.top_ids]
        if self.chat:
            return oai.chat_logprobs(logprobs, tokens, alternatives)
        return oai.completion_logprobs(logprobs, tokens, alternatives, offset)

    def _stats(self) -> list[GenerationStats]:
        return [self.choices[i].stats for i in sorted(self.choices)]  # type: ignore[misc]  # every choice ended

    def _diffspec(self) -> Any:
        """The speculation statistics: the request's, or a list of each choice's when n > 1."""
        stats = [s.to_dict() for s in self._stats()]
        return stats[0] if len(stats) == 1 else stats

    def whole(self) -> dict[str, Any]:
        """A non-streamed response; ``diffspec`` holds the speculation statistics."""
        kind = "chat.completion" if self.chat else "text_completion"
        choices = []
        for index in sorted(self.choices):
            choice = self.choices[index]
            assert choice.stats is not None  # the engine's last chunk of each sample carries them
            logprobs = self._logprobs(choice.token_ids, TokenLogprobs.join(choice.logprobs), 0) if choice.logprobs else None
            one = oai.choice("chat" if self.chat else "completion", choice.text, oai.finish_reason(choice.stats),
                             index, logprobs)  # fmt: skip
            choices.append(one)
        return self._object(kind, choices=choices, usage=oai.usage(self._stats()), diffspec=self._diffspec())

    def chunk(self, index: int, text: str, finish: str | None, logprobs: dict[str, Any] | None) -> dict[str, Any]:
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        one = oai.choice("chat_delta" if self.chat else "completion", text, finish, index, logprobs)
        return self._object(kind, choices=[one])

    def role_chunk(self, index: int) -> dict[str, Any]:
        delta = {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
        return self._object("chat.completion.chunk", choices=[delta])

    def usage_chunk(self) -> dict[str, Any]:
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        return self._object(kind, choices=[], usage=oai.usage(self._stats()), diffspec=self._diffspec())


async def _generation(
    engine: SpeculativeEngine, request: GenerationRequest, metrics: ServingMetrics
) -> AsyncIterator[GenerationChunk]:
    """Every sample's stream, counted in the metrics; closing it aborts the request."""
    metrics.active_generations.inc()
    try:
        async with aclosing(generate_samples(engine, request)) as chunks:
            async for chunk in chunks:
                if chunk.stats is not None:
                    metrics.record_generation(chunk.stats)
                yield chunk
    finally:
        metrics.active_generations.dec()


async def _events(
    reply: _Reply, first: GenerationChunk, chunks: AsyncIterator[GenerationChunk], n: int, include_usage: bool
) -> AsyncIterator[str]:
    """Server-sent events: a chunk per engine chunk with text, each choice's finish reason on its last one."""
    async with aclosing(chunks):  # type: ignore[type-var]
        if reply.chat:
            for index in range(n):
                yield _sse(reply.role_chunk(index))
        chunk: GenerationChunk | None = first
        finished = 0
        try:
            while chunk is not None:
                logprobs = reply.chunk_logprobs(chunk)
                reply.add(chunk)
                if chunk.text or logprobs is not None or chunk.stats is not None:
                    finish = oai.finish_reason(chunk.stats) if chunk.stats is not None else None
                    yield _sse(reply.chunk(chunk.index, chunk.text, finish, logprobs))
                finished += chunk.stats is not None
                if finished == n:
                    if include_usage:
                        yield _sse(reply.usage_chunk())
                    break
                chunk = await anext(chunks, None)
        except DiffSpecError as failure:  # after the 200: the error goes in the stream, as OpenAI's does
            status, kind = status_of(failure)
            yield _sse(oai.error_body(str(failure), kind, status))
        except Exception as failure:  # noqa: BLE001 - a bug ends this stream with an id, not its text
            yield _sse(oai.error_body(internal_error(log, "a streamed completion", failure), "internal_error", 500))
        yield "data: [DONE]\n\n"


def _sse(event: dict[str, Any]) -> str:
    return f"data: {json.dumps(event, ensure_ascii=False)}\n\n"


def _describe(problem: dict[str, Any]) -> str:
    where = ".".join(str(part) for part in problem.get("loc", ()) if part != "body")
    return f"{where}: {problem.get('msg')}" if where else str(problem.get("msg"))


def _caller(request: Request) -> str:
    """The client a request comes from (gateway/quota.py): its API key's tenant, else its declared name,
    else its host."""
    host = request.client.host if request.client else ""
    return client_id(request.headers.get(CLIENT_HEADER), host, request.state.tenant or None)


def _check_chars(num_chars: int, info: TargetInfo) -> None:
    """A text too long for the context is refused before it costs tokenizer time."""
    if num_chars > MAX_CHARS_PER_TOKEN * info.max_context:
        raise InvalidRequest(f"a text of {num_chars} characters cannot fit the context of {info.max_context} tokens")


class _EmbeddedServer(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        # SIGTERM/SIGINT belong to the ServiceHost, which drains gRPC and then stops this server
        yield


class HttpServer:
    """uvicorn serving ``app`` on ``listen`` (host:port; port 0 picks one) in the running event loop; HTTPS
    with ``certfile``/``keyfile``, asking every client for a certificate of ``client_ca`` when that is set
    (the gRPC port's ``tls_cert``, ``tls_key`` and ``tls_client_ca``)."""

    def __init__(
        self, app: FastAPI, listen: str, grace_seconds: float, certfile: str = "", keyfile: str = "", client_ca: str = ""
    ) -> None:
        self.app = app
        host, _, port = listen.rpartition(":")
        if not host or not port.isdigit():
            raise InvalidRequest(f"http_listen must be host:port, got {listen!r}")
        self.host, self.port = host.strip("[]"), int(port)
        self.scheme = "https" if certfile else "http"
        tls: dict[str, Any] = {}
        if certfile:
            tls = {"ssl_certfile": certfile, "ssl_keyfile": keyfile}
        if client_ca:
            tls.update(ssl_ca_certs=client_ca, ssl_cert_reqs=ssl.CERT_REQUIRED)
        config = uvicorn.Config(
            app, lifespan="off", log_level="warning", access_log=False, timeout_graceful_shutdown=grace_seconds,
            **tls,
        )  # fmt: skip
        self.server = _EmbeddedServer(config)
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> str:
        """Bind, start serving, and return the bound host:port."""
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        try:
            sock = socket.create_server((self.host, self.port), family=family)
        except OSError as bad:
            raise InvalidRequest(f"cannot listen on {self.host}:{self.port}: {bad}") from None
        self._task = asyncio.create_task(self.server.serve(sockets=[sock]))
        while not self.server.started:
            if self._task.done():
                self._task.result()
                raise InvalidRequest(f"the HTTP server on {self.host}:{self.port} did not start")
            await asyncio.sleep(0.01)
        port = sock.getsockname()[1]
        return f"[{self.host}]:{port}" if family == socket.AF_INET6 else f"{self.host}:{port}"

    async def stop(self) -> None:
        """Stop accepting, give open responses the grace period, then cancel them (which aborts their requests)."""
        self.app.state.draining = True
        if self._task is not None:
            self.server.should_exit = True
            await self._task
            self._task = None
        self.app.state.tokenizer_pool.close()
