"""gRPC channel and server options from the settings: message size limits, keepalive, port reuse.

Both ends get the same numbers, so a server never rejects the pings its clients send
(a client pinging more often than the server allows is answered with GOAWAY). Servers bind
without SO_REUSEPORT: grpc sets it by default, and then a second server on a port in use
binds too and the kernel splits the connections between the two.

A channel speaks TLS when ``tls_ca`` is set (presenting ``tls_cert``/``tls_key`` as its client
certificate when those are set too), and every call sends ``auth_token`` when one is set.
"""

from __future__ import annotations

from pathlib import Path

import grpc

from diffspec.errors import InvalidRequest
from diffspec.settings import DiffSpecSettings

Options = list[tuple[str, int]]
Metadata = tuple[tuple[str, str], ...]


def _message_limits(settings: DiffSpecSettings) -> Options:
    return [
        ("grpc.max_send_message_length", settings.max_message_bytes),
        ("grpc.max_receive_message_length", settings.max_message_bytes),
    ]


def _keepalive(settings: DiffSpecSettings) -> Options:
    return [
        ("grpc.keepalive_time_ms", int(settings.keepalive_seconds * 1000)),
        ("grpc.keepalive_timeout_ms", int(settings.keepalive_timeout_seconds * 1000)),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
    ]


def server_options(settings: DiffSpecSettings) -> Options:
    # accept client pings up to twice as often as they are configured to come
    min_ping_ms = int(settings.keepalive_seconds * 1000) // 2
    return [
        *_message_limits(settings),
        *_keepalive(settings),
        ("grpc.http2.min_ping_interval_without_data_ms", min_ping_ms),
        ("grpc.so_reuseport", 0),
    ]


def read_pem(path: str, setting: str) -> bytes:
    """The bytes of a PEM file named by ``setting``; an unreadable one is a configuration error."""
    try:
        return Path(path).read_bytes()
    except OSError as bad:
        raise InvalidRequest(f"{setting}: cannot read {path}: {bad.strerror}") from None


def channel_credentials(settings: DiffSpecSettings) -> grpc.ChannelCredentials | None:
    """TLS trusting ``tls_ca``, with ``tls_cert``/``tls_key`` as the client certificate when set; None = plaintext."""
    if not settings.tls_ca:
        return None
    client_pair = {}
    if settings.tls_cert:
        client_pair = {
            "private_key": read_pem(settings.tls_key, "tls_key"),
            "certificate_chain": read_pem(settings.tls_cert, "tls_cert"),
        }
    return grpc.ssl_channel_credentials(root_certificates=read_pem(settings.tls_ca, "tls_ca"), **client_pair)


def call_metadata(settings: DiffSpecSettings) -> Metadata:
    """What every call sends: the bearer token when one is set."""
    return (("authorization", f"Bearer {settings.auth_token}"),) if settings.auth_token else ()


def open_channel(address: str, settings: DiffSpecSettings) -> grpc.aio.Channel:
    """A channel to ``host:port``: TLS when ``tls_ca`` is set, else plaintext (loopback or a trusted network)."""
    options = [*_message_limits(settings), *_keepalive(settings)]
    credentials = channel_credentials(settings)
    if credentials is None:
        return grpc.aio.insecure_channel(address, options=options)
    return grpc.aio.secure_channel(address, credentials, options=options)


def open_blocking_channel(address: str, settings: DiffSpecSettings) -> grpc.Channel:
    """The same channel for a caller on a plain thread (the engine loop's calls to its services)."""
    options = [*_message_limits(settings), *_keepalive(settings)]
    credentials = channel_credentials(settings)
    if credentials is None:
        return grpc.insecure_channel(address, options=options)
    return grpc.secure_channel(address, credentials, options=options)
