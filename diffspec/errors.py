"""Typed errors shared by every service; the gRPC servicers map each to one status code."""

from __future__ import annotations


class DiffSpecError(Exception):
    """Base class: anything the project raises on purpose."""


class InvalidRequest(DiffSpecError):
    """The caller sent something malformed or out of range (gRPC INVALID_ARGUMENT)."""


class ResourceExhausted(DiffSpecError):
    """No room right now: KV pages, sessions or queue slots (gRPC RESOURCE_EXHAUSTED)."""


class KVPoolExhausted(ResourceExhausted):
    """The paged KV pool has too few free pages for the request."""


class PeerUnavailable(DiffSpecError):
    """A draft or target service could not be reached or went away (gRPC UNAVAILABLE)."""


class DeadlineExceeded(DiffSpecError):
    """The request's deadline passed before it finished (gRPC DEADLINE_EXCEEDED)."""


class CheckpointError(DiffSpecError):
    """A model directory is missing, incomplete or not in a supported layout."""
