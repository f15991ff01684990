"""What every DiffSpec server shares: one grpc.aio server with health checking, reflection,
keepalive and message-size options, Prometheus metrics, typed errors mapped to status codes,
and a life cycle of load -> serve -> drain on SIGTERM/SIGINT.

Health (``Readiness``) is NOT_SERVING while the models load, while a watched dependency does not
answer (a gateway's remote target), and from the moment a drain starts. A drain keeps the
listener open, so health answers NOT_SERVING and new calls get UNAVAILABLE, while in-flight calls
get ``shutdown_grace_seconds`` to finish; then the listener closes and what still runs is
cancelled, which releases its sessions. A handler's unexpected exception reaches the caller as
INTERNAL with a request id only; its text and traceback go to the log under that id.

With ``tls_cert``/``tls_key`` the port speaks only TLS (``tls_client_ca`` also asks every client
for a certificate); with ``auth_token`` or ``api_keys_file`` every call but a health check needs a
known bearer token (``diffspec/auth.py``).
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Generic, TypeVar

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection

from diffspec.auth import HANDLER_FACTORIES, ApiKeys, BearerTokenInterceptor
from diffspec.errors import DiffSpecError, InvalidRequest, PeerUnavailable
from diffspec.grpc_options import read_pem, server_options
from diffspec.health_probe import process_service
from diffspec.metrics import ServingMetrics
from diffspec.rpc_status import internal_error, status_for
from diffspec.settings import DiffSpecSettings

log = logging.getLogger(__name__)

T = TypeVar("T")
Behavior = Callable[[Any, grpc.aio.ServicerContext], Awaitable[Any]]
OWN_METHODS = "/diffspec.v1."
DRAIN_POLL_S = 0.05


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
        self.draining = False  # set when a drain starts: new calls get UNAVAILABLE, health still answers
        self.in_flight = 0  # the project's calls running now

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None or not details.method.startswith(OWN_METHODS):
            return handler
        for kind, factory in HANDLER_FACTORIES.items():
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
            self.in_flight += 1
            try:
                if self.draining:
                    raise PeerUnavailable("the server is draining; retry on another")
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
                await context.abort(code, internal_error(log, method, failure))
            finally:
                self.in_flight -= 1
                self.metrics.requests.labels(method, code.name).inc()

        return guarded


def server_credentials(settings: DiffSpecSettings) -> grpc.ServerCredentials | None:
    """TLS credentials from ``tls_cert``/``tls_key`` (and ``tls_client_ca`` for mutual TLS); None = plaintext."""
    if not settings.tls_cert:
        return None
    pair = [(read_pem(settings.tls_key, "tls_key"), read_pem(settings.tls_cert, "tls_cert"))]
    if not settings.tls_client_ca:
        return grpc.ssl_server_credentials(pair)
    client_ca = read_pem(settings.tls_client_ca, "tls_client_ca")
    return grpc.ssl_server_credentials(pair, root_certificates=client_ca, require_client_auth=True)


@dataclass
class Readiness:
    """What gRPC health and the HTTP ``/ready`` report: SERVING once loaded, while every watched dependency
    answers, until a drain starts."""

    loaded: bool = False
    draining: bool = False
    unreachable: set[str] = field(default_factory=set)  # watched dependencies that do not answer now

    def problem(self) -> str:
        """Why the server is not serving; '' when it is."""
        if self.draining:
            return "draining"
        if not self.loaded:
            return "loading"
        if self.unreachable:
            return f"{', '.join(sorted(self.unreachable))} unreachable"
        return ""


Probe = Callable[[], Awaitable[bool]]


class ServiceHost:
    """One server process: its services on ``settings.listen``, plus health, reflection and metrics."""

    def __init__(self, settings: DiffSpecSettings, role: str) -> None:
        self.settings = settings
        self.role = role  # for the startup line: all, target, draft, gateway
        self.metrics = ServingMetrics()
        self.readiness = Readiness()
        self.status = StatusInterceptor(self.metrics)
        # the status interceptor is outermost, so refused calls are counted too
        interceptors: list[grpc.aio.ServerInterceptor] = [self.status]
        keys = ApiKeys.for_role(settings, role)
        if keys.required:
            interceptors.append(BearerTokenInterceptor(keys))
        self.server = grpc.aio.server(interceptors=interceptors, options=server_options(settings))
        self.health = health_aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.service_names: list[str] = []
        self.address = settings.listen  # host:port, the port known once bound
        self._probes: list[tuple[str, Probe, float]] = []

    def add(self, servicer: object, add_to_server: Callable[[Any, grpc.aio.Server], None], service_name: str) -> None:
        add_to_server(servicer, self.server)
        self.service_names.append(service_name)

    def watch(self, dependency: str, answers: Probe, every_s: float) -> None:
        """Once serving, ask ``answers`` every ``every_s`` seconds; NOT_SERVING while it says False."""
        self._probes.append((dependency, answers, every_s))

    async def run(self, load: Callable[[], Awaitable[None]], close: Callable[[], Awaitable[None]]) -> None:
        """Start, load (NOT_SERVING meanwhile), serve until SIGTERM/SIGINT, drain, then ``close``."""
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await self._start()
        loading = asyncio.ensure_future(load())
        stopping = asyncio.ensure_future(stop.wait())
        watching: list[asyncio.Future[None]] = []
        try:
            await asyncio.wait({loading, stopping}, return_when=asyncio.FIRST_COMPLETED)
            if loading.done():
                loading.result()  # a failed load raises here
                self.readiness.loaded = True
                await self._publish()
                print(f"diffspec {self.role} ready: serving on {self.address}", flush=True)
                watching = [asyncio.ensure_future(self._watch(*probe)) for probe in self._probes]
                await stopping
        finally:
            for task in (stopping, loading, *watching):
                task.cancel()  # a load still waiting (for a remote target, say) ends with the server
            await self._drain()
            if loading.done() and not loading.cancelled() and loading.exception() is None:
                await close()

    async def _drain(self) -> None:
        """NOT_SERVING at once, with the listener still open: health answers it and new calls get UNAVAILABLE,
        so balancers move away; in-flight calls get ``shutdown_grace_seconds`` to end, then are cancelled."""
        self.readiness.draining = self.status.draining = True
        await self.health.enter_graceful_shutdown()
        loop = asyncio.get_running_loop()
        ends = loop.time() + self.settings.shutdown_grace_seconds
        while self.status.in_flight and loop.time() < ends:
            await asyncio.sleep(DRAIN_POLL_S)
        await self.server.stop(0)

    async def _watch(self, dependency: str, answers: Probe, every_s: float) -> None:
        while True:
            answered = await answers()
            if answered == (dependency in self.readiness.unreachable):  # it changed
                self.readiness.unreachable ^= {dependency}
                log.warning("%s %s", dependency, "answers again" if answered else "does not answer: NOT_SERVING")
                await self._publish()
            await asyncio.sleep(every_s)

    async def _publish(self) -> None:
        """Health of the server, each service and this process (the health probe's --wait-for) from readiness."""
        serving = not self.readiness.problem()
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", *self.service_names, process_service(os.getpid())):
            await self.health.set(name, status)

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
        if self.settings.metrics_port:  # before the server starts, so a taken port stops a server never started
            self.metrics.serve_http(host, self.settings.metrics_port)
        await self._publish()
        await self.server.start()
        self.address = f"{host}:{port}"
        # the one line on stdout: with --listen HOST:0, this is how a caller learns the port
        print(f"diffspec {self.role} listening on {self.address}", flush=True)


def model_name(checkpoint: str | os.PathLike[str]) -> str:
    """A checkpoint's name for callers (Info RPCs, /v1/models): its directory's name, never the host path."""
    return os.path.basename(os.path.normpath(checkpoint))


class StepWorker:
    """Runs one ``Step`` stream's work on worker threads, one call at a time, and its final release only after
    the call in flight has ended. A thread cannot be cancelled: a stream cancelled while a step opens
    sessions would otherwise release before that step ran, and the sessions it opens would leak."""

    def __init__(self) -> None:
        self._running: asyncio.Future[Any] | None = None

    async def run(self, work: Callable[..., T], *args: Any) -> T:
        self._running = asyncio.ensure_future(asyncio.to_thread(work, *args))
        return await asyncio.shield(self._running)

    async def finally_run(self, work: Callable[..., Any], *args: Any) -> None:
        """``work(*args)`` once the call in flight (if any) has ended, whatever cancels the caller meanwhile."""

        async def after_running() -> None:
            if self._running is not None:
                await asyncio.wait([self._running])
            await asyncio.to_thread(work, *args)

        await asyncio.shield(after_running())
