"""gRPC channel and server options from the settings: message size limits, keepalive, port reuse.

Both ends get the same numbers, so a server never rejects the pings its clients send
(a client pinging more often than the server allows is answered with GOAWAY). Servers bind
without SO_REUSEPORT: grpc sets it by default, and then a second server on a port in use
binds too and the kernel splits the connections between the two.
"""

from __future__ import annotations

import grpc

from diffspec.settings import DiffSpecSettings

Options = list[tuple[str, int]]


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


def open_channel(address: str, settings: DiffSpecSettings) -> grpc.aio.Channel:
    """An insecure channel to ``host:port`` (services talk inside one trusted network)."""
    return grpc.aio.insecure_channel(address, options=[*_message_limits(settings), *_keepalive(settings)])


def open_blocking_channel(address: str, settings: DiffSpecSettings) -> grpc.Channel:
    """The same channel for a caller on a plain thread (the engine loop's calls to its services)."""
    return grpc.insecure_channel(address, options=[*_message_limits(settings), *_keepalive(settings)])
