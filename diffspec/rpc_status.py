"""The one mapping between the project's typed errors and gRPC status codes, both ways.

Servers turn a raised ``DiffSpecError`` into its status code (``status_for``); clients turn a
failed call back into the typed error (``error_for``), so the gateway's engine sees the same
exceptions from a remote draft or target as from an in-process one. Any status that says
the peer could not do the work (UNAVAILABLE, CANCELLED, DEADLINE_EXCEEDED, INTERNAL, ...)
comes back as ``PeerUnavailable``: for the draft, that is what makes the engine finish with Auto.
An unexpected exception is never sent as text: ``internal_error`` logs it under a request id and
returns the message that names only that id.
"""

from __future__ import annotations

import logging
import uuid

import grpc

from diffspec.errors import (
    CheckpointError,
    DeadlineExceeded,
    DiffSpecError,
    InvalidRequest,
    PeerUnavailable,
    ResourceExhausted,
)

# Most specific first: KVPoolExhausted is found through ResourceExhausted.
_STATUS_OF: tuple[tuple[type[DiffSpecError], grpc.StatusCode], ...] = (
    (InvalidRequest, grpc.StatusCode.INVALID_ARGUMENT),
    (ResourceExhausted, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (PeerUnavailable, grpc.StatusCode.UNAVAILABLE),
    (CheckpointError, grpc.StatusCode.FAILED_PRECONDITION),
    (DeadlineExceeded, grpc.StatusCode.DEADLINE_EXCEEDED),
)
_ERROR_OF: dict[grpc.StatusCode, type[DiffSpecError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidRequest,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ResourceExhausted,
}


def status_for(error: DiffSpecError) -> grpc.StatusCode:
    for kind, code in _STATUS_OF:
        if isinstance(error, kind):
            return code
    return grpc.StatusCode.INTERNAL


def error_for(peer: str, code: grpc.StatusCode | None, details: str | None) -> DiffSpecError:
    """The typed error a client raises for a call to ``peer`` (e.g. "target service") that ended with ``code``.

    A rejected request keeps the peer's message as is: it is meant for the caller.
    """
    kind = _ERROR_OF.get(code) if code is not None else None
    if kind is not None:
        return kind(details or code.name)
    return PeerUnavailable(f"{peer} unavailable ({code.name if code is not None else 'no status'}): {details}")


def internal_error(logger: logging.Logger, where: str, error: BaseException) -> str:
    """Log ``error`` with its traceback under a fresh request id; what the caller is told instead of its text
    (which may hold paths, tensor contents or another request's data)."""
    request_id = uuid.uuid4().hex[:16]
    logger.error("%s failed (request id %s)", where, request_id, exc_info=error)
    return f"internal error (request id {request_id}; the server's log has the details)"
