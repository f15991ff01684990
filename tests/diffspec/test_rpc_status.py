"""The one error <-> status mapping, both ways."""

from __future__ import annotations

import grpc
import pytest

from diffspec.errors import (
    CheckpointError,
    InvalidRequest,
    KVPoolExhausted,
    PeerUnavailable,
    ResourceExhausted,
)
from diffspec.rpc_status import error_for, status_for


@pytest.mark.parametrize(
    "error, code",
    [
        (InvalidRequest("x"), grpc.StatusCode.INVALID_ARGUMENT),
        (ResourceExhausted("x"), grpc.StatusCode.RESOURCE_EXHAUSTED),
        (KVPoolExhausted("x"), grpc.StatusCode.RESOURCE_EXHAUSTED),
        (PeerUnavailable("x"), grpc.StatusCode.UNAVAILABLE),
        (CheckpointError("x"), grpc.StatusCode.FAILED_PRECONDITION),
    ],
)
def test_status_for_each_typed_error(error, code):
    assert status_for(error) == code


@pytest.mark.parametrize(
    "code, kind",
    [
        (grpc.StatusCode.INVALID_ARGUMENT, InvalidRequest),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, ResourceExhausted),
        (grpc.StatusCode.UNAVAILABLE, PeerUnavailable),
        (grpc.StatusCode.DEADLINE_EXCEEDED, PeerUnavailable),
        (grpc.StatusCode.CANCELLED, PeerUnavailable),
        (grpc.StatusCode.INTERNAL, PeerUnavailable),
        (None, PeerUnavailable),
    ],
)
def test_error_for_each_status(code, kind):
    error = error_for("draft service", code, "details here")
    assert type(error) is kind and "details here" in str(error)
    if kind is PeerUnavailable:
        assert str(error).startswith("draft service unavailable")
