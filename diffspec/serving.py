"""What every DiffSpec server shares: one grpc.aio server with health checking, reflection,
keepalive and message-size options, Prometheus metrics, typed errors mapped to status codes,
and a life cycle of load -> serve -> drain on SIGTERM/SIGINT.

Health is NOT_SERVING while the models load and from the moment a drain starts; in between
it is SERVING. A drain stops accepting calls, gives in-flight streams
``shutdown_grace_seconds`` to finish, then cancels them, which releases their sessions.

With ``tls_cert``/``tls_key`` the port speaks only TLS (``tls_client_ca`` also asks every client
for a certificate), and with ``auth_token`` every call but a health check needs that bearer token.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import os
import signal
from typing import Any, Awaitable, Callable, Generic, TypeVar

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection

from diffspec.errors import DiffSpecError, InvalidRequest, PeerUnavailable
from diffspec.grpc_options import read_pem, server_options
from diffspec.health_probe import process_service
from diffspec.metrics import ServingMetrics
from diffspec.rpc_status import status_for
from diffspec.settings import DiffSpecSettings

log = logging.getLogger(__name__)

T = TypeVar("T")
Behavior = Callable[[Any, grpc.aio.ServicerContext], Awaitable[Any]]
OWN_METHODS = "/diffspec.v1."
HEALTH_METHODS = "/grpc.health.v1.Health/"
_HANDLER_FACTORIES = {
    "unary_unary": grpc.unary_unary_rpc_method_handler,
    "unary_stream": grpc.unary_stream_rpc_method_handler,
    "stream_unary": grpc.stream_unary_rpc_method_handler,
    "stream_stream": grpc.stream_stream_rpc_method_handler,
}


class Loading(Generic[T]):
    """A model the server loads after it starts answering health checks; calls before then get UNAVAILABLE."""

    def __init__(self, what: str) -> None:
        self.what = what
        self._value: T | None = None

    def set(self, value: T) -> None:
        self._value = value

    def get(self) -> T:
        if self._value is None:
            raise PeerUnavailable(f"{self.what} is still loading")
        return self._value


class StatusInterceptor(grpc.aio.ServerInterceptor):
    """Maps errors raised by the project's handlers to status codes and counts every call.

    Handlers must be coroutines (streaming ones use ``context.read``/``context.write``), so a
    cancellation always lands inside the handler and its ``finally`` blocks run at once.
    """

    def __init__(self, metrics: ServingMetrics) -> None:
        self.metrics = metrics

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None or not details.method.startswith(OWN_METHODS):
            return handler
        for kind, factory in _HANDLER_FACTORIES.items():
            behavior = getattr(handler, kind)
            if behavior is not None:
                # A unary request is parsed inside the guard, so an undecodable one is INVALID_ARGUMENT;
                # streamed requests are parsed by context.read(), which runs inside the guard anyway.
                unary_request = kind.startswith("unary_")
                return factory(
                    self._guard(details.method, behavior, handler.request_deserializer if unary_request else None),
                    request_deserializer=None if unary_request else handler.request_deserializer,
                    response_serializer=handler.response_serializer,
                )
        return handler

    def _guard(self, method: str, behavior: Behavior, parse: Callable[[bytes], Any] | None) -> Behavior:
        async def guarded(request: Any, context: grpc.aio.ServicerContext) -> Any:
            code = grpc.StatusCode.OK
            try:
                return await behavior(parse(request) if parse is not None else request, context)
            except grpc.aio.AbortError:
                code = context.code() or grpc.StatusCode.UNKNOWN
                raise
            except DecodeError as bad:
                code = grpc.StatusCode.INVALID_ARGUMENT
                await context.abort(code, f"malformed request message: {bad}")
            except DiffSpecError as failure:
                code = status_for(failure)
                await context.abort(code, str(failure))
            except asyncio.CancelledError:
                code = grpc.StatusCode.CANCELLED
                raise
            except Exception as failure:  # noqa: BLE001 - one request's bug must not take the server down
                code = grpc.StatusCode.INTERNAL
                log.exception("%s failed", method)
                await context.abort(code, f"internal error in {method}: {type(failure).__name__}: {failure}")
            finally:
                self.metrics.requests.labels(method, code.name).inc()

        return guarded


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    """Refuses every call but a health check unless it carries ``authorization: Bearer <token>``.

    Health checks stay open so probes and load balancers need no secret; they reveal only SERVING or not.
    """

    def __init__(self, token: str) -> None:
        self._expected = f"Bearer {token}".encode()

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None or details.method.startswith(HEALTH_METHODS) or self._authorized(details):
            return handler
        for kind, factory in _HANDLER_FACTORIES.items():
            if getattr(handler, kind) is not None:
                return factory(
                    _refuse,
                    request_deserializer=handler.request_deserializer,
                    response_serializer=handler.response_serializer,
                )
        return handler

    def _authorized(self, details: grpc.HandlerCallDetails) -> bool:
        given = dict(details.invocation_metadata or ()).get("authorization", "")
        # constant time, so the answer's timing does not spell out the token
        return hmac.compare_digest(given.encode() if isinstance(given, str) else given, self._expected)


async def _refuse(request: Any, context: grpc.aio.ServicerContext) -> None:
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token")


def server_credentials(settings: DiffSpecSettings) -> grpc.ServerCredentials | None:
    """TLS credentials from ``tls_cert``/``tls_key`` (and ``tls_client_ca`` for mutual TLS); None = plaintext."""
    if not settings.tls_cert:
        return None
    pair = [(read_pem(settings.tls_key, "tls_key"), read_pem(settings.tls_cert, "tls_cert"))]
    if not settings.tls_client_ca:
        return grpc.ssl_server_credentials(pair)
    client_ca = read_pem(settings.tls_client_ca, "tls_client_ca")
    return grpc.ssl_server_credentials(pair, root_certificates=client_ca, require_client_auth=True)


class ServiceHost:
    """One server process: its services on ``settings.listen``, plus health, reflection and metrics."""

    def __init__(self, settings: DiffSpecSettings, role: str) -> None:
        self.settings = settings
        self.role = role  # for the startup line: all, target, draft, gateway
        self.metrics = ServingMetrics()
        # the status interceptor is outermost, so refused calls are counted too
        interceptors: list[grpc.aio.ServerInterceptor] = [StatusInterceptor(self.metrics)]
        if settings.auth_token:
            interceptors.append(BearerTokenInterceptor(settings.auth_token))
        self.server = grpc.aio.server(interceptors=interceptors, options=server_options(settings))
        self.health = health_aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.service_names: list[str] = []
        self.address = settings.listen  # host:port, the port known once bound

    def add(self, servicer: object, add_to_server: Callable[[Any, grpc.aio.Server], None], service_name: str) -> None:
        add_to_server(servicer, self.server)
        self.service_names.append(service_name)

    async def run(self, load: Callable[[], Awaitable[None]], close: Callable[[], Awaitable[None]]) -> None:
        """Start, load (NOT_SERVING meanwhile), serve until SIGTERM/SIGINT, drain, then ``close``."""
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await self._start()
        loading = asyncio.ensure_future(load())
        stopping = asyncio.ensure_future(stop.wait())
        try:
            await asyncio.wait({loading, stopping}, return_when=asyncio.FIRST_COMPLETED)
            if loading.done():
                loading.result()  # a failed load raises here
                await self._set_status(health_pb2.HealthCheckResponse.SERVING)
                await self.health.set(process_service(os.getpid()), health_pb2.HealthCheckResponse.SERVING)
                print(f"diffspec {self.role} ready: serving on {self.address}", flush=True)
                await stopping
        finally:
            stopping.cancel()
            loading.cancel()  # a load still waiting (for a remote target, say) ends with the server
            await self.health.enter_graceful_shutdown()
            await self.server.stop(self.settings.shutdown_grace_seconds)
            if loading.done() and not loading.cancelled() and loading.exception() is None:
                await close()

    async def _start(self) -> None:
        names = [
            *self.service_names,
            health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
            reflection.SERVICE_NAME,
        ]
        reflection.enable_server_reflection(names, self.server)
        host = self.settings.listen.rsplit(":", 1)[0].strip("[]")
        credentials = server_credentials(self.settings)
        try:
            if credentials is None:
                port = self.server.add_insecure_port(self.settings.listen)
            else:
                port = self.server.add_secure_port(self.settings.listen, credentials)
        except RuntimeError as bad:
            raise InvalidRequest(f"cannot listen on {self.settings.listen}: in use, or not this host's ({bad})") from None
        await self._set_status(health_pb2.HealthCheckResponse.NOT_SERVING)
        await self.server.start()
        if self.settings.metrics_port:
            self.metrics.serve_http(host, self.settings.metrics_port)
        self.address = f"{host}:{port}"
        # the one line on stdout: with --listen HOST:0, this is how a caller learns the port
        print(f"diffspec {self.role} listening on {self.address}", flush=True)

    async def _set_status(self, status: health_pb2.HealthCheckResponse.ServingStatus) -> None:
        for name in ("", *self.service_names):
            await self.health.set(name, status)
