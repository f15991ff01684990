"""Per-client quotas: who a request comes from, and how much of the engine one client may hold.

A client is the tenant its API key names when the gateway has ``api_keys_file`` (``diffspec/auth.py``),
else the name it declares in the ``x-diffspec-client`` header (gRPC metadata or HTTP), else the host
it connects from. The client keys two things: this module's caps (requests admitted at once, and
their prompt + max_new_tokens summed), so that one client's flood is refused while another client's
requests still get in; and the target's prefix-cache scope, so that pages are shared only between
requests of one client (with API keys: one tenant). A declared name is only as private as it is hard
to guess (as vLLM's ``cache_salt``): the shared bearer token proves a caller may use the server, not
who it is; an API key proves who.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from diffspec.errors import InvalidRequest, ResourceExhausted

CLIENT_HEADER = "x-diffspec-client"
MAX_CLIENT_NAME_CHARS = 128


def client_id(declared: str | None, peer_host: str, tenant: str | None = None) -> str:
    """The quota key and cache scope of a caller: ``tenant:<name>`` when its API key names one (it cannot
    declare itself anyone else), else ``name:<declared>`` or ``peer:<host>``; the prefixes keep a declared
    name from posing as a tenant or another caller's host."""
    if tenant:
        return f"tenant:{tenant}"
    if declared:
        if len(declared) > MAX_CLIENT_NAME_CHARS or not declared.isprintable():
            raise InvalidRequest(f"{CLIENT_HEADER} must be at most {MAX_CLIENT_NAME_CHARS} printable characters")
        return f"name:{declared}"
    return f"peer:{peer_host}"


def grpc_peer_host(peer: str) -> str:
    """'ipv4:127.0.0.1:5432' -> '127.0.0.1', 'ipv6:[::1]:5432' -> '::1'; a unix socket keeps its path.
    The port goes: a client's many connections are one client."""
    kind, _, address = peer.partition(":")
    if kind in ("ipv4", "ipv6"):
        return address.rpartition(":")[0].strip("[]")
    return peer


@dataclass(frozen=True)
class QuotaLimits:
    max_requests: int = 0  # generations one client may have admitted (running or queued); 0 = no cap
    max_tokens: int = 0  # prompt + max_new_tokens over one client's admitted generations; 0 = no cap


class ClientQuotas:
    """What each client holds; thread-safe (front ends admit, the engine thread lets go)."""

    def __init__(self, limits: QuotaLimits) -> None:
        self.limits = limits
        self._requests: Counter[str] = Counter()
        self._tokens: Counter[str] = Counter()
        self._lock = threading.Lock()

    def admit(self, client: str, tokens: int) -> None:
        """Count a generation of ``tokens`` against ``client``, or raise (ResourceExhausted while the client
        holds too much, InvalidRequest when the one generation is over the cap) and count nothing."""
        limits = self.limits
        if limits.max_tokens and tokens > limits.max_tokens:
            raise InvalidRequest(f"a generation of {tokens} tokens exceeds client_max_tokens={limits.max_tokens}")
        with self._lock:
            if limits.max_requests and self._requests[client] >= limits.max_requests:
                raise ResourceExhausted(
                    f"this client already has {self._requests[client]} generations in flight "
                    f"(client_max_requests={limits.max_requests}); retry later"
                )
            if limits.max_tokens and self._tokens[client] + tokens > limits.max_tokens:
                raise ResourceExhausted(
                    f"this client's generations in flight would hold {self._tokens[client] + tokens} tokens "
                    f"(client_max_tokens={limits.max_tokens}); retry later"
                )
            self._requests[client] += 1
            self._tokens[client] += tokens

    @contextmanager
    def holding(self, client: str) -> Iterator[None]:
        """One of ``client``'s request slots for work before the engine (tokenizing a prompt, ``Tokenize``):
        a client at its cap is refused before the work costs anything."""
        self.admit(client, 0)
        try:
            yield
        finally:
            self.leave(client, 0)

    def leave(self, client: str, tokens: int) -> None:
        with self._lock:
            self._requests[client] -= 1
            self._tokens[client] -= tokens
            if not self._requests[client]:
                del self._requests[client], self._tokens[client]

    def held(self, client: str) -> tuple[int, int]:
        """(generations, tokens) the client holds now."""
        with self._lock:
            return self._requests[client], self._tokens[client]
