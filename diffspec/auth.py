"""Who may call a server, and as whom: bearer tokens for gRPC (UNAUTHENTICATED) and HTTP (401).

Two kinds of token. ``auth_token`` is one shared secret: every server and every channel of a
deployment (the gateway's to its services, the CLI's) carries it; it proves a caller may use the
server, not who it is. ``api_keys_file`` names the gateway's clients: each line ``TENANT TOKEN``,
and a caller with that token *is* that tenant, whatever else it declares; the tenant keys its
quota and its prefix-cache scope. Only the client-facing roles (``all``, ``gateway``) take API
keys, so a tenant's key opens no internal service. Health checks need no token: probes and load
balancers learn only SERVING or not.
"""

from __future__ import annotations

import hmac
from pathlib import Path
from typing import Any, Awaitable, Callable

import grpc

from diffspec.errors import InvalidRequest
from diffspec.settings import DiffSpecSettings

HEALTH_METHODS = "/grpc.health.v1.Health/"
SHARED = ""  # the tenant of the shared auth_token: allowed, not named
CLIENT_ROLES = ("all", "gateway")
HANDLER_FACTORIES = {
    "unary_unary": grpc.unary_unary_rpc_method_handler,
    "unary_stream": grpc.unary_stream_rpc_method_handler,
    "stream_unary": grpc.stream_unary_rpc_method_handler,
    "stream_stream": grpc.stream_stream_rpc_method_handler,
}


class ApiKeys:
    """token -> tenant; empty = no authentication."""

    def __init__(self, tenants: dict[str, str]) -> None:
        self._tenants = {f"Bearer {token}".encode(): tenant for token, tenant in tenants.items()}

    @classmethod
    def for_role(cls, settings: DiffSpecSettings, role: str) -> ApiKeys:
        """The shared token everywhere; the tenants' keys too on a client-facing role."""
        tenants = read_api_keys(settings.api_keys_file) if settings.api_keys_file and role in CLIENT_ROLES else {}
        if settings.auth_token:
            tenants[settings.auth_token] = SHARED
        return cls(tenants)

    @property
    def required(self) -> bool:
        return bool(self._tenants)

    def tenant_of(self, authorization: str | bytes | None) -> str | None:
        """The tenant an ``authorization`` header proves (SHARED for the shared token); None for no known token.
        Every key is compared in constant time, so the answer's timing spells out none of them."""
        given = authorization.encode() if isinstance(authorization, str) else authorization or b""
        found = None
        for expected, tenant in self._tenants.items():
            if hmac.compare_digest(given, expected):
                found = tenant
        return found


def read_api_keys(path: str) -> dict[str, str]:
    """token -> tenant from lines ``TENANT TOKEN`` ('#' comments, blank lines skipped)."""
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as bad:
        raise InvalidRequest(f"api_keys_file: cannot read {path}: {bad.strerror}") from None
    tenants: dict[str, str] = {}
    for number, line in enumerate(lines, start=1):
        fields = line.split("#", 1)[0].split()
        if not fields:
            continue
        if len(fields) != 2 or not fields[0].isprintable():
            raise InvalidRequest(f"api_keys_file {path}:{number}: expected 'TENANT TOKEN'")
        tenant, token = fields
        if token in tenants:
            raise InvalidRequest(f"api_keys_file {path}:{number}: a token given to two tenants")
        tenants[token] = tenant
    if not tenants:
        raise InvalidRequest(f"api_keys_file {path}: no keys")
    return tenants


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    """Refuses every call but a health check unless its ``authorization`` metadata holds a known token."""

    def __init__(self, keys: ApiKeys) -> None:
        self.keys = keys

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None or details.method.startswith(HEALTH_METHODS) or self._authorized(details):
            return handler
        for kind, factory in HANDLER_FACTORIES.items():
            if getattr(handler, kind) is not None:
                return factory(
                    _refuse,
                    request_deserializer=handler.request_deserializer,
                    response_serializer=handler.response_serializer,
                )
        return handler

    def _authorized(self, details: grpc.HandlerCallDetails) -> bool:
        return self.keys.tenant_of(dict(details.invocation_metadata or ()).get("authorization")) is not None


async def _refuse(request: Any, context: grpc.aio.ServicerContext) -> None:
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token")

